"""The pipeline's transport on the driver: attempts of one actor group each, retried from the last checkpoint.

:func:`run_pipeline` is called by :func:`raytrain_mgpu.api.fit` (through ``transports.carrier``) for strategies
with ``runner == "actor_group"``, with Ray connected and the config validated. An attempt places the stage actors
(``group.py``), forms their process group, and has every actor run the engine (``stage.StageWorker.run``: the same
loop, checkpoints and restore as a Ray Train worker's). :class:`ActorGroupCarrier` starts, waits for and tears
down one group; the attempt driver (``transports/attempt.py``) owns the rest: the progress channel, the cleanup,
the failure, the restarts from the last checkpoint while ``max_failures`` allows (a node drained for preemption:
``max_preemption_failures``) and the result.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Optional

import ray.util

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.driver import cluster  # by module: tests replace cluster.read_capacity
from raytrain_mgpu.pipeline.plan import check_splittable, choose_partition, partition_from_checkpoint
from raytrain_mgpu.strategies.plan import RunPlan, build_plan
from raytrain_mgpu.transports.actor_group import group as actor_group  # by module: tests replace its StageGroup
from raytrain_mgpu.transports.attempt import Carrier, drive
from raytrain_mgpu.transports.base import RunResult
from raytrain_mgpu.transports.preemption import DrainWatcher

logger = logging.getLogger(__name__)

__all__ = ["run_pipeline", "ActorGroupCarrier"]


def _check_resources(cfg: TrainConfig, bundles: list, replicas: int) -> None:
    """One device (GPU, or ``cpus_per_worker`` CPUs) per stage actor, or a clear error.

    Counted against what the cluster can have (:func:`raytrain_mgpu.driver.cluster.read_capacity`):
    on an autoscaling cluster with no GPU node up yet, the GPUs its node types can add.
    """
    capacity = cluster.read_capacity()
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
    state = RunFolder.of(cfg).state()
    if state.checkpoint is not None and state.partition is not None:
        return partition_from_checkpoint(cfg, state.partition, state.checkpoint)
    if cfg.balance != "time":
        return choose_partition(cfg)
    if group is None:
        check_splittable(cfg)
        return None
    return choose_partition(cfg, profile=group.profile)


class ActorGroupCarrier(Carrier):
    """The pipeline's stage actors: an actor group each attempt (``group.py``), every actor running the engine
    (``stage.StageWorker.run``); the driver watches the group's nodes for a drain (a preemption: the attempt's
    failure counts against ``max_preemption_failures``)."""

    what = "pipeline attempt"

    def __init__(self, cfg: TrainConfig, plan: RunPlan, events):
        super().__init__(cfg, plan, events)
        # replica 0's first and last stage send the per-step scalars (one stage: it sends both)
        self.scalar_sources = 1 if cfg.num_stages == 1 else 2
        self.group = self.watcher = self.sink = None

    def start(self, sink, attempt: int) -> None:
        cfg, plan = self.cfg, self.plan
        partition = _partition(cfg)  # a model that cannot be split fails before any actor starts
        self.group, self.sink = actor_group.StageGroup(cfg, plan), sink
        started = time.perf_counter()
        self.group.start()
        self.watcher = _drain_watcher(self.group)
        partition = partition or _partition(cfg, self.group)
        infos = self.group.setup(partition)
        logger.info("%s: %d replica(s) x %d stages (%s, partition %s); %s; %d steps per epoch; rank: node %s "
                    "(set up in %.1f s)", cfg.strategy, plan.replicas, cfg.num_stages, cfg.schedule,
                    list(partition.counts), plan.describe(), infos[0]["steps_per_epoch"],
                    ", ".join(f"{info['rank']}: {info['node_ip']}" for info in infos), time.perf_counter() - started)

    def wait(self) -> None:
        self.group.call("run", uuid.uuid4().hex[:12], self.sink)

    def preemption(self):
        return None if self.watcher is None else self.watcher.poll()

    def stop(self, graceful: bool) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.group is not None:
            self.group.shutdown(graceful=graceful)  # graceful: the process groups destroyed while every actor idles
            self.group = None


def _drain_watcher(group):
    """A watcher of Ray's draining nodes for the nodes ``group``'s placement group holds, or None where they
    cannot be read (a stand-in group): a failed attempt is then a preemption only where Ray marks its error."""
    try:
        nodes = set(ray.util.placement_group_table(group.pg)["bundles_to_node_id"].values())
    except Exception as exc:
        logger.debug("the stage actors' nodes are not known (%s): no drain watcher", exc)
        return None
    return DrainWatcher(nodes)


def run_pipeline(cfg: TrainConfig, plan: Optional[RunPlan], events) -> RunResult:
    """Train ``cfg`` with its pipeline strategy; resume from the newest checkpoint of ``{storage_path}/{name}``
    if there is one, restart after failures (``max_failures``). ``plan``: ``fit``'s (None: built here); ``events``:
    ``fit``'s ``RunEvents``."""
    plan = plan if plan is not None else build_plan(cfg)  # fit hands its plan down; direct callers get the same
    if plan.runner != "actor_group":
        raise ValueError(f"TrainConfig.strategy={cfg.strategy!r} is not a pipeline strategy; fit() runs it "
                         f"with Ray Train workers.")
    # The placement check of the stage actors (fit leaves it to this runner: the fix is in its terms)
    _check_resources(cfg, list(plan.bundles), plan.replicas)
    cluster.check_placeable(list(plan.bundles), cfg.use_gpu,
                            f"strategy={cfg.strategy!r} with {plan.replicas} replica(s) x num_stages={cfg.num_stages}",
                            labels=cfg.label_selector)
    return drive(ActorGroupCarrier(cfg, plan, events))
