"""Per-step code never syncs host and device (house style 15).

A ``TorchFunctionMode`` sees every torch call made while it is active, torch's own
internals included. It records the calls that block the host on a CUDA device: reading
a tensor back (``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``float()``,
``int()``, ``bool()``) and building a tensor from Python data on an explicit device
(``torch.tensor(..., device=...)``, a blocking host-to-device copy). On CPU none of this
costs anything, but the calls are the same ones that stall a GPU, so the test holds on
this machine. The mode is active over the micro-steps and optimizer steps of
``_Loop.train_epoch`` (driven directly, no Ray) and disarmed for the once-per-epoch read.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from raytrain_mgpu.runtime import loop as loop_module
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime.loop import _Loop, _State
from raytrain_mgpu.runtime.metrics import EpochMeter
from raytrain_mgpu.optim import build_optimizer, build_scheduler
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

@pytest.fixture(autouse=True)
def _outside_ray(monkeypatch):
    """The per-epoch device record asks Ray for GPU ids and the node; these tests run without Ray."""
    monkeypatch.setattr(loop_module, "_device_record", lambda ctx: {})


_READS = {"item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"}
_FROM_PYTHON = {"tensor", "as_tensor", "scalar_tensor"}


class HostSyncDetector(TorchFunctionMode):
    """Records host-device syncs while ``armed``."""

    def __init__(self):
        super().__init__()
        self.armed = True
        self.found: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.armed and (name in _READS or (name in _FROM_PYTHON and kwargs.get("device") is not None)):
            self.found.append(name)
        return func(*args, **kwargs)


def _old_meter_add(meter: EpochMeter, loss, logits, y) -> None:
    """The pattern issue 10 found: the count copied to the device every micro-batch."""
    n = y.numel()
    torch.tensor(float(n), dtype=torch.float64, device=meter._device_sums.device)


def _batch(n: int = 8):
    return torch.randn(n, 1, 4, 4), torch.randint(0, 3, (n,))


def test_detector_flags_the_old_meter_pattern_and_reads():
    detector = HostSyncDetector()
    meter = EpochMeter(torch.device("cpu"))
    x, y = _batch()
    with detector:
        _old_meter_add(meter, torch.ones(()), torch.randn(8, 3), y)
        torch.ones(()).item()
        float(torch.ones(()))
        bool(torch.ones(()) > 0)
        torch.ones(2).cpu()
    assert detector.found == ["tensor", "item", "__float__", "__bool__", "cpu"]


def test_epoch_meter_add_makes_no_sync():
    meter = EpochMeter(torch.device("cpu"))
    detector = HostSyncDetector()
    with detector:
        for _ in range(3):
            x, y = _batch()
            meter.add(torch.tensor(0.5), torch.randn(8, 3), y)
    assert detector.found == []
    loss_sum, correct, samples = meter.sums.tolist()  # one read per epoch
    assert samples == 24 and abs(loss_sum - 12.0) < 1e-9 and 0 <= correct <= 24


class RecordingSink:
    """Stands in for the ``ProgressSink`` actor: ``put.remote(kind, payload)`` is recorded."""

    def __init__(self):
        self.events: list = []
        self.put = self  # sink.put.remote(...)

    def remote(self, kind, payload):
        self.events.append((kind, payload))


def _loop(grad_accum_steps: int, grad_clip_norm=None, log_every_n_steps: int = 50, sink=None) -> _Loop:
    """Rank 0's loop when ``sink`` is given (it holds the progress sink), another rank's without."""
    cfg = TrainConfig(model="mlp", dataset="synthetic", strategy="ddp", num_workers=1, batch_size=8 * grad_accum_steps,
                      grad_accum_steps=grad_accum_steps, optimizer="sgd", momentum=0.9,
                      grad_clip_norm=grad_clip_norm, epochs=1, log_every_n_steps=log_every_n_steps)
    ctx = WorkerContext(0, 1, 0, 1, 0, (torch.device("cpu"),))
    strategy = build_worker(get_strategy("ddp"), cfg.parallel, ctx)
    torch.manual_seed(0)
    model = strategy.setup_model(nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.1),
                                               nn.Linear(8, 3)))
    loader = [_batch() for _ in range(4 * grad_accum_steps)]  # pre-collated: the DataLoader is not under test
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 4, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return _Loop(cfg, strategy, model, optimizer, scheduler, scaler, loader, WorkerReporter(sink), 4)


def _train_epoch_watched(loop: _Loop) -> HostSyncDetector:
    detector = HostSyncDetector()
    read_epoch = loop._epoch_metrics

    def once_per_epoch(*args, **kwargs):
        detector.armed = False  # the per-epoch read is where syncing belongs
        return read_epoch(*args, **kwargs)

    loop._epoch_metrics = once_per_epoch
    with detector:
        metrics = loop.train_epoch(0, _State())
    assert metrics["step"] == 4
    return detector, metrics


def test_train_epoch_micro_and_optimizer_steps_make_no_sync():
    detector, metrics = _train_epoch_watched(_loop(grad_accum_steps=2, grad_clip_norm=1.0))
    assert detector.found == []
    assert metrics["train_loss"] > 0 and metrics["samples_per_s"] > 0


def test_train_epoch_check_fails_on_a_sync_in_the_step(monkeypatch):
    """The same harness catches a meter that copies its count to the device each micro-batch."""
    monkeypatch.setattr(EpochMeter, "add", _old_meter_add)
    detector, _ = _train_epoch_watched(_loop(grad_accum_steps=2))
    assert detector.found == ["tensor"] * 8


def test_step_scalars_read_the_device_once_per_n_steps_on_rank_0():
    """log_every_n_steps=2 over 4 steps: two reads (one ``tolist`` per window), loss and grad norm included."""
    sink = RecordingSink()
    detector, _ = _train_epoch_watched(_loop(grad_accum_steps=2, grad_clip_norm=1.0, log_every_n_steps=2, sink=sink))
    assert detector.found == ["tolist"] * 2
    scalars = [payload for kind, payload in sink.events if kind == "scalars"]
    assert [step for step, _ in scalars] == [2, 4]
    assert all({"train/loss", "train/grad_norm", "train/lr"} <= set(values) for _, values in scalars)


def test_step_scalars_add_nothing_on_other_ranks():
    """A rank without the sink (every rank but 0) keeps no window and reads nothing, even at N=1."""
    loop = _loop(grad_accum_steps=2, grad_clip_norm=1.0, log_every_n_steps=1)
    assert loop.window is None
    detector, _ = _train_epoch_watched(loop)
    assert detector.found == []
