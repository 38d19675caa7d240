"""``ddp_mp``: DDP over workers, each holding the model split over its devices.

Seed 000's "distributed model and data parallel": every worker is one data-parallel
replica whose model spans ``gpus_per_worker`` devices (split as in ``mp``). DDP is built
with ``device_ids=None``, as torch requires for a module on several devices; its buckets
are then per device and each device's gradients are all-reduced with the other workers'.
Under GPU emulation every device is the CPU: the split, the hops and DDP over the split
model run as on GPUs, with gloo.
"""

from __future__ import annotations

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_mgpu.strategies.base import DDP_OPTIONS, Strategy, ddp_no_sync, num_blocks
from raytrain_mgpu.strategies.ddp import ddp_kwargs
from raytrain_mgpu.strategies.mp import check_split, place_model, split_memory, validate_split


class DDPMPStrategy(Strategy):
    """Data parallel over workers, model parallel inside each."""

    name = "ddp_mp"
    elastic = True  # one replica per worker: num_workers=(min, max) resizes it
    options_used = DDP_OPTIONS | {"gpus_per_worker", "balance", "sync_batchnorm"}

    @classmethod
    def validate(cls, cfg) -> None:
        validate_split(cfg)
        super().validate(cfg)

    @classmethod
    def check_model(cls, cfg, input_shape: tuple, num_classes: int) -> None:
        check_split(cfg, input_shape, num_classes)

    @classmethod
    def devices_per_worker(cls, cfg) -> int:
        return cfg.gpus_per_worker

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        n, nodes = info.num_devices, info.num_nodes
        # Across nodes: one worker per node over its devices (at most one per block); on one node: pairs.
        workers = nodes if nodes > 1 else n // 2
        devices = min(min(info.devices_per_node), num_blocks(cfg)) if nodes > 1 else 2
        if workers < 2 or devices < 2:
            raise ValueError(f"{cls.name} needs at least 2 workers x 2 devices; with {n} device(s) it is mp or ddp")
        return {"num_workers": workers, "gpus_per_worker": devices}

    @classmethod
    def device_memory(cls, cfg, profile):
        return split_memory(cls, cfg, profile)

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        if num_gpus < 2:
            raise ValueError("needs 2 GPUs")
        return {"num_workers": max(1, min(2, num_gpus // 2)), "gpus_per_worker": 2}

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = place_model(model, self.ctx.devices, self.cfg.balance)
        if self.ctx.world_size == 1:
            return model  # one replica: nothing to all-reduce
        return DistributedDataParallel(model, **ddp_kwargs(self.cfg, None))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return ddp_no_sync(model)
