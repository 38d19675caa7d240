"""A Hugging Face ``transformers`` model, built from a config (no download), on dict batches, with the
built-in loss and metric (they read ``.logits`` of its ``ModelOutput``): ddp's steps in one process
against the plain model, and fsdp through ``fit`` over 2 workers against what one worker trains in this
process. ``transformers`` is a test extra."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data.base import Datasets
from raytrain_mgpu.models import build_model

# A test extra, checked without importing it (every pytest process collects this module): skipped where it
# is missing, a failure on CI (tests/_extras.py). The helper is imported only then: Ray's workers import this
# module by name, and only its own file is shipped to them.
if importlib.util.find_spec("transformers") is None:
    from _extras import require

    require("transformers")

VOCAB, LENGTH = 64, 16


def tiny_bert(num_classes):
    """``BertForSequenceClassification`` at test size, no dropout (the steps compare exactly)."""
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=LENGTH, num_labels=num_classes,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


class _Tokens(torch.utils.data.Dataset):
    """Token sequences as a tokenizer gives them (``input_ids``, ``attention_mask``); the class is whether the
    first token is in the vocabulary's lower half."""

    def __init__(self, count: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long)}, \
            int(self.ids[i, 0] < VOCAB // 2)


def token_classes(cfg):
    shape = {"input_ids": (LENGTH,), "attention_mask": (LENGTH,)}
    return Datasets(_Tokens(256, cfg.seed), _Tokens(64, cfg.seed + 1), shape, 2)


def test_ddp_takes_the_plain_models_steps_on_a_transformers_model(gloo_group):
    from torch.nn.parallel import DistributedDataParallel

    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.engine.optim import build_optimizer
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    cfg = rtm.TrainConfig(model="test_huggingface:tiny_bert", dataset="test_huggingface:token_classes",
                          batch_size=8, optimizer="sgd", lr=0.1)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, {"input_ids": (LENGTH,)}, 2, {})
    plain = copy.deepcopy(built)
    ctx = WorkerContext(world_rank=0, world_size=2, local_rank=0, local_world_size=1, node_rank=0,
                        devices=(torch.device("cpu"),))  # told 2 ranks, so ddp wraps over the one-rank group
    wrapper = build_worker(get_strategy("ddp"), cfg.parallel, ctx, Objective.of(cfg, 2))
    wrapped = wrapper.setup_model(built)
    assert isinstance(wrapped, DistributedDataParallel)
    optimizer, plain_optimizer = build_optimizer(wrapped.parameters(), cfg.optim), build_optimizer(
        plain.parameters(), cfg.optim)
    batch = torch.utils.data.DataLoader(token_classes(cfg.data).train, batch_size=8)
    for step, (x, y) in zip(range(2), batch):
        loss, outputs = wrapper.placement.compute_loss(wrapper, wrapped, x, y)  # the dict as keyword arguments, loss over .logits
        loss.backward()
        want = torch.nn.functional.cross_entropy(plain(**x).logits, y)
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
        for name, param in wrapper.unwrap(wrapped).named_parameters():
            torch.testing.assert_close(param.grad, dict(plain.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
        for opt in (optimizer, plain_optimizer):
            opt.step()
            opt.zero_grad()
    assert Objective.of(cfg, 2).measure(outputs, y)[0][1] == len(y)  # accuracy counted over the logits


@pytest.mark.ray
def test_a_transformers_model_trains_sharded_by_fsdp_through_fit(ray_session, storage):
    from _reference import train_one_worker

    fields = dict(model="test_huggingface:tiny_bert", dataset="test_huggingface:token_classes", strategy="fsdp",
                  num_workers=2, use_gpu=False, batch_size=32, optimizer="adamw", lr=3e-3, epochs=3, name="bert-fsdp")
    cfg = rtm.TrainConfig(**fields, storage_path=storage)
    result = rtm.fit(cfg)
    first, last = result.history[0], result.history[-1]
    assert last["step"] == 3 * (256 // 32) and math.isfinite(last["train_loss"])
    assert last["train_loss"] < first["train_loss"] and last["test_accuracy"] > 0.6  # learnt the first token
    model = result.load_model()  # rebuilt by the factory, the gathered (unsharded) weights loaded
    import transformers

    assert isinstance(model, transformers.BertForSequenceClassification)
    # the gathered shards are the weights one worker trains from the same config (in this process: the plain
    # model's arithmetic, fsdp's ddp twin), not merely a checkpoint that loads. 24 AdamW steps of 2 shards
    # against one model: at most 6.2e-6 apart (2-core VM), the bound 5x that; the losses to 2e-8 relative
    want, _, _, history = train_one_worker(fields)
    state = model.state_dict()
    assert state.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=3e-5, msg=key)
    assert [row["train_loss"] for row in result.history] == pytest.approx([row["train_loss"] for row in history],
                                                                          rel=1e-4)
    ids = token_classes(cfg.data).test.ids[:4]
    assert model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (4, 2)
