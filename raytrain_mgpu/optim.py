"""Optimizers and LR schedules, built from ``OptimConfig`` alone.

The schedule is per optimizer step: linear warm-up over ``warmup_epochs``, then
constant, step or cosine decay. ``lr_scaling`` scales the peak LR with the global
batch relative to ``base_batch_size`` (Goyal et al. 2017: linear scaling + warm-up).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from raytrain_mgpu.config import OptimConfig


def build_optimizer(params: Iterable, cfg: OptimConfig) -> torch.optim.Optimizer:
    lr = cfg.scaled_lr()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: OptimConfig, steps_per_epoch: int, epochs: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based)."""
    warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_schedule == "step":
        return cfg.lr_step_gamma ** (step // (cfg.lr_step_epochs * steps_per_epoch))
    if cfg.lr_schedule == "cosine":
        total = max(1, epochs * steps_per_epoch - warmup)
        progress = min(1.0, (step - warmup) / total)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps_per_epoch: int,
                    epochs: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, steps_per_epoch, epochs))
