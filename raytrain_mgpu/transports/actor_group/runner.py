"""The pipeline's transport on the driver: attempts of one actor group each, retried from the last checkpoint.

:func:`run_pipeline` is called by :func:`raytrain_mgpu.api.fit` (through ``transports.carrier``) for strategies
with ``runner == "actor_group"``, with Ray connected and the config validated. An attempt places the stage actors
(``group.py``), forms their process group, and has every actor run the engine (``stage.StageWorker.run``: the same
loop, checkpoints and restore as a Ray Train worker's); the driver only carries their events to ``fit``'s
``RunEvents`` (the progress channel of ``driver/progress.py``) and tears the group down. A failed attempt (an
actor that died, a stage that lost its peer) restarts from the last checkpoint while ``max_failures`` allows
(the one retry policy: ``transports/retry.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Optional


from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.strategies.plan import RunPlan, build_plan
from raytrain_mgpu.transports.base import RunResult

logger = logging.getLogger(__name__)

__all__ = ["run_pipeline"]


def _check_resources(cfg: TrainConfig, bundles: list, replicas: int) -> None:
    """One device (GPU, or ``cpus_per_worker`` CPUs) per stage actor, or a clear error.

    Counted against what the cluster can have (:func:`raytrain_mgpu.driver.cluster.read_capacity`):
    on an autoscaling cluster with no GPU node up yet, the GPUs its node types can add.
    """
    from raytrain_mgpu.driver.cluster import read_capacity

    capacity = read_capacity()
    if capacity.node_types_unknown:  # what it can add is not known here: placement_timeout_s bounds the wait
        return
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


def _partition(cfg: TrainConfig, group=None):
    """The checkpoint's partition on a resume (its optimizer state is per stage), else the configured one;
    ``balance="time"`` is measured by the first actor (``group``), after a cheap check without it."""
    from raytrain_mgpu.pipeline.plan import check_splittable, choose_partition, partition_from_checkpoint
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    state = RunFolder.of(cfg).state()
    if state.checkpoint is not None and state.partition is not None:
        return partition_from_checkpoint(cfg, state.partition, state.checkpoint)
    if cfg.balance != "time":
        return choose_partition(cfg)
    if group is None:
        check_splittable(cfg)
        return None
    return choose_partition(cfg, profile=group.profile)


class _Noticed:
    """``fit``'s events, the driver's lines (notices) also kept: whether a failed attempt was a preemption."""

    def __init__(self, events, notices: list):
        self.events, self.notices = events, notices

    def banner(self, line: str) -> None:
        self.notices.append(line)
        self.events.banner(line)

    def __getattr__(self, name):
        return getattr(self.events, name)


def train_attempt(cfg: TrainConfig, plan: RunPlan, events, notices: Optional[list] = None) -> Optional[dict]:
    """One actor group: start it, run the engine on every actor, always tear down; rank 0's start-up times.
    ``notices``: the driver's lines of this attempt are added to it (a preemption's among them)."""
    notices = [] if notices is None else notices
    from raytrain_mgpu.transports.actor_group.group import StageGroup
    from raytrain_mgpu.driver.progress import ProgressSink, SinkPump
    from raytrain_mgpu.driver.runlock import remove_stale_temporaries
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    remove_stale_temporaries(RunFolder.of(cfg))  # a failed attempt's (or killed driver's) half-written checkpoints
    partition = _partition(cfg)  # a model that cannot be split fails before any actor starts
    group, sink = StageGroup(cfg, plan), ProgressSink.open()
    # replica 0's first and last stage send the per-step scalars (one stage: it sends both)
    pump = SinkPump(sink, _Noticed(events, notices), scalar_sources=1 if cfg.num_stages == 1 else 2,
                    stall_timeout_s=cfg.stall_timeout_s,  # every stage's heartbeats judged
                    ledger=getattr(events, "goodput", None))  # fit's goodput ledger (driver/goodput.py)
    try:
        started = time.perf_counter()
        group.start()
        partition = partition or _partition(cfg, group)
        infos = group.setup(partition)
        logger.info("%s: %d replica(s) x %d stages (%s, partition %s); %s; %d steps per epoch; rank: node %s "
                    "(set up in %.1f s)", cfg.strategy, plan.replicas, cfg.num_stages, cfg.schedule,
                    list(partition.counts), plan.describe(), infos[0]["steps_per_epoch"],
                    ", ".join(f"{info['rank']}: {info['node_ip']}" for info in infos), time.perf_counter() - started)
        try:
            with pump:
                group.call("run", uuid.uuid4().hex[:12], sink)
        except Exception as exc:
            if pump.stall is None:
                raise
            from raytrain_mgpu.errors import StuckRankError

            raise StuckRankError(pump.stall.line, pump.stall.ranks, pump.stall.report) from exc
        group.shutdown(graceful=True)
        if pump.failure is not None:
            raise pump.failure
        return pump.startup
    finally:
        group.shutdown()
        sink.close()


def run_pipeline(cfg: TrainConfig, plan: Optional[RunPlan], events) -> RunResult:
    """Train ``cfg`` with its pipeline strategy; resume from the newest checkpoint of ``{storage_path}/{name}``
    if there is one, restart after failures (``max_failures``). ``plan``: ``fit``'s (None: built here); ``events``:
    ``fit``'s ``RunEvents``."""
    from raytrain_mgpu.driver.cluster import check_placeable
    from raytrain_mgpu.transports.preemption import was_preemption
    from raytrain_mgpu.checkpointing.run_folder import RunFolder
    from raytrain_mgpu.transports.retry import run_attempts

    plan = plan if plan is not None else build_plan(cfg)  # fit hands its plan down; direct callers get the same
    if plan.runner != "actor_group":
        raise ValueError(f"TrainConfig.strategy={cfg.strategy!r} is not a pipeline strategy; fit() runs it "
                         f"with Ray Train workers.")
    # The placement check of the stage actors (fit leaves it to this runner: the fix is in its terms)
    _check_resources(cfg, list(plan.bundles), plan.replicas)
    check_placeable(list(plan.bundles), cfg.use_gpu,
                    f"strategy={cfg.strategy!r} with {plan.replicas} replica(s) x num_stages={cfg.num_stages}",
                    labels=cfg.label_selector)
    first: list = []
    notices: list = []  # this attempt's lines: a preemption notice counts its failure against max_preemption_failures

    def attempt(_failures: int) -> None:
        notices.clear()
        first.append(train_attempt(cfg, plan, events, notices))

    try:
        run_attempts(cfg, attempt, preempted=lambda exc: was_preemption(exc, notices), what="pipeline attempt",
                     ledger=getattr(events, "goodput", None))
    except Exception as exc:  # the stage's own error, out of Ray's wrapper, with where the checkpoints are
        from raytrain_mgpu.transports.retry import whole_failure

        failed = whole_failure(cfg, exc)
        if failed is exc:
            raise
        raise failed from exc
    state = RunFolder.of(cfg).state()
    return RunResult(state.history, state.checkpoint, next((s for s in first if s), None))
