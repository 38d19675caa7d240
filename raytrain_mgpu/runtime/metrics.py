"""Per-device memory, throughput and data-wait accounting, and cross-worker reduction."""

from __future__ import annotations

import resource
import sys
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist


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
    """Counts samples, loss and correct predictions; times steps and data waits."""

    def __init__(self, device: torch.device):
        # Sums stay on the device: reading a CUDA scalar every step is a sync point. The
        # sample count is known on the host, so it stays a Python int: building a device
        # tensor from it every micro-batch would be a blocking host-to-device copy.
        self._device_sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss*n, correct
        self.samples = 0
        self.data_wait_s = 0.0
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        n = y.numel()
        correct = (logits.detach().argmax(dim=1) == y.to(logits.device)).sum()
        self._device_sums += torch.stack([loss.detach().double() * n, correct.double()])
        self.samples += n

    @property
    def sums(self) -> torch.Tensor:
        """``[loss*n, correct, n]`` as one float64 tensor on the device (one copy: read it once an epoch)."""
        n = torch.tensor([float(self.samples)], dtype=torch.float64, device=self._device_sums.device)
        return torch.cat([self._device_sums, n])

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_gather_list(values: List[int]) -> List[int]:
    """Concatenate every rank's list, in rank order (small metadata only)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    gathered: List[List[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, list(values))
    return [v for part in gathered for v in part]


def summarise_memory(peaks: List[int]) -> Dict[str, float]:
    if not peaks:
        return {}
    return {"peak_memory_max_bytes": max(peaks), "peak_memory_min_bytes": min(peaks),
            "peak_memory_imbalance": max(peaks) / max(1, min(peaks))}


class StageTotals:
    """One pipeline rank's sums for an epoch (host floats: the executor times its own steps)."""

    def __init__(self):
        self.steps, self.busy_s, self.schedule_s, self.step_s, self.data_wait_s, self.bytes_sent = 0, 0.0, 0.0, 0.0, 0.0, 0

    def add_step(self, stats, step_s: float) -> None:
        """``stats``: the executor's ``busy_s``, ``wall_s`` and ``bytes_sent`` of one step."""
        self.steps += 1
        self.busy_s += stats.busy_s
        self.schedule_s += stats.wall_s
        self.bytes_sent += stats.bytes_sent
        self.step_s += step_s

    def as_dict(self) -> dict:
        return {"steps": self.steps, "busy_s": self.busy_s, "schedule_s": self.schedule_s, "step_s": self.step_s,
                "data_wait_s": self.data_wait_s, "bytes_sent": self.bytes_sent}
