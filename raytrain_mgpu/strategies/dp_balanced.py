"""``dp_balanced``: DataParallel whose outputs never leave their devices.

Our take on seed 001's "custom DataParallel" (PyTorch-Encoding's DataParallelModel +
DataParallelCriterion), written on torch's own ``scatter``/``replicate``/``parallel_apply``:
inputs *and targets* are scattered, each device computes its slice's outputs, the run's loss
(``TrainConfig.loss``) and every metric's ``(sum, count)``, and only those scalars cross to
the first device. With ``nn.DataParallel`` all outputs are gathered on one GPU first, which
for large outputs (many classes, per-token vocabularies) is what fills it up.

The mean loss is the plain model's mean over the batch: each device's mean is weighted by
its share of the targets, so uneven slices (a batch of 10 on 3 devices: 4, 4, 2) and the
gradients come out exactly as without the split. That holds for any loss that is a mean
over the targets; one that needs the whole batch at once (in-batch negatives) is ``ddp2``'s
(or ``dp``'s) to compute. Metric sums and counts simply add up over the devices.

On CPU "devices" (GPU emulation and tests) the same scatter -> replicate ->
parallel_apply path runs on the CPU stand-ins of ``_dp_ops`` (one thread per device,
replicas sharing the parameters), so emulation exercises the GPU code, not a substitute.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

import torch
from torch import nn

from raytrain_mgpu.batches import call_model, detach, target_count
from raytrain_mgpu.objectives import Objective, Predictions, add_pairs, move_pairs
from raytrain_mgpu.strategies._dp_ops import parallel_apply, replicate, scatter
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, Strategy, require_one_worker
from raytrain_mgpu.strategies.dp import (autocast_state, call_with_autocast, data_parallel_memory, demo_node_layout,
                                         one_node_layout)


def _slice_loss(objective: Objective, model: nn.Module, x, y) -> Tuple[torch.Tensor, list, int, object]:
    """One device's ``(mean loss, metric pairs, number of targets, outputs)``, all on that device."""
    outputs = call_model(model, x)
    return objective.loss(outputs, y), objective.measure(outputs, y), target_count(y), detach(outputs)


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
        total = sum(n for _, _, n, _ in parts)
        # Scalars only cross devices here: per device one float for the loss, two per metric.
        loss = sum(part_loss.to(self.device) * (n / total) for part_loss, _, n, _ in parts)
        pairs = add_pairs([move_pairs(part_pairs, self.device) for _, part_pairs, _, _ in parts])
        return loss, Predictions(pairs, [outputs for *_, outputs in parts], self.device)

    def _slice_losses(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> List[tuple]:
        devices = list(self.ctx.devices)
        state = autocast_state(self.device.type)
        if len(devices) == 1:
            return [call_with_autocast(_slice_loss, state, self.objective, model, x, y)]
        # CUDA: torch's ops; CPU devices: their stand-ins (same split, one thread per device).
        xs, ys = scatter(x, devices), scatter(y, devices)  # a batch smaller than len(devices): fewer slices
        used = devices[: len(xs)]
        replicas = replicate(model, used, detach=not torch.is_grad_enabled())
        calls = [functools.partial(call_with_autocast, _slice_loss, state, self.objective, r) for r in replicas]
        return parallel_apply(calls, list(zip(xs, ys)), devices=used)
