"""The stage actor group of one attempt: placement group, actors, SPMD calls, teardown.

Lifecycle: :meth:`StageGroup.start` reserves one bundle per actor in a placement group
(``cfg.placement``: PACK keeps stages on one node's fast links, SPREAD puts them on
different nodes) and starts the actors; :meth:`setup` forms the process group
(rendezvous at actor 0's address, found through Ray); :meth:`call` runs one method on
every actor at once; :meth:`shutdown` (always, from a ``finally``) kills the actors and
removes the placement group, also after a failure.
"""

from __future__ import annotations

import logging
from typing import List

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_mgpu.errors import PlacementTimeoutError
from raytrain_mgpu.driver.cluster import pending_message, worker_runtime_env
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data.ray_datasets import RayDataSplits, driver_shards
from raytrain_mgpu.models.partition import Partition
from raytrain_mgpu.transports.actor_group.stage import StageWorker
from raytrain_mgpu.strategies.plan import RunPlan

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


def wait_all(refs: list) -> list:
    """Results of every ref; the first failure is raised as soon as it happens.

    A stage that dies leaves its peers blocked in a receive: waiting for all refs would
    hang until the collective timeout, so the caller's ``finally`` must kill them.
    """
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)


class StageGroup:
    """``num_replicas x num_stages`` :class:`StageWorker` actors, rank = replica * stages + stage."""

    def __init__(self, cfg: TrainConfig, plan: RunPlan, worker_class=StageWorker):
        """``worker_class``: the actors' class (a benchmark's :class:`StageWorker` with methods of its own)."""
        self.cfg, self.plan, self.worker_class = cfg, plan, worker_class
        self.world_size = plan.num_processes  # stages x replicas
        self.actors: list = []
        self.pg = None

    def start(self) -> None:
        cfg = self.cfg
        bundles = list(self.plan.bundles)
        labels = {"bundle_label_selector": [dict(cfg.label_selector)] * len(bundles)} if cfg.label_selector else {}
        self.pg = placement_group(bundles, strategy=cfg.placement, **labels)
        try:
            ray.get(self.pg.ready(), timeout=cfg.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementTimeoutError(pending_message(
                bundles, f"strategy={cfg.strategy!r} with placement={cfg.placement!r}", cfg.placement_timeout_s)
                + (" A STRICT_ placement needs that many nodes: 'PACK' or 'SPREAD' need fewer."
                   if cfg.placement.startswith("STRICT") else "")) from None
        actor_class = ray.remote(self.worker_class)
        runtime_env = worker_runtime_env(*cfg.code_specs())  # the user's modules, the GPU-emulation switch
        custom = {k: v for k, v in self.plan.worker_resources.items() if k not in ("CPU", "GPU")}
        self.actors = [
            actor_class.options(
                num_cpus=cfg.cpus_per_worker, num_gpus=1 if cfg.use_gpu else 0, resources=custom,
                runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(cfg, rank, plan=self.plan)
            for rank in range(self.world_size)
        ]
        logger.debug("started %d stage actors", self.world_size)

    def profile(self) -> List[float]:
        """Per-block forward+backward seconds, measured by actor 0 on its device."""
        return ray.get(self.actors[0].profile_blocks.remote())

    def setup(self, partition: Partition) -> List[dict]:
        address, port = ray.get(self.actors[0].address.remote())
        self._give_data_shards()
        return self.call("setup", address, port, partition)

    def _give_data_shards(self) -> None:
        """A user's own Ray Datasets: each replica's actors get its share of a fresh equal split of ``train`` (the
        first stage reads it) and the evaluated splits whole. An attempt after a failure splits anew. (The
        ``parquet`` stream is made by each first stage itself: ``data/parquet_stream.py``.)"""
        if self.cfg.ingest != "ray_data" or not isinstance(self.cfg.dataset, RayDataSplits):
            return
        shards = driver_shards(self.cfg, self.plan.replicas)
        wait_all([actor.use_data_shard.remote(shards[rank // self.cfg.num_stages])
                  for rank, actor in enumerate(self.actors)])  # rank = replica * stages + stage

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every actor at once (SPMD); results in rank order."""
        return wait_all([getattr(actor, method).remote(*args) for actor in self.actors])

    def shutdown(self, graceful: bool = False) -> None:
        """Kill the actors and release their resources; safe to call more than once."""
        if graceful and self.actors:
            try:  # destroy the process groups cleanly when every actor is idle
                ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_TIMEOUT_S)
            except Exception as exc:  # teardown continues: the kill below frees everything
                logger.debug("stage actors did not close cleanly: %s", exc)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
