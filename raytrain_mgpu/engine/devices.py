"""Every device and backend decision, in one place; and the GPU emulation switch.

On a real GPU node, a Ray worker's devices are its ``ray.get_gpu_ids()`` mapped through
``CUDA_VISIBLE_DEVICES`` (what ``ray.train.torch.get_devices`` does), and its backend is
NCCL. On a CPU machine with ``use_gpu=False`` the devices are the CPU and the backend gloo.

**Emulation** (``RAYTRAIN_MGPU_EMULATE_GPUS=N``, read only here): a local Ray started by
``fit`` gets N fake GPUs, so Ray schedules workers and stage actors onto GPUs and sets
``CUDA_VISIBLE_DEVICES`` as on a real node. The same mapping then gives each worker its
*intended* devices (``cuda:k``) and backend (``nccl``), which are recorded; the tensors
are computed on the CPU with gloo, and point-to-point messages get NCCL's semantics
(see ``raytrain_mgpu.pipeline.p2p``). What emulation proves: scheduling, device
assignment, the multi-device code paths (with CPU stand-ins for torch's CUDA-only
scatter/replicate), communicator start-up order. What it does not: CUDA kernels, NCCL's
own bugs, memory figures, speed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["EMULATE_ENV", "DeviceAssignment", "emulated_gpus", "is_emulated", "backend", "intended_backend",
           "resolve_devices", "local_ray_init_kwargs", "runtime_env_vars", "visible_gpu_indices"]

EMULATE_ENV = "RAYTRAIN_MGPU_EMULATE_GPUS"


def emulated_gpus() -> int:
    """N from ``RAYTRAIN_MGPU_EMULATE_GPUS`` (0 when unset or empty)."""
    raw = os.environ.get(EMULATE_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{EMULATE_ENV}={raw!r}: must be a whole number of GPUs to emulate (0 or more), "
                         f"e.g. {EMULATE_ENV}=4. Unset it to use real GPUs.")
    return value


def is_emulated() -> bool:
    return emulated_gpus() > 0


def backend(use_gpu: bool) -> str:
    """The ``torch.distributed`` backend that runs: NCCL on real GPUs, gloo otherwise."""
    return "nccl" if use_gpu and not is_emulated() else "gloo"


def intended_backend(use_gpu: bool) -> str:
    """The backend a real GPU node would use (what emulation records)."""
    return "nccl" if use_gpu else "gloo"


@dataclass(frozen=True)
class DeviceAssignment:
    """One process's devices: where tensors live, and where they would live on GPUs."""

    compute: Tuple[torch.device, ...]  # where tensors are placed (CPU under emulation)
    intended: Tuple[str, ...]          # "cuda:k" on GPUs and under emulation, "cpu" otherwise
    backend: str                       # what torch.distributed runs
    intended_backend: str              # what a real GPU node runs
    emulated: bool

    def record(self) -> Dict[str, object]:
        """What metrics carry per rank, so tests and users see the decisions."""
        return {"devices": list(self.intended), "backend": self.intended_backend, "emulated": self.emulated}


def visible_gpu_indices(gpu_ids: Sequence, cuda_visible: Optional[str]) -> List[int]:
    """Ray's GPU ids mapped to CUDA device indices through ``CUDA_VISIBLE_DEVICES``.

    The same mapping as ``ray.train.torch.get_devices``: Ray Train sets every worker's
    ``CUDA_VISIBLE_DEVICES`` to all GPUs its node's workers hold, so worker k's GPU id is
    found at some position in that list, and that position is its ``cuda:`` index.
    """
    visible = [v for v in (cuda_visible or "").split(",") if v and v != "NoDevFiles"]
    indices = []
    for gpu_id in (str(g) for g in gpu_ids):
        if gpu_id not in visible:
            raise RuntimeError(f"CUDA_VISIBLE_DEVICES={cuda_visible!r} does not include this process's Ray GPU id "
                               f"{gpu_id} (ray.get_gpu_ids()={list(gpu_ids)}). Do not override "
                               f"CUDA_VISIBLE_DEVICES in a runtime_env; Ray sets it.")
        indices.append(visible.index(gpu_id))
    return indices


def resolve_devices(use_gpu: bool, num_devices: int, gpu_ids: Optional[Sequence] = None) -> DeviceAssignment:
    """This Ray worker's (or stage actor's) devices; call it inside the process that computes.

    With ``use_gpu``: one device per GPU Ray assigned to this process (``gpu_ids``, its ``ray.get_gpu_ids()``,
    handed in by the transport), in order. Without Ray's ids (the in-process runner, local tests):
    ``cuda:0..num_devices-1``.
    Without: ``num_devices`` times the CPU (CPU stand-ins for a worker's "devices").
    """
    if not isinstance(use_gpu, bool):  # "auto" is truthy: a config fit has not resolved would quietly take GPUs
        raise TypeError(f"resolve_devices(use_gpu={use_gpu!r}): needs True or False; TrainConfig.use_gpu='auto' is "
                        f"resolved where a run starts (planning/auto_devices.resolve_auto_devices, fit's first step).")
    if not use_gpu:
        cpu = torch.device("cpu")
        return DeviceAssignment((cpu,) * num_devices, ("cpu",) * num_devices, "gloo", "gloo", False)
    indices = _assigned_gpu_indices(num_devices, gpu_ids)
    emulated = is_emulated()
    if emulated:
        compute = (torch.device("cpu"),) * len(indices)
    else:
        compute = tuple(torch.device("cuda", i) for i in indices)
    return DeviceAssignment(compute, tuple(f"cuda:{i}" for i in indices), backend(True), "nccl", emulated)


def _assigned_gpu_indices(num_devices: int, gpu_ids: Optional[Sequence] = None) -> List[int]:
    if not gpu_ids:
        return list(range(num_devices))
    return visible_gpu_indices(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))


def local_ray_init_kwargs() -> dict:
    """Extra ``ray.init`` arguments for a local instance ``fit`` starts: N fake GPUs under emulation."""
    n = emulated_gpus()
    return {"num_gpus": n} if n else {}


def runtime_env_vars() -> Dict[str, str]:
    """Environment every training process inherits, so emulation reaches workers and stage actors."""
    n = emulated_gpus()
    return {EMULATE_ENV: str(n)} if n else {}
