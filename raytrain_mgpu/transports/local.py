"""The in-process transport: a run of one worker trains in the driver's own process.

No Ray, no process group, no DDP wrapper: the engine (``engine/loop.py``) runs here with world size 1,
reports straight to the driver's ``RunEvents``, and publishes its checkpoints in the run folder
(``transports/base.FolderTransport``: the same files and names as every transport). It keeps everything
a run has: the run folder and its lock (``fit``'s), epoch and step checkpoints, resume, ``max_failures``
restarts from the last checkpoint (``transports/retry.py``), history, progress, loggers, callbacks,
validation, early stopping, ``keep_best``, a finished run answered from its folder, every precision, GPU
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

from raytrain_mgpu.transports.base import FolderTransport, RunResult, rank_devices, rank_engine

logger = logging.getLogger(__name__)

__all__ = ["run_in_process", "LocalTransport"]


class LocalTransport(FolderTransport):
    """The driver's process as the only rank: events to ``RunEvents``, checkpoints in the run folder."""

    def __init__(self, cfg, reporter):
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


def run_in_process(cfg, plan, events) -> RunResult:
    """Train ``cfg`` (one worker) in this process, retried by the one policy (``transports/retry.py``)."""
    from raytrain_mgpu.driver.progress import DirectSink, WorkerReporter
    from raytrain_mgpu.driver.runlock import remove_stale_temporaries
    from raytrain_mgpu.checkpointing.run_folder import RunFolder
    from raytrain_mgpu.strategies import WorkerContext, get_strategy
    from raytrain_mgpu.transports.retry import run_attempts

    ledger = getattr(events, "goodput", None)  # fit's goodput ledger (driver/goodput.py)
    sink = DirectSink(events, ledger)
    reporter = WorkerReporter(sink, min_interval_s=0)  # every step event: nothing to send, nothing to save
    folder = RunFolder.of(cfg)

    def attempt(_failures: int) -> list:
        entered = time.time()
        remove_stale_temporaries(folder)  # a killed attempt's (or driver's) half-written checkpoints
        assignment = rank_devices(cfg, get_strategy(cfg.strategy).devices_per_worker(cfg))
        ctx = WorkerContext(0, 1, 0, 1, 0, assignment.compute, assignment)
        engine = rank_engine(cfg, plan, ctx, LocalTransport(cfg, reporter))
        engine.run(entered)
        return engine.state.history  # every epoch trained (one whose weights were not finite has no checkpoint)

    threads = torch.get_num_threads()  # the driver's own, given back after (rank_devices sets cpus_per_worker)
    try:
        history = run_attempts(cfg, attempt, _judge, what="in-process attempt", ledger=ledger)
    finally:
        torch.set_num_threads(threads)
    return RunResult(history, folder.state().checkpoint, sink.startup)
