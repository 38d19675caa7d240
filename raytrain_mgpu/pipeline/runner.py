"""The pipeline runner: retries of whole attempts, each one actor group (see ``driver.py``).

:func:`run_pipeline` is called by :func:`raytrain_mgpu.api.fit` for strategies with
``runner == "actor_group"``, with Ray connected and the config validated.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import ray

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.strategies.plan import RunPlan, build_plan

logger = logging.getLogger(__name__)

__all__ = ["RunOutcome", "run_pipeline"]


class RunOutcome(NamedTuple):
    checkpoint_path: str
    """The newest checkpoint folder (the whole model loads from it)."""
    history: list
    """Per-epoch metrics, resumed attempts included."""


def _retryable(exc: BaseException) -> bool:
    # An actor that died, or a stage that lost its peer: restart from the last checkpoint.
    # A ValueError (raised on the driver or in an actor) is a configuration error: retrying
    # would fail the same way.
    return isinstance(exc, ray.exceptions.RayError) and not isinstance(exc, ValueError)


def _check_resources(cfg: TrainConfig, bundles: list, replicas: int) -> None:
    """One device (GPU, or ``cpus_per_worker`` CPUs) per stage actor, or a clear error.

    Counted against what the cluster can have (:func:`raytrain_mgpu.runtime.cluster.read_capacity`):
    on an autoscaling cluster with no GPU node up yet, the GPUs its node types can add.
    """
    from raytrain_mgpu.runtime.cluster import read_capacity

    capacity = read_capacity()
    for key in ("GPU", "CPU"):
        needed = sum(b.get(key, 0) for b in bundles)
        have = capacity.max_total(key, unlimited=len(bundles))
        if needed > have:
            where = (f"this autoscaling cluster can scale to at most {have:g} {key} ({capacity.describe()})"
                     if capacity.autoscales else f"the Ray cluster has {have:g} {key}")
            raise ValueError(
                f"strategy={cfg.strategy!r} needs {needed:g} {key} ({bundles[0][key]:g} per stage actor x "
                f"{replicas} replica(s) x num_stages={cfg.num_stages}), but {where}. "
                f"Lower num_stages" + (" or num_workers" if replicas > 1 else "")
                + (" or cpus_per_worker" if key == "CPU" else "") + f", or add {key}s to the cluster.")


def run_pipeline(cfg: TrainConfig, reporter, plan: Optional[RunPlan] = None) -> RunOutcome:
    """Train ``cfg`` with its pipeline strategy; resume from the newest checkpoint of
    ``{storage_path}/{name}`` if there is one, restart after failures (``max_failures``).

    ``reporter.epoch(metrics)`` is called once per epoch, then ``reporter.checkpoint(path)``
    (where the reporter has it: ``fit``'s ``RunEvents``), ``reporter.step(step, total)``
    every few steps.
    """
    from raytrain_mgpu.runtime.cluster import check_placeable
    from raytrain_mgpu.pipeline.driver import load_state, train_attempt
    plan = plan if plan is not None else build_plan(cfg)  # fit hands its plan down; direct callers get the same
    if plan.runner != "actor_group":
        raise ValueError(f"TrainConfig.strategy={cfg.strategy!r} is not a pipeline strategy; fit() runs it "
                         f"with Ray Train workers.")
    # The placement check of the stage actors (fit leaves it to this runner: the fix is in its terms)
    _check_resources(cfg, list(plan.bundles), plan.replicas)
    check_placeable(list(plan.bundles), cfg.use_gpu,
                    f"strategy={cfg.strategy!r} with {plan.replicas} replica(s) x num_stages={cfg.num_stages}")
    failures = 0
    while True:
        state = load_state(cfg)
        state.attempt = max(state.attempt, failures)  # a restart before the first checkpoint counts too
        if state.finished(cfg) and state.checkpoint is not None:
            logger.info("%s is already trained (epoch %d, step %d%s): nothing to do", cfg.name, state.epoch,
                        state.step, ", stopped early" if state.meta.get("stopped_early") else "")
            return RunOutcome(state.checkpoint, state.history)
        try:
            path, history = train_attempt(cfg, plan, reporter, state)
            return RunOutcome(path, history)
        except Exception as exc:
            if not _retryable(exc) or (cfg.max_failures != -1 and failures >= cfg.max_failures):
                raise
            failures += 1
            logger.warning("pipeline attempt failed (%s: %s); restart %d of %s from the last checkpoint",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                           failures, "unlimited" if cfg.max_failures == -1 else cfg.max_failures)
