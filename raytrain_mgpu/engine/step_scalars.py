"""Per-step scalars every ``log_every_n_steps`` optimizer steps, without a host sync per step.

One :class:`StepWindow` per reporting process (rank 0 of a Ray Train run; the first and the
last stage of replica 0 in a pipeline) collects the steps since its last read: the
micro-batch losses and the gradient norms in place on the device (reading a CUDA scalar is a
sync point: it is read once per window, one ``tolist()``), the sample count, data-wait
and step time as host numbers. ``read`` returns the ``train/*`` scalars and starts a new window.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

import torch


class StepWindow:
    """The steps since the last read, of one process.

    ``replicas``: data-parallel replicas; ``train/samples_per_s`` is this process's
    samples x ``replicas`` over this process's wall time of the window (every replica
    takes the same number of samples per step). ``sees_loss``: the process computes the
    loss (it reports loss, lr, grad norm, samples/s); ``reads_data``: it loads the batches
    (it reports the data-wait share). The Ray Train loop's rank 0 does both.
    """

    def __init__(self, device: torch.device, replicas: int = 1, sees_loss: bool = True, reads_data: bool = True):
        self.replicas, self.sees_loss, self.reads_data = replicas, sees_loss, reads_data
        # Two 0-d sums on the device: an in-place add per micro-batch or step queues a kernel and
        # never waits for it; zeros() is filled on the device (no host-to-device copy).
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._norm_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._last: Optional[float] = None
        self._clear()

    def _clear(self) -> None:
        self.losses, self.steps, self.norms, self.samples = 0, 0, 0, 0
        self.data_wait_s = self.elapsed_s = 0.0
        self.lr: Optional[float] = None

    def resume(self) -> None:
        """At an epoch's start: the time since the last step (evaluation, checkpoints) is no step's."""
        self._last = time.perf_counter()

    def add_loss(self, loss: torch.Tensor, samples: int) -> None:
        """One micro-batch's mean loss and its sample (target) count."""
        self._loss_sum.add_(loss.detach())
        self.losses += 1
        self.samples += samples

    def add_data_wait(self, seconds: float) -> None:
        self.data_wait_s += seconds

    def end_step(self, lr: float, grad_norm: Optional[torch.Tensor] = None) -> None:
        """After an optimizer step: ``lr`` the step used, ``grad_norm`` where gradients were clipped."""
        now = time.perf_counter()
        self.elapsed_s += now - (self._last if self._last is not None else now)
        self._last = now
        self.steps += 1
        self.lr = lr
        if grad_norm is not None:
            self._norm_sum.add_(grad_norm.detach().to(self._norm_sum.device))
            self.norms += 1

    def read(self) -> Dict[str, float]:
        """The window's scalars (one device read) and a new window."""
        values: Dict[str, float] = {}
        elapsed = max(self.elapsed_s, 1e-9)
        if self.sees_loss:
            loss_sum, norm_sum = torch.stack([self._loss_sum, self._norm_sum]).tolist()  # the window's one sync
            values["train/loss"] = loss_sum / max(self.losses, 1)
            values["train/lr"] = self.lr
            if self.norms:
                values["train/grad_norm"] = norm_sum / self.norms
            values["train/samples_per_s"] = self.samples * self.replicas / elapsed
            self._loss_sum.zero_()
            self._norm_sum.zero_()
        if self.reads_data:
            values["train/data_wait_share"] = self.data_wait_s / elapsed
        self._clear()
        return values


def stage_scalars(stats: list, num_stages: int) -> Dict[str, float]:
    """``stage{k}/step_time_s``, ``stage{k}/bubble`` (idle share of the schedule) and
    ``stage{k}/peak_memory_bytes`` from the stage processes' ``finish_epoch()`` sums (mean
    over replicas; memory: the largest replica's)."""
    values: Dict[str, float] = {}
    for k in range(num_stages):
        ranks = [s for s in stats if s["prank"] == k]
        values[f"stage{k}/step_time_s"] = sum(s["step_s"] / max(s["steps"], 1) for s in ranks) / len(ranks)
        values[f"stage{k}/bubble"] = sum(1 - s["busy_s"] / max(s["schedule_s"], 1e-9) for s in ranks) / len(ranks)
        values[f"stage{k}/peak_memory_bytes"] = max(s["peak_memory_bytes"] for s in ranks)
    return values


class WindowedMeter:
    """An :class:`~raytrain_mgpu.engine.metrics.EpochMeter` with a :class:`StepWindow` beside it:
    every micro-batch's loss goes to both (the pipeline's last stage hands it to its executor)."""

    def __init__(self, meter, window: StepWindow):
        self.meter, self.window = meter, window

    def add(self, loss: torch.Tensor, outputs, y) -> None:
        counted = self.meter.samples
        self.meter.add(loss, outputs, y)
        self.window.add_loss(loss, self.meter.samples - counted)  # the samples (targets) the meter counted
