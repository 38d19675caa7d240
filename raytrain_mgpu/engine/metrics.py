"""Per-device memory, throughput and data-wait accounting, and cross-worker reduction."""

from __future__ import annotations

import resource
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raytrain_mgpu.engine.batches import first_tensor, target_count, to_device
from raytrain_mgpu.engine.objectives import Objective, Predictions


def peak_memory_bytes(devices: Sequence[torch.device]) -> List[int]:
    """Peak memory per device: the CUDA allocator's peak, or this process's peak RSS on CPU.

    The CPU figure is the process high-water mark (``getrusage``), which cannot be reset,
    so on CPU it is the peak since the worker started rather than since the last epoch.
    """
    peaks = []
    for device in devices:
        if device.type == "cuda":
            peaks.append(int(torch.cuda.max_memory_allocated(device)))
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peaks.append(int(rss if sys.platform == "darwin" else rss * 1024))
    return peaks


def reset_peak_memory(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)


class EpochMeter:
    """Sums the loss and every metric's ``(sum, count)``; counts samples; times steps and data waits.

    ``add`` gets the outputs themselves (the metrics run here, where they live) or, from
    strategies whose outputs stay on other devices, :class:`~raytrain_mgpu.engine.objectives.Predictions`
    holding the pairs already computed there.
    """

    def __init__(self, device: torch.device, objective: Optional[Objective] = None, finite_only: bool = False):
        self.objective = objective if objective is not None else Objective()
        # on_nonfinite="skip": a NaN or infinite micro-batch loss (its step is skipped) adds 0 to the loss sum
        self.finite_only = finite_only
        self.device = device
        self.extras: Dict[str, list] = {}  # a user's train_step's scalars: name -> [sum on the device, count]
        self.names = self.objective.names
        m = len(self.names)
        # One slot per value, in the order of ``totals``: [loss*n, sum_1..sum_m, samples, count_1..count_m].
        # Sums stay on the device: reading a CUDA scalar every step is a sync point. What is
        # known on the host (the sample count, a count a metric returns as an int) stays a
        # Python number: building a device tensor from it every micro-batch would be a
        # blocking host-to-device copy.
        self._device_sums = torch.zeros(2 + 2 * m, dtype=torch.float64, device=device)
        # One view per slot, made once: each micro-batch adds into it in place with one op (an index, a cast
        # and a multiply each time cost ~8 us a micro-batch on CPU, 3 ops of a ~0.4 ms step of a small model).
        self._slots = list(self._device_sums.unbind())
        self._host_sums = [0.0] * (2 + 2 * m)
        self.samples = 0
        self.data_wait_s = 0.0
        self.checkpoint_s = 0.0  # step checkpoints written inside the epoch (not training: training_s leaves it out)
        self.eval_s = 0.0  # evaluations every eval_every_n_steps inside the epoch (not training either)
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, outputs, y: torch.Tensor) -> None:
        """One micro-batch: its mean loss, its outputs (None: a user's step that returned none, no metrics)."""
        n = target_count(y)  # numel of a tensor target (tokens for an LM), the rows of a structured one
        if outputs is None:
            pairs = ()
        elif isinstance(outputs, Predictions):  # measured where the outputs live
            pairs = outputs.pairs
        else:
            where = first_tensor(outputs).device
            # targets already there (the usual case) are not moved: even a no-op .to() is a dispatched op a step
            pairs = self.objective.measure(outputs, y if isinstance(y, torch.Tensor) and y.device == where
                                           else to_device(y, where))
        loss = loss.detach()
        if self.finite_only:
            loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)
        self._slots[0].add_(loss, alpha=n)  # float64 += float32 * n, in place
        m = len(self.names)
        for i, (total, count) in enumerate(pairs):
            self._accumulate(1 + i, total)
            self._accumulate(2 + m + i, count)
        self.samples += n

    def add_extras(self, values: Dict[str, torch.Tensor], n: int) -> None:
        """A user step's extra scalars of one micro-batch (means over its ``n`` targets), summed on the device."""
        for name, value in values.items():
            entry = self.extras.get(name)
            if entry is None:
                entry = self.extras[name] = [torch.zeros((), dtype=torch.float64, device=self.device), 0]
            value = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(float(value))
            entry[0].add_(value.to(entry[0].device), alpha=n)
            entry[1] += n

    def extra_sums(self) -> torch.Tensor:
        """``[sum, count]`` of every extra scalar, by name: one float64 tensor (empty without any)."""
        if not self.extras:
            return torch.zeros(0, dtype=torch.float64, device=self._device_sums.device)
        return torch.stack([part for name in sorted(self.extras) for part in (
            self.extras[name][0], torch.tensor(float(self.extras[name][1]), dtype=torch.float64,
                                                device=self.extras[name][0].device))])

    def split_extras(self, values: Sequence[float]) -> Dict[str, Tuple[float, float]]:
        """``{name: (sum, count)}`` from :meth:`extra_sums`' values (summed over ranks)."""
        return {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(sorted(self.extras))}

    def watch_loss(self, num_steps: int) -> None:
        """``on_nonfinite="stop"``: room for the loss sum after each of the epoch's next ``num_steps`` steps
        (:meth:`record_step`; :meth:`loss_not_finite` counts the non-finite ones)."""
        self._after_step = torch.empty(num_steps, dtype=torch.float64, device=self._device_sums.device)
        self._recorded = 0

    def record_step(self) -> None:
        """After a step: the loss sum so far, kept on the device (one copy, no read). A finiteness test every step
        cost ~4 ops (~80 us CPU a step of a small MLP, 1.2x its plain torch step); one per epoch does here."""
        self._after_step.select(0, self._recorded).copy_(self._slots[0])
        self._recorded += 1

    def loss_not_finite(self) -> torch.Tensor:
        """How many recorded steps ended with the loss sum NaN or infinite (a 0-d tensor on the device: no read).
        The sum stays non-finite once it is, so they are the last ones: the first is the epoch's first such step."""
        return (~torch.isfinite(self._after_step[:self._recorded])).sum()

    def _accumulate(self, slot: int, value) -> None:
        if isinstance(value, torch.Tensor):  # in place on the device: no sync (and no detach op where none is needed)
            self._slots[slot].add_(value.detach() if value.requires_grad else value)
        else:
            self._host_sums[slot] += value

    @property
    def totals(self) -> torch.Tensor:
        """``[loss*n, sum_1..sum_m, samples, count_1..count_m]`` as one float64 tensor on the device.

        One host-to-device copy: read it once an epoch (``split`` names its values).
        """
        host = list(self._host_sums)
        host[1 + len(self.names)] += float(self.samples)
        return self._device_sums + torch.tensor(host, dtype=torch.float64, device=self._device_sums.device)

    @property
    def sums(self) -> torch.Tensor:
        """``[loss*n, sum_1..sum_m, samples]`` (accuracy alone: ``[loss*n, correct, n]``)."""
        return self.totals[: 2 + len(self.names)]

    def split(self, values: Sequence[float]) -> Tuple[float, float, Dict[str, Tuple[float, float]]]:
        """``(loss_sum, samples, {metric: (sum, count)})`` from ``totals`` (summed over ranks, as floats)."""
        m = len(self.names)
        return values[0], values[1 + m], {name: (values[1 + i], values[2 + m + i]) for i, name in enumerate(self.names)}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def partial(self) -> dict:
        """What this epoch has summed so far (a step checkpoint keeps it; ``resume`` adds it back)."""
        return {"totals": self.totals.detach().cpu(), "data_wait_s": self.data_wait_s, "elapsed_s": self.elapsed(),
                "checkpoint_s": self.checkpoint_s, "eval_s": self.eval_s,
                "extras": {name: [float(total), count] for name, (total, count) in self.extras.items()}}

    def resume(self, partials: Sequence[dict]) -> None:
        """Start from the sums of ``partials`` (one rank's, or several ranks' when the world size changed)."""
        for part in partials:
            self._device_sums += part["totals"].to(self._device_sums.device)
            self.data_wait_s += part["data_wait_s"]
            self.checkpoint_s += part.get("checkpoint_s", 0.0)  # absent from checkpoints before it was kept
            self.eval_s += part.get("eval_s", 0.0)
            self.start -= part["elapsed_s"]
            for name, (total, count) in (part.get("extras") or {}).items():
                self.add_extras({name: torch.tensor(total / max(count, 1))}, count)


def barrier_s() -> float:
    """Seconds this rank waited for every rank to arrive (0 outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0.0
    start = time.perf_counter()
    dist.barrier()
    return time.perf_counter() - start


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_gather_objects(own) -> list:
    """Every rank's ``own``, in rank order (collective: every rank calls it; small objects only)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [own]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return gathered
