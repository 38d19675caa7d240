"""``use_gpu="auto"`` and ``num_workers="auto"`` resolved: the GPUs found, and the strategy's layout on them.

:func:`resolve_auto_devices` is the one place: ``fit`` calls it first, ``compare`` and ``tune``'s ``search``,
``trainable`` and ``max_concurrent_trials`` before they read the config; everything after it (the plan, the
transports, the engine) sees concrete values. Only the fields that say ``"auto"`` change.

Where the GPUs are counted:

- the Ray cluster this process is connected to, or the one ``address``/``RAY_ADDRESS`` names (joined first,
  as ``fit`` would): every GPU its nodes can have (an autoscaler's node types at their maximum count,
  ``driver.cluster.read_capacity``), on the nodes that have what the workers ask for (``resources_per_worker``,
  ``accelerator_type``);
- else this machine: the GPUs torch sees, or the emulated ones (``RAYTRAIN_MGPU_EMULATE_GPUS``, what a local
  Ray started by ``fit`` gets). No Ray is started for that: a finished run is answered from its folder
  without one.

No GPU: :data:`~raytrain_mgpu.strategies.layout.CPU_DEVICES`, two CPU worker processes, as before ``"auto"``.
"""

from __future__ import annotations

import logging
import os
from typing import Tuple

from raytrain_mgpu.driver.worker_nodes import only_nodes_with, requested_keys
from raytrain_mgpu.strategies.elastic import describe_range
from raytrain_mgpu.strategies.layout import CPU_DEVICES, Devices, is_auto, laid_out
from raytrain_mgpu.strategies.plan import build_plan

logger = logging.getLogger(__name__)

__all__ = ["resolve_auto_devices"]


def resolve_auto_devices(cfg) -> Tuple[object, str]:
    """``cfg`` with ``use_gpu``/``num_workers`` ``"auto"`` resolved (validated again, as ``replace`` does), and one
    line saying what was found and chosen, e.g. ``use_gpu=auto found 4 GPUs on this machine -> 4 workers x 1 GPU``;
    ``(cfg, "")`` when neither is ``"auto"``. ValueError: the layout cannot run on what was found."""
    auto_gpu, auto_workers = is_auto(cfg.use_gpu), is_auto(cfg.num_workers)
    if not (auto_gpu or auto_workers):
        return cfg, ""
    if cfg.use_gpu is False:  # explicitly on CPU: nothing to read
        devices, found = CPU_DEVICES, "use_gpu=False"
    else:
        gpus, where = _gpus_found(cfg)
        count = f"{sum(gpus)} GPU{'s' if sum(gpus) != 1 else ''} {where}"
        if auto_gpu:
            devices = Devices(gpus, True) if gpus else CPU_DEVICES
            found = f"use_gpu=auto found {count}" if gpus else f"no GPU found {where}"
        elif gpus:
            devices, found = Devices(gpus, True), f"num_workers=auto on {count}"
        else:
            raise ValueError(f"TrainConfig.num_workers='auto' with use_gpu=True: no GPU found {where} to lay the "
                             f"workers out on. Set num_workers to the count to start with, use_gpu='auto' to train "
                             f"on the CPU where there is no GPU, or connect to a cluster with GPUs (address, "
                             f"RAY_ADDRESS).")
    changes = {"use_gpu": devices.use_gpu} if auto_gpu else {}
    if auto_workers:
        changes.update(laid_out(cfg, devices))
    try:
        resolved = cfg.replace(**changes)
    except ValueError as exc:
        raise ValueError(f"{exc} (chosen for 'auto': {_fields(changes)}, because {found}; set use_gpu and "
                         f"num_workers yourself to lay the run out otherwise)") from None
    # what was chosen here, not by the user: a run started again on other devices keeps its own (driver/rerun.py)
    resolved._left_auto = tuple(changes)
    line = f"{found} -> {_describe(resolved, devices)}"
    if not auto_workers:
        line += f" (num_workers={cfg.num_workers} as set)"
    logger.info("devices: %s", line)
    return resolved, line


def _gpus_found(cfg) -> Tuple[Tuple[int, ...], str]:
    """``(GPUs per node with any, where)``: the connected (or named) Ray cluster's, else this machine's."""
    import ray  # late: loads Ray; the rules of this module need neither Ray nor torch

    if ray.is_initialized() or cfg.address or os.environ.get("RAY_ADDRESS"):
        # late: loads Ray and torch, for a cluster that is up or named
        from raytrain_mgpu.driver.cluster import connect, keep_ray_started, read_capacity

        keep_ray_started(connect(cfg.address, cfg.verbose, local_has_gpu_check=False))  # Ray up already: nothing
        capacity = only_nodes_with(read_capacity(), requested_keys(cfg))  # the nodes the workers may use
        gpus = capacity.gpus_per_node()
        nodes = f" ({len(gpus)} nodes)" if len(gpus) > 1 else ""
        scaling = " (counting the nodes its autoscaler can add)" if capacity.autoscales else ""
        return gpus, f"on the Ray cluster{nodes}{scaling}"
    from raytrain_mgpu.engine.devices import EMULATE_ENV, emulated_gpus  # late: loads torch

    emulated = emulated_gpus()
    if emulated:
        return (emulated,), f"on this machine (emulated by {EMULATE_ENV})"
    import torch  # late: loads torch (see above)

    count = torch.cuda.device_count()  # asks the driver (NVML), without starting CUDA in this process
    return ((count,) if count else ()), "on this machine"


def _describe(cfg, devices: Devices) -> str:
    """``4 workers x 1 GPU``, ``1 worker x 4 GPUs``, ``2 CPU workers``, ``1 CPU worker x 2 CPU stand-in devices``."""
    if cfg.strategy == "auto":  # laid out by planning/auto.py next, once the cluster is read
        unit = "GPU" if cfg.use_gpu else "CPU worker"
        return f"strategy=auto lays the run out on {devices.num_devices} {unit}(s)"
    plan = build_plan(cfg)
    count = describe_range(cfg) if plan.runner == "train_workers" else str(plan.num_processes)
    what = ("stage actor" if plan.runner == "actor_group" else "worker") + ("" if count == "1" else "s")
    per = plan.devices_per_worker
    if cfg.use_gpu:
        return f"{count} {what} x {per} GPU{'s' if per > 1 else ''}"
    return f"{count} CPU {what}" + (f" x {per} CPU stand-in devices" if per > 1 else "")


def _fields(changes: dict) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in changes.items())
