"""The worker side of the strategies: the steps a data-parallel rank applies to the model, in order.

A strategy's class (``strategies/``, no torch) names its two steps, ``placement`` and
``replication``; :func:`build_worker` composes them into the :class:`WorkerStrategy` the loop
uses (``parallel/worker.py`` says what each step does), on a Ray Train worker or in the driver's
own process (``transports/base.data_parallel_steps``). The pipeline strategies run in their own
actor group (``transports/actor_group/``) with their own step runner (``pipeline/steps.py``)
and have no worker here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Type

from raytrain_mgpu.parallel.placement import PLACEMENTS
from raytrain_mgpu.parallel.replication import REPLICATIONS
from raytrain_mgpu.parallel.worker import ModelWrapper, WorkerStrategy

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import ParallelConfig
    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.strategies import Strategy, WorkerContext

__all__ = ["build_worker", "WorkerStrategy", "ModelWrapper", "PLACEMENTS", "REPLICATIONS"]


def build_worker(strategy: Type["Strategy"], cfg: "ParallelConfig", ctx: "WorkerContext",
                 objective: Optional["Objective"] = None) -> WorkerStrategy:
    """``strategy``'s placement, then its replication, on the worker ``ctx`` describes."""
    if strategy.runner != "train_workers":
        raise RuntimeError(f"strategy {strategy.name!r} runs in its own actor group (raytrain_mgpu.transports."
                           f"actor_group.runner.run_pipeline), not in the Ray Train worker loop.")
    # The step names were checked where the class was defined (strategies.base.Strategy.__init_subclass__).
    replication = REPLICATIONS[strategy.replication]
    tensor_parallel = strategy.tensor_group_size(cfg)  # the run plan's rule
    if tensor_parallel > 1:
        from raytrain_mgpu.parallel.tensor_parallel import TENSOR_PARALLEL_REPLICATIONS

        replication = TENSOR_PARALLEL_REPLICATIONS.get(strategy.replication, replication)
    return WorkerStrategy(strategy.name, PLACEMENTS[strategy.placement], replication, cfg, ctx, objective,
                          tensor_parallel_size=tensor_parallel)
