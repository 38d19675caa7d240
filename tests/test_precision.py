"""fp16 with an enabled GradScaler, on CPU (``torch.amp.GradScaler("cpu")``), no Ray.

On GPUs ``16-mixed`` scales the loss, skips steps whose gradients overflowed, unscales
before clipping and carries the scaler's state across a resume. The loop's scaler uses
the compute device's type, so under GPU emulation (and here) the same code runs on CPU.
These tests drive ``loop._Loop.end_step`` (runtime/engine.OptimizerStep) and the loop's save/restore path.
"""

from __future__ import annotations

import math
import shutil

import pytest
import ray.train
import torch
from torch import nn

from raytrain_mgpu.runtime import loop as loop_module
from raytrain_mgpu.runtime.checkpoint import load_train_state
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime import worker_checkpoint
from raytrain_mgpu.runtime.loop import _Loop, _State
from raytrain_mgpu.runtime.worker_checkpoint import save_and_report as _save_and_report
from raytrain_mgpu.runtime.worker_restore import load_train_state as _load_train_state
from raytrain_mgpu.runtime.worker_restore import restore as _restore
from raytrain_mgpu.optim import build_optimizer, build_scheduler
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

CTX = WorkerContext(0, 1, 0, 1, 0, (torch.device("cpu"),))


@pytest.fixture(autouse=True)
def _outside_ray(monkeypatch):
    """The per-epoch device record asks Ray for GPU ids and the node; these tests run without Ray."""
    monkeypatch.setattr(loop_module, "_device_record", lambda ctx: {})


def _config(**overrides) -> TrainConfig:
    values = dict(model="mlp", dataset="synthetic", strategy="ddp", num_workers=1, use_gpu=True,
                  precision="16-mixed", batch_size=8, optimizer="sgd", momentum=0.0, lr=1.0, epochs=1)
    return TrainConfig(**{**values, **overrides})


def _loop(cfg: TrainConfig, model: nn.Module = None) -> _Loop:
    strategy = build_worker(get_strategy(cfg.strategy), cfg.parallel, CTX)
    torch.manual_seed(0)
    model = strategy.setup_model(model or nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)))
    loader = [(torch.randn(8, 1, 4, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 2, 1)
    scaler = torch.amp.GradScaler(strategy.device.type, enabled=cfg.precision == "16-mixed")
    scaler.scale(torch.ones(()))  # the scaler's state is created by its first scale(loss)
    return _Loop(cfg, strategy, model, optimizer, scheduler, scaler, loader, WorkerReporter(None), 2)


def test_16_mixed_is_allowed_with_use_gpu_and_refused_without():
    assert _config().precision == "16-mixed"
    with pytest.raises(ValueError, match=r"precision='16-mixed' needs CUDA .* use_gpu=False.*bf16-mixed"):
        _config(use_gpu=False)


def test_fp16_epoch_trains_on_cpu_with_an_enabled_scaler():
    loop = _loop(_config())
    assert loop.scaler.is_enabled() and loop.scaler.get_scale() == 2.0**16
    metrics = loop.train_epoch(0, _State())
    assert metrics["step"] == 2 and math.isfinite(metrics["train_loss"])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # a skipped step, by design
def test_a_step_with_an_inf_gradient_is_skipped_and_the_scale_halves():
    loop = _loop(_config())
    before = [p.detach().clone() for p in loop.model.parameters()]
    for p in loop.model.parameters():
        p.grad = torch.ones_like(p)
    next(loop.model.parameters()).grad[0, 0] = math.inf
    loop.end_step(1)
    assert all(torch.equal(a, p) for a, p in zip(before, loop.model.parameters()))
    assert loop.scaler.get_scale() == 2.0**15
    # a finite step afterwards does move the weights, at the lowered scale
    for p in loop.model.parameters():
        p.grad = torch.full_like(p, 2.0**15 * 0.01)
    loop.end_step(1)
    assert all(torch.allclose(p, a - 0.01) for a, p in zip(before, loop.model.parameters()))


def test_gradients_are_unscaled_before_clipping():
    loop = _loop(_config(grad_clip_norm=0.5))
    scale = loop.scaler.get_scale()
    params = list(loop.model.parameters())
    before = [p.detach().clone() for p in params]
    torch.manual_seed(1)
    true_grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, true_grads):
        p.grad = g * scale  # what backward of the scaled loss leaves
    loop.end_step(1)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in true_grads]))
    coef = min(1.0, 0.5 / (norm.item() + 1e-6))
    assert norm > 0.5  # clipping bites; on the scaled gradients it would shrink them 65536 times more
    for a, p, g in zip(before, params, true_grads):
        torch.testing.assert_close(p.detach(), a - 1.0 * coef * g)  # SGD, lr 1


def checkpoint_roundtrip(monkeypatch, tmp_path, loop: _Loop, cfg: TrainConfig, state: _State, after_save=None):
    """Save through ``worker_checkpoint.save_and_report`` and read it back through ``worker_restore.restore`` (no Ray Train)."""
    saved = tmp_path / "checkpoint"

    def report(metrics, checkpoint=None, **upload):
        shutil.copytree(checkpoint.path, saved)

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(worker_checkpoint, "wait_until_report_collected", lambda: None)
    _save_and_report(cfg, loop.strategy, loop.model, loop.optimizer, loop.scheduler, loop.scaler, state,
                     {"epoch": state.epoch}, loop.strategy.ctx, {"input_shape": [1, 4, 4], "num_classes": 3})
    if after_save is not None:
        after_save()
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint.from_directory(str(saved)))
    return saved, _restore(cfg, loop.strategy, loop.strategy.unwrap(loop.model))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # a skipped step, by design
def test_scaler_state_survives_a_checkpoint_round_trip(monkeypatch, tmp_path):
    cfg = _config()
    loop = _loop(cfg)
    for p in loop.model.parameters():  # one overflow, then two good steps: scale 2**15, tracker 2
        p.grad = torch.full_like(p, math.inf)
    loop.end_step(1)
    for _ in range(2):
        for p in loop.model.parameters():
            p.grad = torch.zeros_like(p)
        loop.end_step(1)
    want = loop.scaler.state_dict()
    assert want["scale"] == 2.0**15 and want["_growth_tracker"] == 2
    saved, (state, train_state) = checkpoint_roundtrip(monkeypatch, tmp_path, loop, cfg, _State(epoch=1, step=3))
    assert state.step == 3 and state.attempt == 1
    fresh = _loop(cfg)
    assert fresh.scaler.get_scale() == 2.0**16
    _load_train_state(fresh.strategy, fresh.model, fresh.optimizer, fresh.scheduler, fresh.scaler, train_state)
    assert fresh.scaler.state_dict() == want
    # everything in train_state loads without unpickling code
    assert torch.load(saved / "train_state.pt", weights_only=True)["scaler"] == want
    assert load_train_state(str(saved))["scaler"] == want
