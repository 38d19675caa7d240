"""``dp``: ``nn.DataParallel`` over the devices of one worker (the seeds' "one line").

Every step scatters the batch from the first device, replicates the model onto every
device, runs the replicas in threads and gathers all outputs onto ``output_device``,
where the loss is computed. That gather is why the first GPU fills up first (seed 001);
``output_device`` moves it elsewhere, ``dp_balanced`` avoids it, and ``ddp`` (one process
per GPU) is faster still.

Autocast state is thread-local and ``parallel_apply`` restores only "enabled", not the
dtype, so plain ``nn.DataParallel`` runs bf16-mixed replicas in fp16 on CUDA. The
subclass here hands each replica the caller's autocast dtype.

On CPU "devices" (GPU emulation and tests) ``nn.DataParallel`` would call the module
once on the whole batch (torch does no scatter without CUDA), so more than one CPU device
gets :class:`StandInDataParallel`: the same scatter -> replicate -> parallel_apply ->
gather on the CPU stand-ins of ``_dp_ops``. One CPU device trains the plain model.
"""

from __future__ import annotations

import functools
import logging
from typing import List, Tuple

import torch
from torch import nn
from torch.nn.parallel import parallel_apply

from raytrain_mgpu.strategies import _dp_ops
from raytrain_mgpu.strategies._memory import data_parallel_node
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, ModelWrapper, Strategy, require_one_worker

logger = logging.getLogger(__name__)


def autocast_state(device_type: str) -> Tuple[str, torch.dtype, bool]:
    """The calling thread's autocast setting for ``device_type``, to hand to worker threads."""
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


def call_with_autocast(module, state: Tuple[str, torch.dtype, bool], *args, **kwargs):
    """Call ``module`` under the autocast ``state`` captured in another thread."""
    device_type, dtype, enabled = state
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        return module(*args, **kwargs)


class AutocastDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replica threads use the caller's autocast dtype."""

    def parallel_apply(self, replicas, inputs, kwargs) -> List:
        state = autocast_state(self.src_device_obj.type)
        calls = [functools.partial(call_with_autocast, replica, state) for replica in replicas]
        return parallel_apply(calls, inputs, kwargs, self.device_ids[: len(replicas)])  # torch's, CUDA


class StandInDataParallel(ModelWrapper):
    """``nn.DataParallel``'s forward on CPU stand-in devices (emulation and tests only).

    Every forward splits the batch as torch's scatter does, runs one replica per device in
    its own thread and concatenates the outputs on ``output_device``: the code path of
    ``nn.DataParallel`` on GPUs, with ``_dp_ops``' CPU stand-ins for torch's CUDA-only ops.
    """

    def __init__(self, module: nn.Module, devices, output_device: int):
        super().__init__()
        self.module = module
        self.devices = list(devices)
        self.output_device = self.devices[output_device]

    def forward(self, *inputs, **kwargs):
        inputs, module_kwargs = _dp_ops.scatter_kwargs(inputs, kwargs, self.devices)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        used = self.devices[: len(inputs)]
        replicas = _dp_ops.replicate(self.module, used, detach=not torch.is_grad_enabled())
        outputs = _dp_ops.parallel_apply(replicas, inputs, module_kwargs, used)
        return _dp_ops.gather(outputs, self.output_device)


def check_output_device(cfg) -> None:
    if cfg.output_device is not None and not 0 <= cfg.output_device < cfg.gpus_per_worker:
        raise ValueError(
            f"TrainConfig.output_device={cfg.output_device}: must be the local index of one of the "
            f"worker's gpus_per_worker={cfg.gpus_per_worker} devices (0 to {cfg.gpus_per_worker - 1}). "
            f"Leave it unset to gather on the first device.")


def one_node_layout(info) -> dict:
    """One worker over the largest node's devices (``dp``, ``dp_balanced``)."""
    return {"num_workers": 1, "gpus_per_worker": max(info.devices_per_node)}


def data_parallel_memory(cls, cfg, profile, replicas: int, balanced: bool) -> list:
    """``replicas`` workers, each running DataParallel (or ``dp_balanced``) over its devices."""
    share = 1 / (replicas * cls.micro_batches_per_step(cfg))
    return data_parallel_node(profile, cfg.gpus_per_worker, share, balanced, cfg.output_device or 0) * replicas


def demo_node_layout(num_gpus: int) -> dict:
    """gpu-report's layout of a one-process strategy: one worker over (at most 4 of) the node's GPUs."""
    return {"num_workers": 1, "gpus_per_worker": min(num_gpus, 4)}


def wrap_data_parallel(model: nn.Module, devices, output_device) -> nn.Module:
    """``model`` on ``devices[0]``, wrapped to run on all ``devices``.

    CUDA devices: torch's ``nn.DataParallel`` (with the autocast fix). Several CPU devices:
    :class:`StandInDataParallel` (``nn.DataParallel`` itself would only call the module,
    and on a CUDA machine training on CPU it would claim every GPU). One CPU device: the
    plain model, as ``nn.DataParallel`` does with one device.
    """
    model = model.to(devices[0])
    if devices[0].type == "cuda":
        return AutocastDataParallel(model, device_ids=list(devices), output_device=devices[output_device])
    if len(devices) == 1:
        return model
    return StandInDataParallel(model, devices, output_device)


class DPStrategy(Strategy):
    """``nn.DataParallel`` in one worker holding ``gpus_per_worker`` devices."""

    name = "dp"
    options_used = frozenset({"gpus_per_worker", "output_device"})

    @classmethod
    def validate(cls, cfg) -> None:
        require_one_worker(cfg, cls.name, "use strategy='ddp2' (DataParallel per node, DDP across "
                                          "nodes) or 'ddp' (one worker per GPU, usually faster)")
        check_output_device(cfg)
        super().validate(cfg)

    @classmethod
    def devices_per_worker(cls, cfg) -> int:
        return cfg.gpus_per_worker

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        return one_node_layout(info)

    @classmethod
    def auto_rank(cls, info):
        return AUTO_MEASURE_ONLY + 2  # the estimate never prefers it: device 0 holds the whole state

    @classmethod
    def device_memory(cls, cfg, profile):
        return data_parallel_memory(cls, cfg, profile, 1, balanced=False)

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        return demo_node_layout(num_gpus)

    @property
    def device(self) -> torch.device:
        """Inputs, targets and the loss live on the output device (DP scatters from there)."""
        return self.ctx.devices[self.cfg.output_device or 0]

    def setup_model(self, model: nn.Module) -> nn.Module:
        return wrap_data_parallel(model, self.ctx.devices, self.cfg.output_device or 0)
