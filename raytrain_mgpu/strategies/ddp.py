"""``ddp``: one model replica per Ray Train worker, gradients all-reduced by DDP."""

from __future__ import annotations

from typing import ContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_mgpu.strategies.base import Strategy, ddp_no_sync


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the workers (gloo on CPU, NCCL on GPU)."""

    name = "ddp"

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.ctx.world_size == 1:
            # A one-process DDP only adds hooks and a broadcast: train the plain model.
            return model
        return DistributedDataParallel(model, **ddp_kwargs(self.cfg, [self.device] if self.device.type == "cuda" else None))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return ddp_no_sync(model)


def ddp_kwargs(cfg, device_ids) -> dict:
    """The DDP options a user can pass through TrainConfig."""
    kwargs = dict(device_ids=device_ids,
                  find_unused_parameters=cfg.find_unused_parameters,
                  static_graph=cfg.static_graph,
                  gradient_as_bucket_view=cfg.gradient_as_bucket_view)
    if cfg.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    return kwargs
