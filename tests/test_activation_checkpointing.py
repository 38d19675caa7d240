"""Activation checkpointing (``TrainConfig.activation_checkpointing``, ``models/checkpointing.py``): the same
gradients and weights as without it, less memory held through the backward, and the estimate that says so.

The pipeline's stages with it: ``tests/test_pipeline_equivalence.py`` (case ``lm-p2-1f1b-checkpointed``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import raytrain_mgpu as rtm
from raytrain_mgpu.bench.activation_checkpointing import heap_in_use
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.checkpointing import checkpoint_blocks, checkpointed_indices
from raytrain_mgpu.planning.memory import profile_config, profile_model

LM = dict(num_layers=3, hidden=32, num_heads=2, dropout=0.2)  # dropout: the recompute must draw the same masks


def _grads(model, x, y) -> dict:
    torch.manual_seed(7)  # the dropout masks of this forward
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("every", [1, 2])
def test_checkpointed_blocks_give_exactly_the_gradients_and_keep_their_names(every):
    torch.manual_seed(0)
    plain = build_model("transformer_lm", (16,), 50, LM)
    checkpointed = copy.deepcopy(plain)
    assert checkpoint_blocks(checkpointed, every) == len(checkpointed_indices(5, every)) == {1: 5, 2: 2}[every]
    assert [type(b).__name__.startswith("Checkpointed") for b in checkpointed.children()] == [
        (i + 1) % every == 0 for i in range(5)]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # checkpoints and load_model() unchanged
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    expected, got = _grads(plain, x, y), _grads(checkpointed, x, y)
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    assert checkpoint_blocks(checkpointed, every) == len(checkpointed_indices(5, every))  # twice: no nesting
    assert type(list(checkpointed.children())[every - 1]).__mro__[2] is not type(list(checkpointed.children())[every - 1])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "mp"])
def test_the_ray_train_workers_loop_trains_the_same_weights_with_it(strategy, gloo_group):
    """The engine a Ray Train worker runs (here in this process, one rank: tests/_engine.py): an epoch with every
    second block checkpointed ends with the weights of the epoch without, for a replicated (ddp), a sharded (fsdp,
    FSDP2's hooks around the checkpointed blocks, over the one-rank gloo group) and a split model (mp, over 2 CPU
    stand-in devices)."""
    from _engine import make_engine

    fields = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[16], num_classes=32,
                  num_samples=96, model_kwargs={"num_layers": 3, "hidden": 16, "num_heads": 2},
                  batch_size=16, epochs=1, optimizer="sgd", lr=0.1, strategy=strategy)
    if strategy == "mp":
        fields.update(gpus_per_worker=2)  # 2 stand-in devices on a CPU worker

    def one_epoch(every: int) -> tuple:
        engine = make_engine({**fields, "activation_checkpointing": every})
        assert engine.steps.checkpointed_blocks == (2 if every else 0)  # blocks 2 of 3 layers (and none)
        row = engine.train_epoch(0)
        return engine.steps.model_state(), row

    plain, plain_row = one_epoch(0)
    checkpointed, row = one_epoch(2)
    assert checkpointed.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(checkpointed[key], value), key
    assert row["train_loss"] == plain_row["train_loss"] and row["step"] == plain_row["step"] == 6


def test_it_holds_less_through_the_backward_as_the_estimate_says():
    """A transformer LM (6 blocks, hidden 64, 128 tokens, batch 64): without checkpointing each block keeps its
    attention and feed-forward activations until the backward (~18x its input); checkpointed, only its input.
    Measured: the memory the forward leaves allocated for the backward (one torch thread: the main arena).
    The estimate (``ModelProfile.activations``) is an upper bound of both, and the saving is most of it.
    (A block that saves little beyond its input, as an MLP's Linear + ReLU, gains nothing: its estimate
    says about 0.)"""
    shape, batch, kwargs = (128,), 64, {"num_layers": 6, "hidden": 64, "num_heads": 4}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        held = {}
        for every in (0, 1):
            torch.manual_seed(0)
            model = build_model("transformer_lm", shape, 256, kwargs)
            checkpoint_blocks(model, every)
            x = torch.randint(0, 256, (batch, *shape))
            before = heap_in_use()
            logits = model(x)  # the graph (and what it saved) lives as long as logits does
            held[every] = heap_in_use() - before
            del logits
    finally:
        torch.set_num_threads(threads)
    with torch.device("meta"):
        meta = build_model("transformer_lm", shape, 256, kwargs)
    estimated = {every: profile_model(meta, shape, checkpoint_every=every).activations() * batch for every in (0, 1)}
    mib = {k: f"{v / 2**20:.0f} MiB" for k, v in {**{f"held {k}": v for k, v in held.items()},
                                                     **{f"estimated {k}": v for k, v in estimated.items()}}.items()}
    print(mib)
    assert held[0] <= estimated[0] and held[1] <= estimated[1], mib  # upper bounds
    assert held[1] < 0.4 * held[0], mib  # 60 % or more of the activations not held (measured: ~75 %)
    assert estimated[1] < 0.4 * estimated[0], mib


def test_the_memory_estimate_and_the_config_checks():
    cfg = rtm.TrainConfig(model="transformer_lm", dataset="synthetic_text", input_shape=[64], num_classes=1000,
                          model_kwargs={"num_layers": 4, "hidden": 64, "num_heads": 2})
    plain, every, half = (profile_config(cfg.replace(activation_checkpointing=k)) for k in (0, 1, 2))
    assert every.activations() < half.activations() < plain.activations()
    assert plain.block_recompute_bytes == () and max(every.block_recompute_bytes) == max(plain.block_activation_bytes)
    with pytest.raises(ValueError, match=r"activation_checkpointing=-1: must be an integer >= 0"):
        rtm.TrainConfig(activation_checkpointing=-1)


def test_a_model_without_blocks_is_refused_before_ray():
    from raytrain_mgpu.driver.preflight import check_model_builds

    cfg = rtm.TrainConfig(model="torchvision.models:resnet18", dataset="synthetic", input_shape=[3, 32, 32],
                          num_classes=10, activation_checkpointing=1)
    with pytest.raises(ValueError, match=r"activation_checkpointing=1 checkpoints blocks, and model ResNet cannot "
                                         r"be split into stages: it is not an nn.Sequential and has no blocks\(\)"):
        check_model_builds(cfg, (3, 32, 32), 10)
