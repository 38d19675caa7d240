"""Random streams: identical initial weights on every rank, then each rank its own stream.

With one seed everywhere every rank drew the same dropout masks: the global batch then
behaves like R copies of one mask. The engine's ``build_model`` (``checkpointing/contents.py``) seeds,
builds, then gives rank r the stream ``seed + 1 + r``; checkpoints keep every rank's CPU (and CUDA) generator
state, and a resume with the same world size continues each rank's stream. No Ray.
"""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.checkpointing.contents import Restored, build_model, restore_rng, rng_state
from raytrain_mgpu.engine.run_state import RunState
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from test_precision import _emulated_gpu, _engine  # noqa: F401 (the fixture, for the engine under use_gpu)

CFG = dict(model="transformer_lm", dataset="synthetic_text", strategy="ddp", num_workers=2, batch_size=8, seed=5,
           model_kwargs={"num_layers": 1, "hidden": 16, "num_heads": 2, "dropout": 0.5})


def _ctx(rank: int, world: int = 2) -> WorkerContext:
    return WorkerContext(rank, world, rank, world, 0, (torch.device("cpu"),))


def _rank_model(rank: int):
    cfg = TrainConfig(**CFG)
    steps = build_worker(get_strategy("ddp"), cfg.parallel, _ctx(rank))
    return build_model(cfg, steps, SimpleNamespace(input_shape=(12,), num_classes=50))


def _restore_rng(states, seed: int, ctx, step: int) -> None:
    """What a resumed rank does with the checkpoint's generators (``rng_per_rank``)."""
    restore_rng(Restored(RunState(), train_state={"rng_per_rank": states}), seed, ctx, step)


_rng_state = rng_state


def _dropout_output(model) -> torch.Tensor:
    model.train()
    with torch.no_grad():
        return model(torch.arange(24).reshape(2, 12) % 50)


def test_ranks_start_equal_and_draw_different_dropout_masks():
    models, outputs = [], []
    for rank in (0, 1, 0):
        models.append(_rank_model(rank))
        outputs.append(_dropout_output(models[-1]))  # the rank's first draws after the build
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        assert torch.equal(a, b)  # identical initial weights
    assert not torch.allclose(outputs[0], outputs[1])  # rank 0 and rank 1 drop different units
    assert torch.equal(outputs[0], outputs[2])  # and each rank's stream is reproducible


def test_resume_continues_each_ranks_stream(tmp_path):
    storage = str(tmp_path / "runs")
    loop = _engine(storage)
    torch.manual_seed(123)  # somewhere in the run's stream
    loop.state = loop.checkpoints.saver.state = RunState(epoch=1, step=2)
    loop.checkpoints.saver.save({"epoch": 1})
    draws = torch.rand(5)  # what the run would have drawn next
    torch.manual_seed(999)  # a restart starts from anywhere
    fresh = _engine(storage)  # its set-up builds the model on the run's seed, then restores the stream
    assert torch.equal(torch.rand(5), draws)
    states = torch.load(f"{fresh.state.checkpoint}/train_state.pt", weights_only=True)["rng_per_rank"]
    assert len(states) == 1 and states[0]["cpu"].dtype == torch.uint8
    assert len(states[0]["cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_each_rank_restores_its_own_state_when_the_world_size_matches():
    states = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        states.append(_rng_state())  # what save_and_report gathers from each rank
    want = torch.rand(3)  # the next draw of seed 11's stream: rank 1's
    _restore_rng(states, seed=0, ctx=_ctx(1), step=7)
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("saved_ranks", [None, 1, 4])
def test_other_world_sizes_reseed_per_rank_and_step(saved_ranks):
    states = None if saved_ranks is None else [_rng_state()] * saved_ranks
    draws = {}
    for rank, step in ((0, 7), (1, 7), (0, 8), (0, 7)):
        torch.manual_seed(999)
        _restore_rng(states, seed=0, ctx=_ctx(rank), step=step)
        draws.setdefault((rank, step), []).append(torch.rand(3))
    assert torch.equal(*draws[(0, 7)])  # deterministic
    assert not torch.equal(draws[(0, 7)][0], draws[(1, 7)][0])  # per rank
    assert not torch.equal(draws[(0, 7)][0], draws[(0, 8)][0])  # and per step: no replay of an old stream
