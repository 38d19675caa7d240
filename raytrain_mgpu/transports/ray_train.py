"""The Ray Train transport: each ``TorchTrainer`` worker runs the engine (``runtime/engine.py``).

:func:`train_worker` is the train function ``fit`` hands Ray Train. On every worker it builds the
strategy's step runner and :class:`RayTrainTransport`, which carries rank 0's events to the driver
through the run's progress channel (``runtime/progress.py``), resumes from Ray Train's latest
checkpoint, and delivers each checkpoint with ``ray.train.report`` (``transports/ray_uploads.py``:
rank 0's asynchronous upload, a sharded run's every-rank folders, a step checkpoint reported before its
write). Ray Train's controller restarts the group after a failure (``max_failures``) or a preemption
(``max_preemption_failures``) from the latest registered checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional

import ray
import ray.train
import torch
from ray.train import CheckpointUploadMode

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.devices import resolve_devices
from raytrain_mgpu.runtime.faults import name_stuck_ranks, wait_until_report_collected
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.cluster import worker_runtime_env as _worker_runtime_env
from raytrain_mgpu.runtime.transport import CheckpointSource, Transport
from raytrain_mgpu.transports.ray_uploads import Uploads, clean, report, save_best, wait_for_previous

__all__ = ["train_worker", "RayTrainTransport", "run_train_workers", "run_config", "torch_trainer_class"]


def errors_whole(train_fn):
    """Decorate a Ray Train worker function: its exception leaves the worker whole (``transports/retry.sent_whole``:
    noted with the rank and node, the retry policy's verdict on it, a stand-in where it would not unpickle)."""
    import functools

    @functools.wraps(train_fn)
    def wrapper(payload: dict):
        try:
            return train_fn(payload)
        except Exception as exc:
            from raytrain_mgpu.transports.retry import sent_whole

            sent = sent_whole(exc, ray.train.get_context().get_world_rank(), ray.util.get_node_ip_address(),
                              os.getpid())
            if sent is exc:
                raise
            raise sent from None

    return wrapper


@errors_whole
@name_stuck_ranks
def train_worker(payload: dict) -> dict:
    """Entry point of ``TorchTrainer``: ``payload`` = {"config": TrainConfig, "plan": RunPlan, "sink": channel}."""
    entered = time.time()  # the start-up's clock (fit's: TrainResult.startup)
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.runtime.engine import Engine
    from raytrain_mgpu.transports.local import data_parallel_steps

    cfg: TrainConfig = payload["config"]
    torch.set_num_threads(cfg.cpus_per_worker)
    ctx = _context(cfg)
    data = build_datasets(cfg.data)
    steps = data_parallel_steps(cfg, ctx, data)
    transport = RayTrainTransport(cfg, ctx, payload.get("sink"))
    return Engine(cfg, payload["plan"], steps, transport, data).run(entered)


def _context(cfg: TrainConfig):
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    ctx = ray.train.get_context()
    # GPUs: this worker's ray.get_gpu_ids() through CUDA_VISIBLE_DEVICES (as Ray Train's
    # get_devices); under emulation the same cuda:k are recorded and the CPU computes.
    assignment = resolve_devices(cfg.use_gpu, get_strategy(cfg.strategy).devices_per_worker(cfg))
    return WorkerContext(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(),
                         ctx.get_local_world_size(), ctx.get_node_rank(), assignment.compute, assignment)


class RayTrainTransport(Transport):
    """One Ray Train worker's side of the run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, ctx, sink, sync_uploads: bool = False):
        """``sync_uploads``: every save uploads inside its report (``bench-checkpoint`` measures what that costs)."""
        self.cfg, self.ctx, self.rank, self.sync_uploads, self.sink = cfg, ctx, ctx.world_rank, sync_uploads, sink
        self.reporter = WorkerReporter(sink if self.rank == 0 else None)
        self.uploads = Uploads.current()
        self._save: Optional[dict] = None  # the save between begin and commit

    def reports_scalars(self, rank: int, steps) -> bool:
        return rank == 0 and self.reporter.sink is not None

    def start_heartbeat(self, rank: int, world_size: int) -> None:
        from raytrain_mgpu.runtime.heartbeat import Heartbeat

        self.heartbeat = Heartbeat(self.sink, rank, world_size, _attempt_id, self.cfg.stall_timeout_s).start()

    def checkpoint(self) -> Optional[CheckpointSource]:
        """Ray Train's latest, unless the run folder holds a newer checkpoint published by another
        transport (a run trained in the driver's process before, resumed here)."""
        latest = ray.train.get_checkpoint()
        newer = RunFolder.of(self.cfg).newest_published(after=latest.path if latest is not None else None)
        if newer is not None:
            folder = RunFolder.of(self.cfg)
            return CheckpointSource(newer.uri, lambda: folder.readable(newer.path))
        if latest is None:
            return None
        return CheckpointSource(latest.path, latest.as_directory)

    def where(self) -> dict:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def data_shard(self):
        return ray.train.get_dataset_shard("train")

    def preemption(self) -> dict:
        return {}  # Ray Train's watcher and get_preemption_info (runtime/preemption.py)

    def asynchronous(self, step: bool, final: bool) -> bool:
        return not (final or self.sync_uploads)  # the run's last save uploads synchronously: nothing is left to overlap

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> Optional[str]:
        upload = CheckpointUploadMode.ASYNC if self.asynchronous(step, final) else CheckpointUploadMode.SYNC
        # A step checkpoint uploaded in the background is reported before it is written (ray_uploads.py).
        first = step and not sharded and upload == CheckpointUploadMode.ASYNC
        save = self._save = {"upload": upload, "first": first, "sharded": sharded, "directory": None,
                             "writing": None, "index": None}
        if self.rank != 0 and not sharded:  # no files: reported without a checkpoint (at commit, or now)
            if first:
                ray.train.report(clean(metrics), checkpoint=None)
            return None
        if not first:
            wait_for_previous(self.uploads)  # one upload in flight at most; a failure resumes from it
        save["directory"] = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")  # Ray Train deletes it after upload
        if first:  # rank 0: the empty folder reported with a future its upload waits for
            from concurrent.futures import Future

            wait_for_previous(self.uploads)
            save["writing"] = Future()
            try:
                save["index"] = report(metrics, save["directory"], name, upload, self.uploads, save["writing"])
            except BaseException:
                self.abort(None)
                raise
        return save["directory"]

    def commit(self, commit) -> None:
        save, self._save = self._save, None
        upload, directory = save["upload"], save["directory"]
        if self.rank != 0 and not save["sharded"]:
            if not save["first"]:
                ray.train.report(clean(commit.metrics), checkpoint=None)
            wait_until_report_collected()  # held until the controller took it: a failure after keeps rank 0's
            return
        if self.rank != 0:  # a sharded checkpoint's other ranks: their shards, under rank 0's name
            try:
                report(commit.metrics, directory, commit.name, upload, self.uploads, commit.writing)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            if upload == CheckpointUploadMode.SYNC:
                wait_until_report_collected()
            return
        try:
            ckpt_format.write_checkpoint(directory, meta=commit.meta, history=None)
            if commit.is_best:
                # Ray Train prunes by age (its score order would keep the N best, not the last N): a new best's
                # model is copied aside, one more model write per improvement.
                save_best(self.cfg, directory, commit.best_model)
            if save["first"]:
                save["writing"].set_result(None)  # complete: Ray Train's upload thread copies it from here
                index = save["index"]
            else:
                index = report(commit.metrics, directory, commit.name, upload, self.uploads, commit.writing)
        except BaseException as exc:
            save["directory"] = directory
            self._save = save
            self.abort(exc)
            raise
        if upload == CheckpointUploadMode.ASYNC:
            self.uploads.announce_when_persisted(index, RunFolder.of(self.cfg), self.reporter)
            return
        # Synchronous: uploaded when report returns. A rank 0 that died before the controller took the report
        # would drop the checkpoint although it is uploaded: wait up to one poll.
        wait_until_report_collected()
        self.uploads.flush()  # the asynchronous ones before it, announced in order
        persisted = ray.train.get_checkpoint()  # the latest reported: this one, in the storage filesystem
        if persisted is not None:
            self.reporter.checkpoint(RunFolder.of(self.cfg).uri_of(persisted.path))

    def abort(self, exc: Optional[BaseException]) -> None:
        save, self._save = self._save, None
        if not save:
            return
        if save["writing"] is not None and save["first"] and not save["writing"].done():
            # reported already: its upload fails with the write, before it reads the folder
            save["writing"].set_exception(exc or RuntimeError("the checkpoint was not written"))
        if save["directory"] is not None:
            shutil.rmtree(save["directory"], ignore_errors=True)


def start_timeout_s() -> float:
    """How long each of Ray Train's waits for a worker group's resources lasts (its environment variable, as the
    controller reads it)."""
    from raytrain_mgpu.runtime.faults import START_TIMEOUT_ENV

    try:
        return float(os.environ.get(START_TIMEOUT_ENV, 60.0))
    except ValueError:
        return 60.0


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


# ----------------------------------------------------------------------------- the driver's side


def torch_trainer_class():
    """Ray Train's ``TorchTrainer`` with two changes: the one retry policy (``transports/ray_train_policy.py``) in its
    controller, and no Ray Data actor for a run without ``datasets=``.

    Ray Train 2.60 starts a ``DatasetManager`` actor for every run (its ``DatasetsCallback``), a
    process of its own that imports Ray Data, datasets or not; only a worker's
    ``get_dataset_shard`` asks it for anything, which ``ingest="loader"`` (the default) never calls.
    Measured on the 2-core VM (a 2-worker MLP fit on digits, 3 fits each way, on one Ray): 13.2-13.4 s
    and 18.6-18.8 CPU-s per fit with it, 11.0-11.3 s and 15.2-16.1 CPU-s without. With datasets
    (``ingest="ray_data"``) the callback stays. A Ray Train without these hooks gets its own trainer.
    Tested both ways by counting the actors (tests/test_fit.py, tests/test_ray_ingest.py)."""
    from ray.train.torch import TorchTrainer

    from raytrain_mgpu.transports.ray_train_policy import OneRetryPolicy

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:  # another Ray Train: its own trainer, unchanged
        return TorchTrainer
    if not all(hasattr(TorchTrainer, hook) for hook in ("_create_default_callbacks", "_initialize_and_run_controller")):
        return TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            return callbacks if self.datasets else [c for c in callbacks if not isinstance(c, DatasetsCallback)]

        placement_timeout_s = None  # fit's TrainConfig.placement_timeout_s: the policy's bound on the waits

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if OneRetryPolicy is not None and "failure_policy" in controller_init_kwargs:
                controller_init_kwargs["failure_policy"] = OneRetryPolicy(
                    self.run_config.failure_config, self.placement_timeout_s, start_timeout_s())
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return Trainer


def run_train_workers(cfg: TrainConfig, plan, events):
    """On the driver: Ray Train's worker group for ``cfg`` (every worker runs :func:`train_worker`); ``(history, the
    last checkpoint, rank 0's start-up times)``. ``events``: ``fit``'s ``RunEvents``, fed by the progress channel."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig

    from raytrain_mgpu.runtime import devices, ray_ingest
    from raytrain_mgpu.runtime.callbacks import stop_main_thread_on_failure
    from raytrain_mgpu.runtime.faults import controller_poll
    from raytrain_mgpu.runtime.preemption import watcher_where_notices_come
    from raytrain_mgpu.runtime.progress import ProgressSink, SinkPump

    RunFolder.of(cfg).remove_temporaries()  # e.g. a best-checkpoint copy a killed rank 0 left half-written
    _start_autoscaling_coordinator()
    sink = ProgressSink.open()
    trainer = torch_trainer_class()(
        train_worker,
        train_loop_config={"config": cfg, "plan": plan, "sink": sink},
        # nccl on GPUs; gloo on CPU and under GPU emulation (which records nccl as intended)
        torch_config=TorchConfig(backend=devices.backend(cfg.use_gpu), timeout_s=int(cfg.collective_timeout_s)),
        # Elastic (min, max): Ray Train starts with what the cluster has room for and restarts the group from
        # the latest checkpoint when that changes (checked every elastic_resize_interval_s while it trains).
        scaling_config=ScalingConfig(num_workers=(plan.min_workers, plan.num_processes) if plan.min_workers
                                     else plan.num_processes, use_gpu=cfg.use_gpu,
                                     resources_per_worker=plan.worker_resources, placement_strategy=cfg.placement,
                                     label_selector=dict(cfg.label_selector) or None,
                                     elastic_resize_monitor_interval_s=cfg.elastic_resize_interval_s),
        run_config=run_config(cfg),
        # ingest="ray_data": datasets= and dataset_config= (equal split); Ray Data needs CPUs the workers leave
        **ray_ingest.trainer_datasets(cfg),
    )
    trainer.placement_timeout_s = cfg.placement_timeout_s
    pump = SinkPump(sink, events, stall_timeout_s=cfg.stall_timeout_s)  # every rank's heartbeats judged
    try:
        # controller_poll: a report waits for the controller's next poll, 2 s apart by default (runtime/faults.py),
        # and each wait for the worker group's resources lasts Ray's 60 s (less, for a shorter placement_timeout_s);
        # no preemption watcher on a Ray this process started (runtime/preemption.py)
        with stop_main_thread_on_failure(events), pump, controller_poll(min(cfg.placement_timeout_s, 60.0)), \
                watcher_where_notices_come():
            result = trainer.fit()  # a callback's failure aborts the run (stop_main_thread_on_failure)
    except BaseException as exc:
        if pump.failure is not None:  # the run was stopped for it: the callback's error, named
            raise pump.failure
        if isinstance(exc, ray.train.TrainingFailedError):
            raise whole_failure(cfg, exc, pump.stall, plan) from exc
        raise
    finally:
        sink.close()
    if pump.failure is not None:  # on the last events, after the run ended
        raise pump.failure
    if result.checkpoint is None:
        return [], None, pump.startup
    folder = RunFolder.of(cfg)  # history.json only: the model files stay where they are
    return folder.checkpoint_history(result.checkpoint.path), folder.uri_of(result.checkpoint.path), pump.startup


def _start_autoscaling_coordinator() -> None:
    """Ray Train's controller starts by creating (get-or-create, by name, on the driver's node) the cluster's
    autoscaling coordinator actor and waits for it: a new process, spawned after the controller's own, ~0.9 s
    of every run's start on 2 cores. Created here first (asynchronously: this returns at once), it takes an
    idle pre-started Ray worker while the controller starts, which then finds it ready. Measured with
    ``raytrain-mgpu bench-startup``; Ray's own function (an internal module, hence the guard), so the actor
    is the one Ray Train would create."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:  # another Ray version: the controller creates it, as without this
        return
    get_or_create_autoscaling_coordinator()


def run_config(cfg: TrainConfig):
    """Ray Train's ``RunConfig`` of ``cfg``: where, how many checkpoints, which failures to retry."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(
        name=cfg.name, storage_path=cfg.storage_path,
        # The last N by age, no checkpoint_score_attribute: with one, num_to_keep keeps the N
        # best (and the latest). keep_best's best is copied aside by the loop (RunFolder.save_best).
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
        # A preemption (a node drained with reason preemption) counts apart from max_failures.
        failure_config=FailureConfig(max_failures=cfg.max_failures,
                                     max_preemption_failures=cfg.max_preemption_failures,
                                     preemption_grace_s=cfg.preemption_grace_s),
        worker_runtime_env=_worker_runtime_env(*cfg.code_specs()))


def whole_failure(cfg: TrainConfig, error: Exception, stall=None, plan=None) -> BaseException:
    """What ``fit`` raises for Ray Train's ``TrainingFailedError``: the failure that caused it, whole (the type the
    worker raised, its message, a note with the worker's traceback and where it ran; ``retry.root_cause`` of
    several ranks'), a :class:`~raytrain_mgpu.errors.StuckRankError` for ranks the driver found stuck, or a
    :class:`~raytrain_mgpu.errors.PlacementTimeoutError` for resources never granted; noted with where the run's
    checkpoints are."""
    from raytrain_mgpu.errors import PlacementTimeoutError, StuckRankError, WorkerError, add_note, worker_note
    from raytrain_mgpu.runtime.cluster import pending_message
    from raytrain_mgpu.transports.retry import root_cause, unwrap

    failures = getattr(error, "worker_failures", None) or {}
    controller = getattr(error, "controller_failure", None)
    if stall is not None:
        exc = StuckRankError(stall.line, stall.ranks, stall.report)
    elif type(controller).__name__ == "WorkerGroupStartupTimeoutError" and plan is not None:
        exc = PlacementTimeoutError(pending_message(list(plan.bundles), f"strategy={cfg.strategy!r}",
                                                    cfg.placement_timeout_s))
    elif failures:
        rank, exc = root_cause(failures)
        traceback_text = getattr(failures[rank], "_traceback_str", None)
        if worker_note(exc) is None and not isinstance(exc, WorkerError):  # a WorkerError says where itself
            add_note(exc, f"raised on rank {rank}")
        if traceback_text and not getattr(exc, "traceback_text", None):
            add_note(exc, f"The worker's traceback (rank {rank}):\n{traceback_text.rstrip()}")
    else:
        exc = unwrap(controller if isinstance(controller, BaseException) else error)
    add_note(exc, _failure_note(cfg))
    return exc


def _failure_note(cfg: TrainConfig) -> str:
    from raytrain_mgpu._redact import redact

    return (f"training run {cfg.name!r} failed. Checkpoints written so far are kept in "
            f"{redact(RunFolder.of(cfg).uri)}; run again with the same name and storage_path to resume.")
