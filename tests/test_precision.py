"""fp16 with an enabled GradScaler, on CPU (``torch.amp.GradScaler("cpu")``), no Ray.

On GPUs ``16-mixed`` scales the loss, skips steps whose gradients overflowed, unscales
before clipping and carries the scaler's state across a resume. The loop's scaler uses
the compute device's type, so under GPU emulation (and here) the same code runs on CPU.
These tests drive one rank's engine in this process (tests/_engine.py, under GPU emulation: ``use_gpu=True``
computes on CPU): its ``end_step`` (engine/loop.OptimizerStep) and its save/restore path.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from _engine import make_engine
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing.files import load_train_state
from raytrain_mgpu.engine.devices import EMULATE_ENV
from raytrain_mgpu.engine.run_state import RunState


@pytest.fixture(autouse=True)
def _emulated_gpu(monkeypatch):
    """``use_gpu=True`` on this CPU machine: the emulation computes on CPU (fp16's scaler on "cpu")."""
    monkeypatch.setenv(EMULATE_ENV, "1")


def small_mlp(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, num_classes))


FIELDS = dict(model=small_mlp, dataset="synthetic", input_shape=[1, 4, 4], num_classes=3, num_samples=16,
              strategy="ddp", use_gpu=True, precision="16-mixed", batch_size=8, optimizer="sgd", momentum=0.0, lr=1.0,
              epochs=1)


def _config(**overrides) -> TrainConfig:
    return TrainConfig(**{**FIELDS, "num_workers": 1, **overrides})


def _engine(storage=None, **overrides):
    engine = make_engine({**FIELDS, **overrides}, storage=storage)
    engine.scaler.scale(torch.ones(()))  # the scaler's state is created by its first scale(loss)
    return engine


def test_16_mixed_is_allowed_with_use_gpu_and_refused_without():
    assert _config().precision == "16-mixed"
    with pytest.raises(ValueError, match=r"precision='16-mixed' needs CUDA .* use_gpu=False.*bf16-mixed"):
        _config(use_gpu=False)


def test_fp16_epoch_trains_on_cpu_with_an_enabled_scaler():
    loop = _engine()
    assert loop.scaler.is_enabled() and loop.scaler.get_scale() == 2.0**16
    metrics = loop.train_epoch(0)
    assert metrics["step"] == 2 and math.isfinite(metrics["train_loss"])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # a skipped step, by design
def test_a_step_with_an_inf_gradient_is_skipped_and_the_scale_halves():
    loop = _engine()
    before = [p.detach().clone() for p in loop.steps.model.parameters()]
    for p in loop.steps.model.parameters():
        p.grad = torch.ones_like(p)
    next(loop.steps.model.parameters()).grad[0, 0] = math.inf
    loop.end_step(1)
    assert all(torch.equal(a, p) for a, p in zip(before, loop.steps.model.parameters()))
    assert loop.scaler.get_scale() == 2.0**15
    # a finite step afterwards does move the weights, at the lowered scale
    for p in loop.steps.model.parameters():
        p.grad = torch.full_like(p, 2.0**15 * 0.01)
    loop.end_step(1)
    assert all(torch.allclose(p, a - 0.01) for a, p in zip(before, loop.steps.model.parameters()))


def test_gradients_are_unscaled_before_clipping():
    loop = _engine(grad_clip_norm=0.5)
    scale = loop.scaler.get_scale()
    params = list(loop.steps.model.parameters())
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


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")  # a skipped step, by design
def test_scaler_state_survives_a_checkpoint_round_trip(tmp_path):
    storage = str(tmp_path / "runs")
    loop = _engine(storage)
    for p in loop.steps.model.parameters():  # one overflow, then two good steps: scale 2**15, tracker 2
        p.grad = torch.full_like(p, math.inf)
    loop.end_step(1)
    for _ in range(2):
        for p in loop.steps.model.parameters():
            p.grad = torch.zeros_like(p)
        loop.end_step(1)
    want = loop.scaler.state_dict()
    assert want["scale"] == 2.0**15 and want["_growth_tracker"] == 2
    loop.state = loop.checkpoints.saver.state = RunState(epoch=1, step=3)
    loop.checkpoints.saver.save({"epoch": 1})  # the engine's save, through its transport into the run folder
    fresh = _engine(storage)  # set up from the run folder's newest checkpoint, as a resumed run
    assert fresh.state.step == 3 and fresh.state.attempt == 1
    assert fresh.scaler.state_dict() == want
    saved = fresh.state.checkpoint
    # everything in train_state loads without unpickling code
    assert torch.load(f"{saved}/train_state.pt", weights_only=True)["scaler"] == want
    assert load_train_state(saved)["scaler"] == want
