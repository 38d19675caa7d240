"""Run pipeline stages as local processes, without Ray: the tests' harness (not part of the package).

The stage code is the same :class:`~raytrain_mgpu.transports.actor_group.stage.StageWorker` the Ray
actors run. Several runs share one pool of processes (started once, each run using as
many of them as it has ranks), forked from a server that has torch imported
(tests/_forkserver.py), because starting a process that imports torch costs seconds on a
small machine.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import queue as queue_module
import signal
import tempfile
import threading
import time
import traceback
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

import _forkserver
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.models.partition import Partition
from raytrain_mgpu.pipeline.plan import choose_partition
from raytrain_mgpu.transports.actor_group import stage as stage_worker
from raytrain_mgpu.engine import loop as engine
from raytrain_mgpu.transports.actor_group.stage import StageWorker
from raytrain_mgpu.strategies.plan import build_plan
from raytrain_mgpu.transports.placement import free_address

__all__ = ["LocalRun", "LocalResult", "run_local"]


class LocalRun(NamedTuple):
    cfg: TrainConfig
    num_steps: int
    emulate_nccl: Optional[bool] = None  # NCCL's semantics on gloo; None: on when emulating GPUs
    skip_warmup: bool = False            # tests only: reproduces the start-up deadlock on NCCL
    step_event: Optional[Callable[[int], None]] = None  # joins engine/loop.STEP_EVENTS in each rank's process
    storage: Optional[str] = None  # the run folder's storage_path (default: a new temporary folder per run)
    record: bool = False  # replica 0's reporting stages record their events (stats' "events")
    prepare: Optional[Callable[[int], None]] = None  # called with the rank in its process before the stage is built


class LocalResult(NamedTuple):
    model_state: dict          # the whole model, merged from replica 0's stages
    stats: List[dict]          # every rank's sums of its last epoch (steps, busy_s, bytes_sent, ...), its devices, its
                               # setup()'s answer under "setup", the run's history under "history"
    partition: Partition
    error: Optional[str] = None  # with return_errors: every failed rank's traceback


_BARRIER_TIMEOUT_S = 600.0


def _world(cfg: TrainConfig) -> int:
    return build_plan(cfg).num_processes  # stages x replicas


@contextlib.contextmanager
def _without_warm_up(skip: bool):
    """``skip``: the stage worker's set-up without its communicator warm-up (``pipeline/p2p.warm_up``), in this
    rank's process only, to reproduce the start-up deadlock the warm-up prevents on NCCL."""
    if not skip:
        yield
        return
    original = stage_worker.warm_up
    stage_worker.warm_up = lambda *args, **kwargs: None
    try:
        yield
    finally:
        stage_worker.warm_up = original


def _record_epoch_stats() -> dict:
    """In this (forked) rank process: the stage's last epoch's stats, as its step runner hands them to the engine
    (``PipelineSteps.epoch_stats``), kept in the dict returned."""
    from raytrain_mgpu.pipeline.steps import PipelineSteps

    last: dict = {}
    hand_over = PipelineSteps.epoch_stats

    def recording(self) -> dict:
        stats = hand_over(self)
        last.clear()
        last.update(stats)
        return stats

    PipelineSteps.epoch_stats = recording
    return last


def _rank_main(rank: int, jobs: list, barriers: list, ports: list, storages: list, results) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's dump when a run hangs
    for index, (run, partition) in enumerate(jobs):
        if rank >= _world(run.cfg):
            continue
        # The ranks of a run start together (a rank without a part in the runs before would
        # otherwise wait for its peers in the rendezvous, against collective_timeout_s), and
        # close together (rank 0 holds the store: the others' errors must not be lost to it).
        start, end = barriers[index]
        if run.prepare is not None:
            run.prepare(rank)
        worker = StageWorker(run.cfg, rank, emulate_nccl=run.emulate_nccl)
        if run.step_event is not None:
            engine.STEP_EVENTS.append(run.step_event)
        try:
            # The rendezvous port is picked by rank 0 as its run starts, not by the parent for every run
            # up front: a port picked minutes before its use may be taken by then (Ray's processes in the
            # other test lane open many), and then rank 0 fails to listen (EADDRINUSE) while its peers wait
            # on the other listener without any bound: measured, a peer of a rank 0 refused so still waited
            # after 120 s with timeout=20 s. The likely cause of 3 CI runs' 300 s hangs of this pool.
            if rank == 0:
                ports[index].value = free_address()[1]
            start.wait(timeout=_BARRIER_TIMEOUT_S)
            with _without_warm_up(run.skip_warmup):
                info = worker.setup("127.0.0.1", ports[index].value, partition)
            # The engine trains run.num_steps steps (max_steps), over as many epochs as they take; its checkpoints
            # go to a folder of this run's own (every rank names the same one).
            epochs = max(run.cfg.epochs, -(-run.num_steps // info["steps_per_epoch"]))
            worker.cfg = run.cfg.replace(max_steps=run.num_steps, epochs=epochs,
                                         storage_path=storages[index], name="local")
            sink = _Recorder() if run.record else None
            last_stats = _record_epoch_stats()
            worker.run(f"local{index}", sink)
            history = worker.history
            state = worker.steps.model_state() if worker.replica == 0 else {}
            stats = {**last_stats, **worker.assignment.record(), "rank": worker.rank,
                     "prank": worker.prank, "replica": worker.replica, "is_last": worker.is_last,
                     "nccl_semantics": worker.emulate_nccl, "history": history,
                     "events": sink.events if sink is not None else [], "storage": storages[index],
                     "setup": {**info, "checkpointed_blocks": worker.steps.checkpointed_blocks}}
            results.put((index, rank, None, _to_bytes(state), stats))
        except Exception:  # reported to the parent, which raises it
            results.put((index, rank, traceback.format_exc(), None, None))
        finally:
            try:
                end.wait(timeout=_BARRIER_TIMEOUT_S)
            except threading.BrokenBarrierError:  # a peer died: the parent reports it
                pass
            worker.close()


class _Recorder:
    """A progress channel that keeps a stage's events (``put.remote(kind, payload)``) for the result."""

    def __init__(self):
        self.events: list = []
        self.put = self

    def remote(self, kind, payload):
        self.events.append((kind, payload))


def _to_bytes(state: dict) -> bytes:
    """A state dict as bytes for the results queue.

    A tensor put on a multiprocessing queue travels as a file descriptor that the sending
    rank owns; the rank may exit before the parent unpickles it ("Connection reset by peer").
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _next_result(results, processes, timeout_s: float):
    """The next rank report; fails fast if a rank process died without one, and on a timeout leaves
    every live rank's Python stacks on stderr (pytest shows them with the failure)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue_module.Empty:
            dead = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"local pipeline rank process(es) {dead} died (exit codes "
                                   f"{[processes[i].exitcode for i in dead]})") from None
    for process in processes:  # one at a time, or their lines interleave
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
            time.sleep(1)
    raise TimeoutError(f"local pipeline ranks sent nothing for {timeout_s:.0f} s")


def _failure(run: LocalRun, index: int, errors: dict, results, processes) -> str:
    """Every rank's error of a failed run: the first one is often only a peer that went away.

    The other ranks fail too, within ``collective_timeout_s`` (every wait is bounded), so
    they are awaited that long (at most 30 s), then reported rank by rank.
    """
    deadline = time.monotonic() + min(run.cfg.collective_timeout_s + 5, 30)
    while len(errors) < _world(run.cfg) and time.monotonic() < deadline:
        try:
            other, rank, error, _, _ = _next_result(results, processes, deadline - time.monotonic())
        except (RuntimeError, TimeoutError):
            break
        if other == index:
            errors[rank] = error or "(finished)"
    return _describe(run, index, errors)


def _describe(run: LocalRun, index: int, errors: dict) -> str:
    return f"run {index} ({run.cfg.name}) failed:\n" + "\n".join(
        f"--- rank {rank}:\n{error}" for rank, error in sorted(errors.items()))


def run_local(runs: Sequence[LocalRun], timeout_s: float = 300.0, return_errors: bool = False) -> List[LocalResult]:
    """Train each run for its steps in local processes (gloo); returns the final weights.

    A failed run raises, unless ``return_errors``: then its result holds ``error`` (every
    rank's report) and the other runs go on in the same processes.
    """
    runs = list(runs)
    jobs = [(run, choose_partition(run.cfg, lambda cfg=run.cfg: StageWorker(cfg, 0).profile_blocks()))
            for run in runs]
    ctx = _forkserver.context()
    results = ctx.Queue()
    barriers = [(ctx.Barrier(_world(run.cfg)), ctx.Barrier(_world(run.cfg))) for run in runs]
    ports = [ctx.Value("i", 0) for _ in runs]
    storages = [run.storage or tempfile.mkdtemp(prefix="pipeline-local-") for run in runs]
    processes = [_forkserver.process(_rank_main, (rank, jobs, barriers, ports, storages, results), daemon=True)
                 for rank in range(max(_world(run.cfg) for run in runs))]
    for process in processes:
        process.start()
    try:
        collected: dict = {}
        errors: dict = {}
        for _ in range(sum(_world(run.cfg) for run in runs)):
            index, rank, error, state, stats = _next_result(results, processes, timeout_s)
            if error is not None and not return_errors:
                raise RuntimeError(_failure(runs[index], index, {rank: error}, results, processes))
            if error is not None:
                errors.setdefault(index, {})[rank] = error
            collected.setdefault(index, []).append((rank, state, stats))
        out = []
        for index, (run, partition) in enumerate(jobs):
            if index in errors:
                out.append(LocalResult({}, [], partition, _describe(run, index, errors[index])))
                continue
            parts = sorted(collected[index], key=lambda item: item[0])
            merged: dict = {}
            for _, state, _ in parts:
                merged.update(torch.load(io.BytesIO(state)))
            out.append(LocalResult(merged, [stats for _, _, stats in parts], partition))
        return out
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
