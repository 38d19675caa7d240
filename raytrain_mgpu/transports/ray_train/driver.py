"""The Ray Train transport's driver side: ``fit``'s worker group (:func:`run_train_workers`: its carrier, the rest of
the attempt is ``transports/attempt.py``'s), Ray Train's trainer with the one retry policy in its controller
(:func:`torch_trainer_class`), its run config, and the failure ``fit`` raises (:func:`_whole`). Each worker runs
``worker.train_worker``."""

from __future__ import annotations

import os

import ray
import ray.train
import ray.train.torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.driver.callbacks import stop_main_thread_on_failure
from raytrain_mgpu.driver.cluster import pending_message
from raytrain_mgpu.driver.cluster import worker_runtime_env as _worker_runtime_env
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.engine import devices
from raytrain_mgpu.transports import ray_data as ray_ingest
from raytrain_mgpu.transports.attempt import Carrier, drive
from raytrain_mgpu.transports.base import RunResult
from raytrain_mgpu.transports.preemption import watcher_where_notices_come
from raytrain_mgpu.transports.retry import whole_failure
from raytrain_mgpu.transports.ray_train.faults import START_TIMEOUT_ENV, controller_poll
from raytrain_mgpu.transports.ray_train.policy import CheckpointAnnouncer, OneRetryPolicy
from raytrain_mgpu.transports.ray_train.worker import train_worker
from raytrain_mgpu.transports.ray_train.replica_groups import backend_config

__all__ = ["run_train_workers", "RayTrainCarrier", "run_config", "torch_trainer_class", "start_timeout_s"]


def start_timeout_s() -> float:
    """How long each of Ray Train's waits for a worker group's resources lasts (its environment variable, as the
    controller reads it)."""
    try:
        return float(os.environ.get(START_TIMEOUT_ENV, 60.0))
    except ValueError:
        return 60.0


def torch_trainer_class():
    """Ray Train's ``TorchTrainer`` with two changes: the one retry policy (``transports/ray_train/policy.py``) in its
    controller, and no Ray Data actor for a run without ``datasets=``.

    Ray Train 2.60 starts a ``DatasetManager`` actor for every run (its ``DatasetsCallback``), a
    process of its own that imports Ray Data, datasets or not; only a worker's
    ``get_dataset_shard`` asks it for anything, which ``ingest="loader"`` (the default) never calls.
    Measured on the 2-core VM (a 2-worker MLP fit on digits, 3 fits each way, on one Ray): 13.2-13.4 s
    and 18.6-18.8 CPU-s per fit with it, 11.0-11.3 s and 15.2-16.1 CPU-s without. With datasets
    (``ingest="ray_data"``) the callback stays. A Ray Train without these hooks gets its own trainer.
    Tested both ways by counting the actors (tests/test_fit.py, tests/test_ray_ingest.py)."""
    TorchTrainer = ray.train.torch.TorchTrainer  # read when called: tests replace it
    try:
        # late: a private module of Ray Train's, guarded: another Ray Train may not have it
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


def run_train_workers(cfg: TrainConfig, plan, events) -> RunResult:
    """On the driver: Ray Train's worker group for ``cfg`` (every worker runs :func:`train_worker`), its attempt
    driven by ``transports/attempt.drive``. ``events``: ``fit``'s ``RunEvents``, fed by the progress channel."""
    return drive(RayTrainCarrier(cfg, plan, events))


class RayTrainCarrier(Carrier):
    """Ray Train's worker group: ``trainer.fit()`` is the attempt's start and wait, and its controller restarts
    the group by the one retry policy (:func:`torch_trainer_class`); its last checkpoint is Ray Train's latest."""

    retries_itself = True
    late_announcements = True  # the controller announces the last checkpoint, not ordered with the run's end

    def start(self, sink, attempt: int) -> None:
        _start_autoscaling_coordinator()
        self.trainer, self.result = _trainer(self.cfg, self.plan, sink), None

    def wait(self) -> None:
        # controller_poll: a report waits for the controller's next poll, 2 s apart by default (faults.py), and
        # each wait for the worker group's resources lasts Ray's 60 s (less, for a shorter placement_timeout_s);
        # no preemption watcher on a Ray this process started (transports/preemption.py)
        with stop_main_thread_on_failure(self.events), controller_poll(min(self.cfg.placement_timeout_s, 60.0)), \
                watcher_where_notices_come():
            self.result = self.trainer.fit()  # a callback's failure aborts the run (stop_main_thread_on_failure)

    def latest(self):
        checkpoint = getattr(self.result, "checkpoint", None)
        return None if checkpoint is None else checkpoint.path

    def whole(self, exc: BaseException) -> BaseException:
        if isinstance(exc, ray.train.TrainingFailedError):
            return _whole(self.cfg, exc, self.plan)
        return super().whole(exc)


def _trainer(cfg: TrainConfig, plan, sink):
    """Ray Train's trainer of ``cfg``, its rank 0 reporting to ``sink`` (the run's progress channel)."""
    trainer = torch_trainer_class()(
        train_worker,
        train_loop_config={"config": cfg, "plan": plan, "sink": sink},
        # nccl on GPUs; gloo on CPU and under GPU emulation (which records nccl as intended)
        torch_config=backend_config(cfg, devices.backend(cfg.use_gpu)),  # TorchftConfig for replica groups
        # Elastic (min, max): Ray Train starts with what the cluster has room for and restarts the group from
        # the latest checkpoint when that changes (checked every elastic_resize_interval_s while it trains).
        scaling_config=ScalingConfig(num_workers=(plan.min_workers, plan.num_processes) if plan.min_workers
                                     else plan.num_processes, use_gpu=cfg.use_gpu,
                                     resources_per_worker=plan.worker_resources, placement_strategy=cfg.placement,
                                     label_selector=dict(cfg.label_selector) or None,
                                     elastic_resize_monitor_interval_s=cfg.elastic_resize_interval_s),
        run_config=run_config(cfg, sink),
        # ingest="ray_data": datasets= and dataset_config= (equal split); Ray Data needs CPUs the workers leave
        **ray_ingest.trainer_datasets(cfg),
    )
    trainer.placement_timeout_s = cfg.placement_timeout_s
    return trainer


def _start_autoscaling_coordinator() -> None:
    """Ray Train's controller starts by creating (get-or-create, by name, on the driver's node) the cluster's
    autoscaling coordinator actor and waits for it: a new process, spawned after the controller's own, ~0.9 s
    of every run's start on 2 cores. Created here first (asynchronously: this returns at once), it takes an
    idle pre-started Ray worker while the controller starts, which then finds it ready. Measured with
    ``raytrain-mgpu bench-startup``; Ray's own function (an internal module, hence the guard), so the actor
    is the one Ray Train would create."""
    try:
        # late: a private module of Ray Data's, guarded (another Ray may not have it); tests replace its function
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:  # another Ray version: the controller creates it, as without this
        return
    get_or_create_autoscaling_coordinator()


def run_config(cfg: TrainConfig, sink=None):
    """Ray Train's ``RunConfig`` of ``cfg``: where, how many checkpoints, which failures to retry; the driver told
    of each checkpoint through ``sink`` (the run's progress channel)."""
    return RunConfig(
        name=cfg.name, storage_path=cfg.storage_path,
        # The last N by age, no checkpoint_score_attribute: with one, num_to_keep keeps the N
        # best (and the latest). keep_best's best is copied aside by the loop (RunFolder.save_best).
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
        # A preemption (a node drained with reason preemption) counts apart from max_failures.
        failure_config=FailureConfig(max_failures=cfg.max_failures,
                                     max_preemption_failures=cfg.max_preemption_failures,
                                     preemption_grace_s=cfg.preemption_grace_s),
        worker_runtime_env=_worker_runtime_env(*cfg.code_specs()),
        callbacks=[] if sink is None else [CheckpointAnnouncer(sink, RunFolder.of(cfg).scheme)])


def _whole(cfg: TrainConfig, error, plan) -> BaseException:
    """``retry.whole_failure`` of Ray Train's ``TrainingFailedError``: its workers' failures, or its controller's
    (a worker group whose resources were never granted: what is pending, and the fix)."""
    controller = getattr(error, "controller_failure", None)
    placement = (pending_message(list(plan.bundles), f"strategy={cfg.strategy!r}", cfg.placement_timeout_s)
                 if type(controller).__name__ == "WorkerGroupStartupTimeoutError" else None)
    return whole_failure(cfg, controller if isinstance(controller, BaseException) else error,
                         getattr(error, "worker_failures", None), placement=placement)
