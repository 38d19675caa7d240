"""The Ray Train transport's worker side: each ``TorchTrainer`` worker runs the engine (``engine/loop.py``); the
driver's side is ``driver.py``.

:func:`train_worker` is the train function ``fit`` hands Ray Train. On every worker it builds the
strategy's step runner and :class:`RayTrainTransport`, which carries rank 0's events to the driver
through the run's progress channel (``driver/progress.py``), hands the checkpoint manager Ray Train's latest
checkpoint, and delivers each checkpoint with ``ray.train.report`` (``transports/ray_train/uploads.py``:
asynchronous uploads reported before their write, a sharded run's every-rank folders); Ray Train's controller
tells the driver of each one registered (``policy.CheckpointAnnouncer``). Ray Train's controller restarts the
group after a failure (``max_failures``) or a preemption (``max_preemption_failures``) from the latest registered
checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from typing import Optional

import ray
import ray.train
from ray.train import CheckpointUploadMode

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing.contents import seal
from raytrain_mgpu.transports.collective_timeouts import name_stuck_ranks
from raytrain_mgpu.transports.ray_train.faults import wait_until_report_collected
from raytrain_mgpu.transports.retry import errors_whole
from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.checkpointing.manager import CheckpointSource
from raytrain_mgpu.transports.base import Transport, rank_devices, rank_engine
from raytrain_mgpu.transports.ray_train.uploads import clean, report, wait_for_previous

__all__ = ["train_worker", "RayTrainTransport"]


def _where(payload: dict) -> tuple:
    return ray.train.get_context().get_world_rank(), ray.util.get_node_ip_address()


@errors_whole(_where)
@name_stuck_ranks(lambda payload: payload["config"].collective_timeout_s)
def train_worker(payload: dict) -> dict:
    """Entry point of ``TorchTrainer``: ``payload`` = {"config": TrainConfig, "plan": RunPlan, "sink": channel}."""
    entered = time.time()  # the start-up's clock (fit's: TrainResult.startup)
    cfg: TrainConfig = payload["config"]
    ctx = _context(cfg)
    transport = RayTrainTransport(cfg, ctx, payload.get("sink"))
    return rank_engine(cfg, payload["plan"], ctx, transport).run(entered)


def _context(cfg: TrainConfig):
    """This worker's rank start (``transports/base.rank_devices``) and its ranks, as Ray Train numbers them."""
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

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
        self.last: Optional[str] = None  # the checkpoint this rank reported last (uploads.wait_for_previous)
        self._save: Optional[dict] = None  # the save between begin and commit

    def reports_scalars(self, rank: int, steps) -> bool:
        return rank == 0 and self.reporter.sink is not None

    def start_heartbeat(self, rank: int, world_size: int) -> None:
        from raytrain_mgpu.driver.heartbeat import Heartbeat

        self.heartbeat = Heartbeat(self.sink, rank, world_size, _attempt_id, self.cfg.stall_timeout_s).start()

    def registered(self) -> Optional[CheckpointSource]:
        latest = ray.train.get_checkpoint()  # read through Ray Train's storage where the manager resumes from it
        return None if latest is None else CheckpointSource(latest.path, latest.as_directory)

    def where(self) -> dict:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def data_shard(self):
        return ray.train.get_dataset_shard("train")

    def preemption(self) -> dict:
        from raytrain_mgpu.transports.preemption import ray_train_notices

        return ray_train_notices()  # Ray Train's watcher and get_preemption_info

    def asynchronous(self, step: bool, final: bool) -> bool:
        return not (final or self.sync_uploads)  # the run's last save uploads synchronously: nothing is left to overlap

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> Optional[str]:
        upload = CheckpointUploadMode.ASYNC if self.asynchronous(step, final) else CheckpointUploadMode.SYNC
        save = self._save = {"upload": upload, "files": self.rank == 0 or sharded, "directory": None, "writing": None}
        if not save["files"]:  # reported now, without a checkpoint: Ray Train's report is a barrier (uploads.py)
            ray.train.report(clean(metrics), checkpoint=None)
            return None
        wait_for_previous(self.last)  # one upload in flight at most; a failure resumes from it
        self.last = name
        save["directory"] = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")  # Ray Train deletes it after upload
        if upload == CheckpointUploadMode.ASYNC:  # reported before the write, its upload waiting for commit
            save["writing"] = Future()
            try:
                report(metrics, save["directory"], name, upload, save["writing"])
            except BaseException:
                self.abort(None)
                raise
        return save["directory"]

    def commit(self, commit) -> None:
        save, self._save = self._save, None
        if save["files"]:
            try:
                if self.rank == 0:
                    seal(save["directory"], commit.meta)  # meta.json last: Ray Train uploads a complete folder
                    if commit.is_best:
                        # Ray Train prunes by age (its score order would keep the N best, not the last N): a new
                        # best's model is copied aside, one more model write per improvement.
                        RunFolder.of(self.cfg).save_best(save["directory"], commit.best_model)
                    if self.reporter is not None:  # the epoch's row in the driver's mailbox before the announcement
                        self.reporter.flush()
                if save["writing"] is not None:
                    save["writing"].set_result(commit.writing)  # Ray Train's upload thread copies it from here
                    return
                report(commit.metrics, save["directory"], commit.name, save["upload"], commit.writing)
            except BaseException as exc:
                self._save = save
                self.abort(exc)
                raise
        # Held until the controller took the report: a failure after it keeps the checkpoint (faults.py).
        wait_until_report_collected()

    def abort(self, exc: Optional[BaseException]) -> None:
        save, self._save = self._save, None
        if not save:
            return
        if save["writing"] is not None and not save["writing"].done():
            # reported already: its upload fails with the write, before it reads the folder
            save["writing"].set_exception(exc or RuntimeError("the checkpoint was not written"))
        if save["directory"] is not None:
            shutil.rmtree(save["directory"], ignore_errors=True)


def _attempt_id() -> str:
    """An id every worker of this worker group shares (its heartbeats' group): rank 0 writes a fresh one into the
    group's c10d store, which Ray Train makes anew for every group; the others read it (called in the heartbeat
    thread: the wait for rank 0 keeps no step waiting)."""
    import uuid

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(_ATTEMPT_KEY, uuid.uuid4().hex)
    return store.get(_ATTEMPT_KEY).decode()


_ATTEMPT_KEY = "raytrain_mgpu/attempt"
