"""Per-step code never syncs host and device (no ``.item()``, ``.cpu()`` or tensors built from Python numbers on
the device a step: accumulate on the device, read every N steps).

A ``TorchFunctionMode`` sees every torch call made while it is active, torch's own
internals included. It records the calls that block the host on a CUDA device: reading
a tensor back (``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``float()``,
``int()``, ``bool()``) and building a tensor from Python data on an explicit device
(``torch.tensor(..., device=...)``, a blocking host-to-device copy). On CPU none of this
costs anything, but the calls are the same ones that stall a GPU, so the test holds on
this machine. The mode is active over the micro-steps and optimizer steps of the engine's
``train_epoch`` (one rank's, driven directly in this process: tests/_engine.py) and disarmed for the
once-per-epoch read.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from _engine import RecordingSink, make_engine
from raytrain_mgpu.engine.metrics import EpochMeter


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
    """An earlier meter's pattern: the count copied to the device every micro-batch."""
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


def small_mlp(input_shape, num_classes):
    """The loop's model under test: dropout draws from the rank's stream every step."""
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, num_classes))


def _engine(grad_accum_steps: int, grad_clip_norm=None, log_every_n_steps: int = 50, sink=None):
    """Rank 0's engine when ``sink`` is given (it holds the progress channel), another rank's without: 4 steps an
    epoch of 8-sample micro-batches."""
    return make_engine(dict(model=small_mlp, dataset="synthetic", input_shape=[1, 4, 4], num_classes=3,
                            num_samples=32 * grad_accum_steps, strategy="ddp", batch_size=8 * grad_accum_steps,
                            grad_accum_steps=grad_accum_steps, optimizer="sgd", momentum=0.9,
                            grad_clip_norm=grad_clip_norm, epochs=1, log_every_n_steps=log_every_n_steps), sink=sink)


def _disarmed(detector: HostSyncDetector, function):
    """``function`` with the detector off while it runs (host-side work: loading a batch, the per-epoch read)."""
    def call(*args, **kwargs):
        armed, detector.armed = detector.armed, False
        try:
            return function(*args, **kwargs)
        finally:
            detector.armed = armed

    return call


def _train_epoch_watched(engine) -> tuple:
    detector, metrics = watched_epoch(engine, 0, engine.train_epoch)
    assert metrics["step"] == 4
    return detector, metrics


def watched_epoch(engine, epoch: int, train_epoch) -> tuple:
    """``train_epoch(epoch)`` (the engine's) under the detector: ``(detector, row)``; the data loader's own host work
    (the sampler's order, collating CPU tensors in this process) and the per-epoch read are not the steps' and are
    left out."""
    detector = HostSyncDetector()
    read_epoch = engine._epoch_row

    def once_per_epoch(*args, **kwargs):
        detector.armed = False  # the per-epoch read is where syncing belongs
        return read_epoch(*args, **kwargs)

    engine._epoch_row = once_per_epoch
    feed = engine.feed
    epoch_batches, batches = feed.epoch, feed.batches
    feed.epoch = _disarmed(detector, epoch_batches)
    feed.batches = lambda *args: _disarmed(detector, batches(*args))
    try:
        with detector:
            metrics = train_epoch(epoch)
    finally:
        del engine._epoch_row
        feed.epoch, feed.batches = epoch_batches, batches
    return detector, metrics


def test_train_epoch_micro_and_optimizer_steps_make_no_sync():
    detector, metrics = _train_epoch_watched(_engine(grad_accum_steps=2, grad_clip_norm=1.0))
    assert detector.found == []
    assert metrics["train_loss"] > 0 and metrics["samples_per_s"] > 0


def test_train_epoch_check_fails_on_a_sync_in_the_step(monkeypatch):
    """The same harness catches a meter that copies its count to the device each micro-batch."""
    monkeypatch.setattr(EpochMeter, "add", _old_meter_add)
    detector, _ = _train_epoch_watched(_engine(grad_accum_steps=2))
    assert detector.found == ["tensor"] * 8


def test_step_scalars_read_the_device_once_per_n_steps_on_rank_0():
    """log_every_n_steps=2 over 4 steps: two reads (one ``tolist`` per window), loss and grad norm included."""
    sink = RecordingSink()
    detector, _ = _train_epoch_watched(_engine(grad_accum_steps=2, grad_clip_norm=1.0, log_every_n_steps=2, sink=sink))
    assert detector.found == ["tolist"] * 2
    scalars = sink.of("scalars")
    assert [step for step, _ in scalars] == [2, 4]
    assert all({"train/loss", "train/grad_norm", "train/lr"} <= set(values) for _, values in scalars)


def test_step_scalars_add_nothing_on_other_ranks():
    """A rank without the progress channel (every rank but 0) keeps no window and reads nothing, even at N=1."""
    engine = _engine(grad_accum_steps=2, grad_clip_norm=1.0, log_every_n_steps=1)
    assert engine.window is None
    detector, _ = _train_epoch_watched(engine)
    assert detector.found == []


def _watch_the_second_epoch(rank: int) -> None:
    """In a pipeline stage's process: its second epoch's steps under the detector, what it found to a file."""
    import os
    from pathlib import Path

    from raytrain_mgpu.engine.loop import Engine

    original = Engine.train_epoch

    def watched(self, epoch):
        if epoch == 0:  # the first step sends each message's shape once (a header's read): steady state is after
            return original(self, epoch)
        detector, row = watched_epoch(self, epoch, lambda e: original(self, e))
        Path(os.environ["SYNC_LOG"], f"rank{rank}").write_text(",".join(detector.found) or "none")
        return row

    Engine.train_epoch = watched


def test_a_pipeline_stages_steps_make_no_sync_in_steady_state(tmp_path, monkeypatch):
    """The same count on both stages of a 2-stage pipeline (the engine in local processes): activations, gradients,
    targets and the optimizer step read nothing back from the device, clipping's norm included. (SGD: torch's
    single-tensor AdamW on CPU reads its step count, a CPU tensor wherever the parameters are.)"""
    import raytrain_mgpu as rtm
    from _pipeline_local import LocalRun, run_local

    monkeypatch.setenv("SYNC_LOG", str(tmp_path))
    cfg = rtm.TrainConfig(model="mlp", dataset="synthetic", input_shape=[12], num_classes=5, num_samples=96,
                          model_kwargs={"widths": [24, 24]}, batch_size=24, num_microbatches=2, strategy="pipeline",
                          num_stages=2, cpus_per_worker=1, epochs=2, grad_clip_norm=1.0, optimizer="sgd",
                          use_gpu=False, num_workers=1)
    run_local([LocalRun(cfg, 8, prepare=_watch_the_second_epoch)])
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["none", "none"]
