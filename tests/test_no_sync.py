"""Gradient accumulation skips DDP's all-reduce on non-final micro-steps, compiled or not.

Two local processes (gloo, forked from tests/_forkserver.py, no Ray) run one epoch of the engine
(tests/_engine.py) with ``grad_accum_steps=2`` over 2 steps. A DDP communication hook counts the bucket
all-reduces: with ``no_sync`` they happen once per optimizer step, without it once per
micro-step. ``torch.compile``'s wrapper (``backend="eager"``: the wrapper type is what
matters, not the kernels) must not change that.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import _forkserver
from _engine import make_engine

STEPS, ACCUM = 2, 2


def small_mlp(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, num_classes))


def _count_allreduces(rank: int, world: int, compiled: bool, no_sync_mode: str) -> int:
    """Bucket all-reduces during one epoch of STEPS steps x ACCUM micro-steps."""
    engine = make_engine(dict(model=small_mlp, dataset="synthetic", input_shape=[1, 4, 4], num_classes=3,
                              num_samples=8 * ACCUM * world * STEPS, strategy="ddp", batch_size=8 * ACCUM * world,
                              grad_accum_steps=ACCUM, optimizer="sgd", epochs=1), rank=rank, world=world)
    steps = engine.steps
    model = steps.model
    steps.replication = copy.copy(steps.replication)  # this engine's own: its no_sync is replaced below
    assert isinstance(model, DistributedDataParallel)
    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    if compiled:
        steps.model = torch.compile(model, backend="eager")
    if no_sync_mode == "off":  # what the loop would do with no no_sync at all
        steps.replication.no_sync = lambda m: contextlib.nullcontext()
    elif no_sync_mode == "wrapper_check":  # an earlier check: the compiled wrapper is no DDP
        steps.replication.no_sync = lambda m: (m.no_sync() if isinstance(m, DistributedDataParallel)
                                               else contextlib.nullcontext())
    engine.train_epoch(0)
    return calls[0]


def _worker(rank: int, world: int, out_dir: str) -> None:
    counts = {f"{'compiled' if compiled else 'eager'}-{mode}": _count_allreduces(rank, world, compiled, mode)
              for compiled in (False, True) for mode in ("strategy", "off", "wrapper_check")}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


@pytest.fixture(scope="module")
def allreduce_counts(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("no_sync")
    _forkserver.start_gloo_ranks(_worker, (str(out_dir),))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_no_sync_all_reduces_once_per_step(allreduce_counts):
    for counts in allreduce_counts:
        assert counts["eager-strategy"] == STEPS  # one bucket (a small model), once per step


def test_without_no_sync_every_micro_step_all_reduces(allreduce_counts):
    """The counter can tell: the same epoch without no_sync all-reduces on every micro-step."""
    for counts in allreduce_counts:
        assert counts["eager-off"] == STEPS * ACCUM
        assert counts["eager-wrapper_check"] == STEPS


def test_compiled_model_keeps_no_sync(allreduce_counts):
    for counts in allreduce_counts:
        assert counts["compiled-strategy"] == STEPS
        # the old check, on the compiled wrapper, silently synced every micro-step
        assert counts["compiled-wrapper_check"] == STEPS * ACCUM
        assert counts["compiled-off"] == STEPS * ACCUM
