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

from raytrain_mgpu.strategies.base import DDP_OPTIONS, Strategy, ddp_no_sync
from raytrain_mgpu.strategies.ddp import ddp_kwargs
from raytrain_mgpu.strategies.mp import check_split, place_model, validate_split


class DDPMPStrategy(Strategy):
    """Data parallel over workers, model parallel inside each."""

    name = "ddp_mp"
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

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = place_model(model, self.ctx.devices, self.cfg.balance)
        if self.ctx.world_size == 1:
            return model  # one replica: nothing to all-reduce
        return DistributedDataParallel(model, **ddp_kwargs(self.cfg, None))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return ddp_no_sync(model)
