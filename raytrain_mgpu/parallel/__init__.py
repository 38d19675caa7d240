"""The worker side of the strategies: the steps a data-parallel rank applies to the model, in order.

A strategy's class (``strategies/``, no torch) names its two steps, ``placement`` and ``replication``;
:func:`build_worker` composes them into the rank's step runner, a
:class:`~raytrain_mgpu.parallel.steps.DataParallelSteps` (``parallel/steps.py`` says what each step does), on a
Ray Train worker or in the driver's own process (``transports/base.data_parallel_steps``). The pipeline
strategies run in their own actor group (``transports/actor_group/``) with their own step runner
(``pipeline/steps.py``) and have no worker here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Type

from raytrain_mgpu.parallel.placement import PLACEMENTS
from raytrain_mgpu.parallel.replication import REPLICATIONS
from raytrain_mgpu.parallel.steps import DataParallelSteps
from raytrain_mgpu.parallel.tensor_parallel import TENSOR_PARALLEL_REPLICATIONS
from raytrain_mgpu.parallel.worker import ModelWrapper, unwrap

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import ParallelConfig
    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.strategies import Strategy, WorkerContext

__all__ = ["build_worker", "DataParallelSteps", "ModelWrapper", "unwrap", "PLACEMENTS", "REPLICATIONS"]


def build_worker(strategy: Type["Strategy"], cfg: "ParallelConfig", ctx: "WorkerContext",
                 objective: Optional["Objective"] = None, user_step: Optional[Callable] = None,
                 save_trainable: bool = False) -> DataParallelSteps:
    """``strategy``'s placement, then its replication, on the worker ``ctx`` describes: its step runner
    (``user_step`` and ``save_trainable``: :class:`DataParallelSteps`')."""
    if strategy.runner != "train_workers":
        raise RuntimeError(f"strategy {strategy.name!r} runs in its own actor group (raytrain_mgpu.transports."
                           f"actor_group.runner.run_pipeline), not in the Ray Train worker loop.")
    # The step names were checked where the class was defined (strategies.base.Strategy.__init_subclass__).
    replication = REPLICATIONS[strategy.replication]
    tensor_parallel = strategy.tensor_group_size(cfg)  # the run plan's rule
    if tensor_parallel > 1:
        replication = TENSOR_PARALLEL_REPLICATIONS.get(strategy.replication, replication)
    return DataParallelSteps(strategy.name, PLACEMENTS[strategy.placement], replication, cfg, ctx, objective,
                             tensor_parallel_size=tensor_parallel, user_step=user_step, save_trainable=save_trainable)
