"""The in-process transport: a run of one worker trains in the driver's own process.

No Ray, no process group, no DDP wrapper: the engine (``engine/loop.py``) runs here with world size 1,
reports straight to the driver's ``RunEvents``, and publishes its checkpoints in the run folder
(``transports/base.FolderTransport``: the same files and names as every transport). It keeps everything
a run has: the run folder and its lock (``fit``'s), epoch and step checkpoints, resume, ``max_failures``
restarts from the last checkpoint (the attempt driver: ``transports/attempt.py``), history, progress, loggers,
callbacks, validation, early stopping, ``keep_best``, a finished run answered from its folder, every precision, GPU
or CPU, and the strategies that train in one process (``ddp`` at world size 1, ``dp``, ``dp_balanced``,
``mp`` over the process's devices). Same seed, same data: it ends with the weights one Ray Train worker
ends with, bit for bit (tests/test_loaders.py).

Which runs train here: ``transports/base.runner_for`` (``TrainConfig.runner``).
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.transports.attempt import Carrier, drive
from raytrain_mgpu.transports.base import FolderTransport, RunResult, rank_devices, rank_engine
from raytrain_mgpu.transports.retry import verdict

logger = logging.getLogger(__name__)

__all__ = ["run_in_process", "LocalTransport", "LocalCarrier"]


class LocalTransport(FolderTransport):
    """The driver's process as the only rank: events to ``RunEvents``, checkpoints in the run folder."""

    def __init__(self, cfg, reporter):
        super().__init__(cfg, rank=0, attempt=uuid.uuid4().hex[:12], reporter=reporter)

    def reports_scalars(self, rank: int, steps) -> bool:
        return True

    def where(self) -> dict:
        return {"gpu_ids": [], "node_ip": "127.0.0.1"}


class LocalCarrier(Carrier):
    """The driver's own process as the only rank: an attempt is one engine, built and run here; its events go
    straight to ``fit``'s ``RunEvents`` (``driver/progress.DirectSink``)."""

    what = "in-process attempt"
    in_process = True

    def __init__(self, cfg, plan, events):
        super().__init__(cfg, plan, events)
        self.threads = torch.get_num_threads()  # the driver's own, given back after (rank_devices sets cpus_per_worker)
        self.engine, self.entered = None, None

    def start(self, sink, attempt: int) -> None:
        cfg, self.entered = self.cfg, time.time()
        reporter = WorkerReporter(sink, min_interval_s=0)  # every step event: nothing to send, nothing to save
        assignment = rank_devices(cfg, get_strategy(cfg.strategy).devices_per_worker(cfg))
        ctx = WorkerContext(0, 1, 0, 1, 0, assignment.compute, assignment)
        self.engine = rank_engine(cfg, self.plan, ctx, LocalTransport(cfg, reporter))

    def wait(self) -> None:
        self.engine.run(self.entered)

    def stop(self, graceful: bool) -> None:
        self.engine = None
        torch.set_num_threads(self.threads)

    def judge(self, exc: BaseException):
        """The one retry policy, told whether the failed attempt took a step (here, where it was raised)."""
        return verdict(exc, stepped=POSITION.stepped)


def run_in_process(cfg, plan, events) -> RunResult:
    """Train ``cfg`` (one worker) in this process, its attempts driven by ``transports/attempt.drive``."""
    return drive(LocalCarrier(cfg, plan, events))
