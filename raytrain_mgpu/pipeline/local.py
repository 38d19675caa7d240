"""Run pipeline stages as local processes, without Ray: for tests and quick checks.

The stage code is the same :class:`~raytrain_mgpu.pipeline.worker.StageWorker` the Ray
actors run. Several runs share one pool of processes (started once, each run using as
many of them as it has ranks), because starting a process that imports torch costs
seconds on a small machine.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import time
import traceback
from typing import List, NamedTuple, Sequence

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.pipeline.partition import Partition
from raytrain_mgpu.pipeline.plan import choose_partition
from raytrain_mgpu.pipeline.worker import StageWorker, free_address, num_replicas

__all__ = ["LocalRun", "LocalResult", "run_local"]


class LocalRun(NamedTuple):
    cfg: TrainConfig
    num_steps: int


class LocalResult(NamedTuple):
    model_state: dict          # the whole model, merged from replica 0's stages
    stats: List[dict]          # finish_epoch() of every rank, for the last epoch run
    partition: Partition


def _world(cfg: TrainConfig) -> int:
    return cfg.num_stages * num_replicas(cfg)


def _rank_main(rank: int, jobs: list, results) -> None:
    for index, (run, partition, port) in enumerate(jobs):
        if rank >= _world(run.cfg):
            continue
        worker = StageWorker(run.cfg, rank)
        try:
            info = worker.setup("127.0.0.1", port, partition, None, 0)
            remaining, epoch = run.num_steps, 0
            while remaining > 0:
                worker.start_epoch(epoch)
                steps = min(remaining, info["steps_per_epoch"])
                worker.train_steps(steps)
                remaining -= steps
                epoch += 1
            state = worker.model_state() if worker.replica == 0 else {}
            results.put((index, rank, None, state, worker.finish_epoch()))
        except Exception:  # reported to the parent, which raises it
            results.put((index, rank, traceback.format_exc(), None, None))
        finally:
            worker.close()


def _next_result(results, processes, timeout_s: float):
    """The next rank report; fails fast if a rank process died without one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue_module.Empty:
            dead = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"local pipeline rank process(es) {dead} died (exit codes "
                                   f"{[processes[i].exitcode for i in dead]})") from None
    raise TimeoutError(f"local pipeline ranks sent nothing for {timeout_s:.0f} s")


def run_local(runs: Sequence[LocalRun], timeout_s: float = 300.0) -> List[LocalResult]:
    """Train each run for its steps in local processes (gloo); returns the final weights."""
    runs = list(runs)
    jobs = [(run, choose_partition(run.cfg, lambda cfg=run.cfg: StageWorker(cfg, 0).profile_blocks()),
             free_address()[1]) for run in runs]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=_rank_main, args=(rank, jobs, results), daemon=True)
                 for rank in range(max(_world(run.cfg) for run in runs))]
    for process in processes:
        process.start()
    try:
        collected: dict = {}
        for _ in range(sum(_world(run.cfg) for run in runs)):
            index, rank, error, state, stats = _next_result(results, processes, timeout_s)
            if error is not None:
                raise RuntimeError(f"run {index} ({runs[index].cfg.name}), rank {rank} failed:\n{error}")
            collected.setdefault(index, []).append((rank, state, stats))
        out = []
        for index, (run, partition, _) in enumerate(jobs):
            parts = sorted(collected[index], key=lambda item: item[0])
            merged: dict = {}
            for _, state, _ in parts:
                merged.update(state)
            out.append(LocalResult(merged, [stats for _, _, stats in parts], partition))
        return out
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
