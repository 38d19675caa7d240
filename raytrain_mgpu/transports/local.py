"""The in-process transport: a run of one worker trains in the driver's own process.

No Ray, no process group, no DDP wrapper: the engine (``engine/loop.py``) runs here with world size 1,
reports straight to the driver's ``RunEvents``, and publishes its checkpoints in the run folder
(``transports/base.FolderTransport``: the same files and names as every transport). It keeps everything
a run has: the run folder and its lock (``fit``'s), epoch and step checkpoints, resume, ``max_failures``
restarts from the last checkpoint (``transports/retry.py``), history, progress, loggers, callbacks,
validation, early stopping, ``keep_best``, a finished run answered from its folder, every precision, GPU
or CPU, and the strategies that train in one process (``ddp`` at world size 1, ``dp``, ``dp_balanced``,
``mp`` over the process's devices). Same seed, same data: it ends with the weights one Ray Train worker
ends with, bit for bit (tests/test_local_runner.py).

:func:`runner_for` decides where a run goes (``TrainConfig.runner``): ``"auto"`` trains in-process what
needs nothing only Ray provides, ``"local"`` insists (refused with the reason where it cannot),
``"ray"`` always starts Ray Train's worker group.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Optional, Tuple

import torch

from raytrain_mgpu.transports.base import FolderTransport

logger = logging.getLogger(__name__)

__all__ = ["runner_for", "local_refusal", "run_in_process", "data_parallel_steps"]


def local_refusal(cfg, plan) -> Optional[str]:
    """Why ``cfg`` cannot train in the driver's process (None: it can)."""
    from raytrain_mgpu.strategies import get_strategy
    from raytrain_mgpu.strategies.elastic import is_elastic

    if plan.runner != "train_workers":
        return f"strategy={cfg.strategy!r} runs its stages in an actor group of their own"
    if is_elastic(cfg) or plan.num_processes != 1:
        return f"num_workers={cfg.num_workers!r} asks for more than one worker process"
    if cfg.runner == "auto" and (cfg.address is not None or os.environ.get("RAY_ADDRESS")):
        return "a cluster address is set (address or RAY_ADDRESS): the run belongs on that cluster"
    if cfg.ingest == "ray_data" or isinstance(cfg.dataset, dict):
        return "Ray Data streams the training split (ingest='ray_data' or Ray Datasets)"
    if get_strategy(cfg.strategy).replication == "fully_shard":
        return f"strategy={cfg.strategy!r} shards over a process group, which one process without Ray does not have"
    if cfg.sync_batchnorm:
        return "sync_batchnorm=True needs a process group"
    return None


def runner_for(cfg, plan) -> str:
    """``"local"`` or ``"ray"`` for ``cfg`` (``TrainConfig.runner``); ValueError where ``local`` cannot be."""
    why = local_refusal(cfg, plan)
    if cfg.runner == "local" and why is not None:
        raise ValueError(f"TrainConfig.runner='local' cannot train this run in the driver's process: {why}. "
                         f"Set runner='auto' (or 'ray') to train it with Ray.")
    if cfg.runner == "ray" or why is not None:
        return "ray"
    return "local"


def data_parallel_steps(cfg, ctx, data):
    """The data-parallel step runner of ``cfg``'s strategy on the rank ``ctx`` describes."""
    from raytrain_mgpu.objectives import Objective
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.parallel.steps import DataParallelSteps
    from raytrain_mgpu.strategies import get_strategy

    strategy = build_worker(get_strategy(cfg.strategy), cfg.parallel, ctx, Objective.of(cfg, data.num_classes))
    step = None
    if cfg.train_step is not None:
        from raytrain_mgpu._factory import load_factory

        step = load_factory(cfg.train_step, "train_step")
    return DataParallelSteps(strategy, cfg.compile, step)


class _DriverReporter:
    """Rank 0's events, handed straight to the driver's ``RunEvents`` (no channel: the same process)."""

    def __init__(self, events):
        self.events = events
        self.first: Optional[dict] = None  # the first attempt's start-up times

    def step(self, step: int, total: int, epoch: int = 0) -> None:
        self.events.step(step, total, epoch)

    def scalars(self, step: int, values: dict) -> None:
        self.events.scalars(step, values)

    def epoch(self, row: dict) -> None:
        self.events.epoch(row)

    def checkpoint(self, path: str) -> None:
        self.events.checkpoint(path)

    def notice(self, line: str) -> None:
        self.events.banner(line)

    def startup(self, entered: float, first_step: float) -> None:
        if self.first is None:
            self.first = {"entered": entered, "first_step": first_step}

    def flush(self) -> None:
        """Nothing in flight: every event was handed on as it was called."""


class LocalTransport(FolderTransport):
    """The driver's process as the only rank: events to ``RunEvents``, checkpoints in the run folder."""

    def __init__(self, cfg, reporter: _DriverReporter):
        super().__init__(cfg, rank=0, attempt=uuid.uuid4().hex[:12], reporter=reporter)

    def reports_scalars(self, rank: int, steps) -> bool:
        return True

    def where(self) -> dict:
        return {"gpu_ids": [], "node_ip": "127.0.0.1"}


def _judge(exc: BaseException):
    """The one retry policy (``transports/retry.py``), told whether the failed attempt took a step."""
    from raytrain_mgpu.engine.liveness import POSITION
    from raytrain_mgpu.transports.retry import verdict

    return verdict(exc, stepped=POSITION.stepped)


def run_in_process(cfg, plan, events) -> Tuple[list, Optional[str], Optional[dict]]:
    """Train ``cfg`` (one worker) in this process; ``(history, last checkpoint, rank 0's start-up times)``."""
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine.devices import resolve_devices
    from raytrain_mgpu.engine.loop import Engine
    from raytrain_mgpu.driver.runlock import remove_stale_temporaries
    from raytrain_mgpu.engine.run_folder import RunFolder
    from raytrain_mgpu.strategies import WorkerContext, get_strategy
    from raytrain_mgpu.transports.retry import run_attempts

    reporter = _DriverReporter(events)
    folder = RunFolder.of(cfg)

    def attempt(_failures: int) -> list:
        entered = time.time()
        remove_stale_temporaries(folder)  # a killed attempt's (or driver's) half-written checkpoints
        assignment = resolve_devices(cfg.use_gpu, get_strategy(cfg.strategy).devices_per_worker(cfg))
        ctx = WorkerContext(0, 1, 0, 1, 0, assignment.compute, assignment)
        if assignment.compute[0].type == "cuda":
            torch.cuda.set_device(assignment.compute[0])
        data = build_datasets(cfg.data)
        engine = Engine(cfg, plan, data_parallel_steps(cfg, ctx, data), LocalTransport(cfg, reporter), data)
        engine.run(entered)
        return engine.state.history  # every epoch trained (one whose weights were not finite has no checkpoint)

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cpus_per_worker)  # what a worker of cpus_per_worker CPUs gets
    try:
        history = run_attempts(cfg, attempt, _judge, what="in-process attempt")
    finally:
        torch.set_num_threads(threads)
    return history, folder.state().checkpoint, reporter.first
