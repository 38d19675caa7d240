"""The building blocks of the strategies' memory models (``Strategy.device_memory``).

Each strategy's estimate is a list of :class:`DeviceMemory` lines, one per device it uses,
assembled from the pieces here: a replica split into parts (``replica_on``), DataParallel
over one node's devices (``data_parallel_node``), fsdp's sharded state (``fsdp_state_bytes``)
and the split of the model's blocks into parts (``split_parts``).

They live under ``strategies/`` rather than in :mod:`raytrain_mgpu.planning.memory` so that a
strategy's memory model imports nothing from the planning layer above it; planning measures
the :class:`~raytrain_mgpu.planning.memory.ModelProfile` (``profile`` below) and asks the
strategy class for the estimate. Pure arithmetic: no torch, no Ray.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Sequence

__all__ = ["DeviceMemory", "split_parts", "whole_model", "replica_on", "data_parallel_node", "fsdp_state_bytes",
           "tensor_parallel_memory"]


class DeviceMemory(NamedTuple):
    """One device's estimate as a line in the global batch ``b``: ``fixed + per_sample * b``."""

    fixed: float
    per_sample: float

    def at(self, batch: int) -> int:
        return int(math.ceil(self.fixed + self.per_sample * batch))


def split_parts(profile, num_parts: int, balance) -> List[range]:
    """Block ranges of each part, as the strategies split (``balance="time"`` estimated by parameters)."""
    from raytrain_mgpu.models.partition import balanced_split  # late: loads torch; the rules here need none

    n = len(profile.block_param_bytes)
    if not profile.splittable and num_parts > 1:
        raise ValueError("the model cannot be split into blocks (not an nn.Sequential, no blocks())")
    if num_parts > n:
        raise ValueError(f"{num_parts} parts need at least {num_parts} blocks; the model has {n}")
    counts = list(balance) if isinstance(balance, (tuple, list)) else balanced_split(profile.block_param_bytes, num_parts)
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def whole_model(profile) -> List[range]:
    """The whole model as one part (a replica on one device)."""
    return [range(len(profile.block_param_bytes))]


def replica_on(profile, parts: List[range], share: float, inflight: Sequence[float],
               loaded: float) -> List[DeviceMemory]:
    """A replica split into ``parts`` (one per device) seeing ``share`` of the global batch.

    ``inflight[j]``: how many of its own batch shares device j keeps activations for (1 for
    a plain forward, more for pipeline micro-batches); ``loaded``: the share of the global
    batch the first device loads as input.
    """
    last = len(parts) - 1
    devices = []
    for j, blocks in enumerate(parts):
        per = profile.activations(blocks) * share * inflight[j]
        per += profile.input_bytes * loaded if j == 0 else 0.0
        per += profile.output_bytes * share * inflight[j] if j == last else 0.0
        devices.append(DeviceMemory(profile.state_bytes(blocks), per))
    return devices


def data_parallel_node(profile, num_devices: int, share: float, balanced: bool,
                       output_device: int) -> List[DeviceMemory]:
    """``nn.DataParallel`` (``balanced=False``) or ``dp_balanced`` over ``num_devices`` devices.

    Device 0 holds the module, its gradients and the optimizer state; the others hold a
    replica of the weights each step. The whole batch arrives on the output device before
    the scatter; plain DP also gathers every device's outputs there and computes the loss
    on them (seed 001's full GPU 0).
    """
    devices = []
    for d in range(num_devices):
        state = profile.state_bytes() if d == 0 else profile.param_bytes
        per = profile.activations() * share / num_devices
        per += profile.input_bytes * share * (1.0 if d == output_device else 1.0 / num_devices)
        gathered = not balanced and d == output_device
        per += profile.output_bytes * share * (1.0 if gathered else (0.0 if not balanced else 1.0 / num_devices))
        devices.append(DeviceMemory(state, per))
    return devices


def fsdp_state_bytes(profile, workers: int, cpu_offload: bool = False) -> float:
    """fsdp's fixed bytes per device: the larger of its start-up and its steady-state peak.

    Start-up (the model built on meta, shards allocated, rank 0's weights sent one tensor at
    a time): 1/W of the parameters plus one full tensor in flight, at most the largest block.
    The full model is never on a device. Steady state: 1/W of parameters, gradients and
    optimizer state, plus one block gathered whole with its unsharded gradients.
    """
    largest_block = max(profile.block_param_bytes)
    if cpu_offload:  # shards, gradients and optimizer state on the host: one block gathered with its gradients
        return 2 * largest_block
    start_up = profile.param_bytes / workers + largest_block
    steady = profile.state_bytes() / workers + 2 * largest_block
    return max(start_up, steady)


def tensor_parallel_memory(profile, cfg, replicas: int, micro_batches: int, sharded: bool) -> List[DeviceMemory]:
    """Every device of a run whose workers form tensor groups of ``cfg.tensor_parallel_size`` (T): each holds 1/T
    of every layer, and 1/``replicas`` more of it where FSDP shards over the groups (``sharded``), plus one block
    gathered over the groups with its gradients (1/T of it); its activations are 1/T of a replica's micro-batch's
    (sequence parallel splits the rest), the input and the gathered outputs whole."""
    size = cfg.tensor_parallel_size
    largest = max(profile.block_param_bytes) / size
    if sharded and cfg.cpu_offload:
        fixed = 2 * largest
    elif sharded:
        fixed = max(profile.param_bytes / (replicas * size) + largest,
                    profile.state_bytes() / (replicas * size) + 2 * largest)
    else:  # replicated over the groups: a whole layer's share on every device
        fixed = profile.state_bytes() / size
    share = 1 / (replicas * micro_batches)
    per_sample = profile.activations() * share / size + (profile.input_bytes + profile.output_bytes) * share
    return [DeviceMemory(fixed, per_sample)] * cfg.num_workers
