"""Optimizers and LR schedules, built from ``OptimConfig`` alone.

``optimizer`` is ``sgd``, ``adamw`` or a ``"module:function"`` called as
``function(params, lr, **optimizer_kwargs)`` that returns a ``torch.optim.Optimizer``; the
LR schedule wraps whichever it is, and its ``state_dict()`` is checkpointed and restored
like the built-in ones' (checkpoints load with ``weights_only=True``: its state must be
tensors, numbers and plain containers, as torch's optimizers' is).

The schedule is per optimizer step: linear warm-up over ``warmup_epochs``, then
constant, step or cosine decay. ``lr_scaling`` scales the peak LR with the global
batch relative to ``base_batch_size`` (Goyal et al. 2017: linear scaling + warm-up).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from raytrain_mgpu._factory import code_name, function_name, is_factory, load_factory
from raytrain_mgpu.config_sections import OptimConfig


def build_optimizer(params: Iterable, cfg: OptimConfig) -> torch.optim.Optimizer:
    lr, kwargs = cfg.scaled_lr(), dict(cfg.optimizer_kwargs)
    if is_factory(cfg.optimizer):
        return _from_factory(cfg.optimizer, params, lr, kwargs)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kwargs)
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **kwargs)


def _from_factory(factory_spec, params: Iterable, lr: float, kwargs: dict) -> torch.optim.Optimizer:
    factory, spec = load_factory(factory_spec, "optimizer"), code_name(factory_spec)
    call = f"{function_name(factory_spec)}(params, lr={lr!r}{''.join(f', {k}={v!r}' for k, v in kwargs.items())})"
    try:
        optimizer = factory(params, lr, **kwargs)
    except Exception as exc:  # the user's code: name it and what it was given
        raise ValueError(f"TrainConfig.optimizer={spec!r} failed: {call} raised {type(exc).__name__}: {exc}. "
                         f"Fix the factory or TrainConfig.optimizer_kwargs.") from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        # LambdaLR, the checkpoint and fsdp's optimizer state all need one
        raise ValueError(f"TrainConfig.optimizer={spec!r}: {call} returned a {type(optimizer).__name__}, not a "
                         f"torch.optim.Optimizer. Return the optimizer built over params.")
    return optimizer


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
