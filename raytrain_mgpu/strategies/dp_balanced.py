"""``dp_balanced``: DataParallel whose outputs never leave their devices.

Our take on seed 001's "custom DataParallel" (PyTorch-Encoding's DataParallelModel +
DataParallelCriterion), written on torch's own ``scatter``/``replicate``/``parallel_apply``:
inputs *and targets* are scattered, each device computes its slice's logits and loss, and
only a scalar loss and the argmax indices per device cross to the first device. With
``nn.DataParallel`` all logits are gathered on one GPU first, which for large outputs
(many classes, per-token vocabularies) is what fills it up.

The mean loss is the plain model's mean over the batch: each device's mean is weighted by
its share of the targets, so uneven slices (a batch of 10 on 3 devices: 4, 4, 2) and the
gradients come out exactly as without the split.

On CPU "devices" (GPU emulation and tests) the same scatter -> replicate ->
parallel_apply path runs on the CPU stand-ins of ``_dp_ops`` (one thread per device,
replicas sharing the parameters), so emulation exercises the GPU code, not a substitute.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from raytrain_mgpu.strategies._dp_ops import parallel_apply, replicate, scatter
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, Predictions, Strategy, require_one_worker
from raytrain_mgpu.strategies.dp import (autocast_state, call_with_autocast, data_parallel_memory, demo_node_layout,
                                         one_node_layout)


def _slice_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """One device's ``(mean loss, predicted indices, number of targets)``."""
    logits = model(x)
    return F.cross_entropy(logits, y), logits.detach().argmax(dim=1), y.numel()


class DPBalancedStrategy(Strategy):
    """Scatter inputs and targets, loss per device, only scalars and indices gathered."""

    name = "dp_balanced"
    options_used = frozenset({"gpus_per_worker"})

    @classmethod
    def validate(cls, cfg) -> None:
        require_one_worker(cfg, cls.name, "use strategy='ddp' (one worker per GPU: no device gathers "
                                          "anything, and it spans nodes)")
        super().validate(cfg)

    @classmethod
    def devices_per_worker(cls, cfg) -> int:
        return cfg.gpus_per_worker

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        return one_node_layout(info)

    @classmethod
    def auto_rank(cls, info):
        return AUTO_MEASURE_ONLY + 1  # device 0 holds the whole state: only a measurement can prefer it

    @classmethod
    def device_memory(cls, cfg, profile):
        return data_parallel_memory(cls, cfg, profile, 1, balanced=True)

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        return demo_node_layout(num_gpus)

    def setup_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)  # replicas are made from it every step, as DataParallel does

    def compute_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        parts = self._slice_losses(model, x, y)
        total = sum(n for _, _, n in parts)
        # Scalars only cross devices here: one float per device for the loss.
        loss = sum(part_loss.to(self.device) * (n / total) for part_loss, _, n in parts)
        indices = torch.cat([pred.to(self.device) for _, pred, _ in parts])
        return loss, Predictions(indices)

    def _slice_losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> List[tuple]:
        devices = list(self.ctx.devices)
        state = autocast_state(self.device.type)
        if len(devices) == 1:
            return [call_with_autocast(_slice_loss, state, model, x, y)]
        # CUDA: torch's ops; CPU devices: their stand-ins (same split, one thread per device).
        xs, ys = scatter(x, devices), scatter(y, devices)  # a batch smaller than len(devices): fewer slices
        used = devices[: len(xs)]
        replicas = replicate(model, used, detach=not torch.is_grad_enabled())
        calls = [functools.partial(call_with_autocast, _slice_loss, state, r) for r in replicas]
        return parallel_apply(calls, list(zip(xs, ys)), devices=used)
