"""Strategies: one class per file, registered under one name.

``get_strategy(name)`` is the only lookup; an unknown name lists the valid ones.
"""

from __future__ import annotations

from typing import Dict, Type

from raytrain_mgpu.config.names import did_you_mean
from raytrain_mgpu.strategies.base import Strategy, WorkerContext, check_batch_divisible
from raytrain_mgpu.strategies.ddp import DDPStrategy
from raytrain_mgpu.strategies.ddp2 import DDP2Strategy
from raytrain_mgpu.strategies.ddp_mp import DDPMPStrategy
from raytrain_mgpu.strategies.dp import DPStrategy
from raytrain_mgpu.strategies.dp_balanced import DPBalancedStrategy
from raytrain_mgpu.strategies.fsdp import FSDPStrategy
from raytrain_mgpu.strategies.mp import MPStrategy
from raytrain_mgpu.strategies.pipeline import DDPPipelineStrategy, PipelineStrategy

STRATEGIES: Dict[str, Type[Strategy]] = {
    cls.name: cls
    for cls in (
        DDPStrategy,
        DPStrategy,
        DPBalancedStrategy,
        MPStrategy,
        DDPMPStrategy,
        DDP2Strategy,
        FSDPStrategy,
        PipelineStrategy, DDPPipelineStrategy,
    )
}


def strategy_names() -> list:
    return sorted(STRATEGIES)


def get_strategy(name: str) -> Type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"TrainConfig.strategy={name!r} is not a known strategy.{did_you_mean(name, [*STRATEGIES, 'auto'])} "
                         f"Valid names: {', '.join([*strategy_names(), 'auto'])} (auto: chosen when fit starts)."
                         ) from None


__all__ = ["Strategy", "WorkerContext", "STRATEGIES", "get_strategy", "strategy_names", "check_batch_divisible"]
