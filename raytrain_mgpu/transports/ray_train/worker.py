"""The Ray Train transport's worker side: each ``TorchTrainer`` worker runs the engine (``engine/loop.py``); the
driver's side is ``driver.py``.

:func:`train_worker` is the train function ``fit`` hands Ray Train. On every worker it builds the
strategy's step runner and :class:`RayTrainTransport`, which carries rank 0's events to the driver
through the run's progress channel (``driver/progress.py``) and hands the engine its checkpoint store
(``store.RayTrainStore``: Ray Train's latest checkpoint to resume from, each checkpoint delivered with
``ray.train.report``, ``uploads.py``); Ray Train's controller tells the driver of each one registered
(``policy.CheckpointAnnouncer``). Ray Train's controller restarts the
group after a failure (``max_failures``) or a preemption (``max_preemption_failures``) from the latest registered
checkpoint.
"""

from __future__ import annotations

import os
import time
import uuid

import ray
import ray.train
import torch.distributed as dist

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.transports.collective_timeouts import name_stuck_ranks
from raytrain_mgpu.transports.retry import errors_whole
from raytrain_mgpu.driver.heartbeat import Heartbeat
from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.transports.base import Transport, rank_devices, rank_engine
from raytrain_mgpu.transports.preemption import ray_train_notices
from raytrain_mgpu.transports.ray_train.store import RayTrainStore
from raytrain_mgpu.transports.ray_train.replica_groups import run_replica_group

__all__ = ["train_worker", "RayTrainTransport"]


def _where(payload: dict) -> tuple:
    return ray.train.get_context().get_world_rank(), ray.util.get_node_ip_address()


@errors_whole(_where)
@name_stuck_ranks(lambda payload: payload["config"].collective_timeout_s)
def train_worker(payload: dict) -> dict:
    """Entry point of ``TorchTrainer``: ``payload`` = {"config": TrainConfig, "plan": RunPlan, "sink": channel}."""
    entered = time.time()  # the start-up's clock (fit's: TrainResult.startup)
    cfg: TrainConfig = payload["config"]
    if cfg.fault_tolerance == "replica_groups":  # each worker a torchft replica group of its own
        return run_replica_group(cfg, payload["plan"], payload.get("sink"), entered)
    ctx = _context(cfg)
    transport = RayTrainTransport(cfg, ctx, payload.get("sink"))
    return rank_engine(cfg, payload["plan"], ctx, transport).run(entered)


def _context(cfg: TrainConfig):
    """This worker's rank start (``transports/base.rank_devices``) and its ranks, as Ray Train numbers them."""
    ctx = ray.train.get_context()
    # GPUs: this worker's ray.get_gpu_ids() through CUDA_VISIBLE_DEVICES (as Ray Train's
    # get_devices); under emulation the same cuda:k are recorded and the CPU computes.
    assignment = rank_devices(cfg, get_strategy(cfg.strategy).devices_per_worker(cfg), ray.get_gpu_ids())
    return WorkerContext(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(),
                         ctx.get_local_world_size(), ctx.get_node_rank(), assignment.compute, assignment)


class RayTrainTransport(Transport):
    """One Ray Train worker's side of the run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, ctx, sink, sync_uploads: bool = False):
        """``sync_uploads``: every save uploads inside its report (``bench-checkpoint`` measures what that costs)."""
        self.cfg, self.ctx, self.rank, self.sync_uploads, self.sink = cfg, ctx, ctx.world_rank, sync_uploads, sink
        self.reporter = WorkerReporter(sink if self.rank == 0 else None)

    def reports_scalars(self, rank: int, steps) -> bool:
        return rank == 0 and self.reporter.sink is not None

    def start_heartbeat(self, rank: int, world_size: int) -> None:
        self.heartbeat = Heartbeat(self.sink, rank, world_size, _attempt_id, self.cfg.stall_timeout_s).start()

    def checkpoint_store(self) -> RayTrainStore:
        return RayTrainStore(self.cfg, self.rank, self.reporter, sync_uploads=self.sync_uploads)

    def where(self) -> dict:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def data_shard(self):
        return ray.train.get_dataset_shard("train")

    def preemption(self) -> dict:
        return ray_train_notices()  # Ray Train's watcher and get_preemption_info


def _attempt_id() -> str:
    """An id every worker of this worker group shares (its heartbeats' group): rank 0 writes a fresh one into the
    group's c10d store, which Ray Train makes anew for every group; the others read it (called in the heartbeat
    thread: the wait for rank 0 keeps no step waiting)."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(_ATTEMPT_KEY, uuid.uuid4().hex)
    return store.get(_ATTEMPT_KEY).decode()


_ATTEMPT_KEY = "raytrain_mgpu/attempt"
