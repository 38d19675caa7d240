"""Pipeline benchmark: efficiency, our runtime against torchrun + torch.distributed.pipelining,
and pipelining against naive model parallelism. All from one invocation.

Workload: a compute-bound MLP (``width`` x ``depth`` Linear+ReLU blocks), ``stages``
stages, ``microbatches`` micro-batches of ``rows`` rows (CPU matmuls below ~128 rows cost
over twice as much per row), one torch thread per process, gloo.

1. efficiency = ideal / measured, ideal = (one process, the same micro-batches with
   gradient accumulation) x (m+p-1)/(m p): the time the pipeline would take if its only
   loss were the fill-and-drain bubble;
2. the same model, partition and schedule under ``torchrun`` with
   ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``):
   ours / theirs >= 1 means the Ray actor group and our executor cost nothing extra;
3. naive model parallelism (m=1: one micro-batch of the whole batch, stages take turns)
   against the pipelined run with the same global batch.

Every variant reads the same synthetic data through a ``DataLoader`` and takes an SGD
step; each is timed over ``rounds`` rounds of ``steps`` steps after ``warmup`` steps, and
the fastest round counts (other processes on a shared machine only ever add time).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.optim import build_optimizer

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "run_benchmark", "format_report", "parse_args"]


@dataclass
class BenchConfig:
    width: int = 1024
    depth: int = 8
    rows: int = 128
    microbatches: int = 8
    stages: int = 2
    steps: int = 5
    rounds: int = 3
    warmup: int = 2
    schedules: tuple = ("gpipe", "1f1b")
    torchrun: bool = True

    @property
    def batch_size(self) -> int:
        return self.rows * self.microbatches


def train_config(bench: BenchConfig, schedule: str, microbatches: int, storage: str) -> TrainConfig:
    steps = bench.warmup + bench.rounds * bench.steps
    return TrainConfig(
        model="mlp", model_kwargs={"widths": [bench.width] * bench.depth}, dataset="synthetic",
        input_shape=[bench.width], num_classes=10, num_samples=bench.batch_size * steps, strategy="pipeline",
        num_stages=bench.stages, num_microbatches=microbatches, schedule=schedule, batch_size=bench.batch_size,
        optimizer="sgd", lr=0.01, momentum=0.9, cpus_per_worker=1, epochs=1, storage_path=storage,
        name=f"bench-{schedule}-m{microbatches}")


def _fastest(times: List[float]) -> float:
    return min(times)


# ----------------------------------------------------------------------------- single process


def time_single_process(cfg: TrainConfig, bench: BenchConfig) -> float:
    """Seconds per step of the unsplit model, gradient accumulation over the micro-batches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = build_datasets(cfg.data)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
        optimizer = build_optimizer(model.parameters(), cfg.optim)
        batches = iter(_loader(cfg, data))

        def step():
            x, y = next(batches)
            for xs, ys in zip(x.chunk(cfg.num_microbatches), y.chunk(cfg.num_microbatches)):
                (F.cross_entropy(model(xs), ys) / cfg.num_microbatches).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(bench.warmup):
            step()
        rounds = []
        for _ in range(bench.rounds):
            start = time.perf_counter()
            for _ in range(bench.steps):
                step()
            rounds.append((time.perf_counter() - start) / bench.steps)
        return _fastest(rounds)
    finally:
        torch.set_num_threads(threads)


def _loader(cfg: TrainConfig, data) -> DataLoader:
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    return DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)


# ----------------------------------------------------------------------------- ours, on Ray


def time_ray_pipeline(cfg: TrainConfig, bench: BenchConfig) -> dict:
    """Seconds per step of our stage actors, timed on the driver (Ray calls included)."""
    from raytrain_mgpu.pipeline.group import StageGroup
    from raytrain_mgpu.pipeline.plan import choose_partition

    partition = choose_partition(cfg)
    group = StageGroup(cfg)
    try:
        group.start()
        group.setup(partition, None, 0)
        group.call("start_epoch", 0)
        group.call("train_steps", bench.warmup)
        group.call("start_epoch", 0)  # reset the per-step counters; the sampler restarts too
        rounds = []
        for _ in range(bench.rounds):
            start = time.perf_counter()
            group.call("train_steps", bench.steps)
            rounds.append((time.perf_counter() - start) / bench.steps)
        stats = group.call("finish_epoch")
        bubble = sum(1 - s["busy_s"] / s["schedule_s"] for s in stats) / len(stats)
        group.shutdown(graceful=True)
        return {"step_s": _fastest(rounds), "bubble_fraction": bubble, "partition": list(partition.counts)}
    finally:
        group.shutdown()


# ----------------------------------------------------------------------------- torchrun baseline


def time_torchrun_pipeline(cfg: TrainConfig, bench: BenchConfig, counts: List[int]) -> float:
    """Seconds per step of the same model and partition under torchrun + torch.distributed.pipelining."""
    from raytrain_mgpu.pipeline.worker import free_address

    spec = json.dumps({"cfg": cfg.to_dict(), "counts": counts, "bench": asdict(bench)})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.num_stages}",
                   f"--master_port={free_address()[1]}", "-m", "raytrain_mgpu.pipeline.bench",
                   "--torchrun-worker", spec, "--result", result.name]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun baseline failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return float(json.loads(result.read())["step_s"])


def _torchrun_worker(spec: dict, result_path: str) -> None:
    """One torchrun rank: the stage of ``counts`` it owns, run by torch's own schedule."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from raytrain_mgpu.pipeline.partition import blocks_of, build_stage_modules, plan_partition

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(**spec["cfg"])
    bench = BenchConfig(**{**spec["bench"], "schedules": tuple(spec["bench"]["schedules"])})
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    module = build_stage_modules(model, plan_partition(blocks_of(model), world, spec["counts"], log=False))[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
    schedule = schedule_class(stage, cfg.num_microbatches, loss_fn=F.cross_entropy)
    optimizer = build_optimizer(module.parameters(), cfg.optim)
    batches = iter(_loader(cfg, data))

    def step():
        x, y = next(batches)  # first and last rank read the data, as in our stages
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(bench.warmup):
            step()
        rounds = []
        for _ in range(bench.rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(bench.steps):
                step()
            dist.barrier()
            rounds.append((time.perf_counter() - start) / bench.steps)
        if rank == 0:
            with open(result_path, "w") as out:
                json.dump({"step_s": _fastest(rounds)}, out)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the benchmark


def run_benchmark(bench: BenchConfig) -> dict:
    """Every variant, with Ray started here if it is not running (and stopped again)."""
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=max(2 * bench.stages, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-") as storage:
            m, p = bench.microbatches, bench.stages
            single = time_single_process(train_config(bench, "gpipe", m, storage), bench)
            ideal = single * (m + p - 1) / (m * p)
            results = {"bench": asdict(bench), "single_step_s": single, "ideal_step_s": ideal, "schedules": {}}
            for schedule in bench.schedules:
                cfg = train_config(bench, schedule, m, storage)
                ours = time_ray_pipeline(cfg, bench)
                entry = {**ours, "efficiency": ideal / ours["step_s"]}
                if bench.torchrun:
                    theirs = time_torchrun_pipeline(cfg, bench, ours["partition"])
                    entry.update(torchrun_step_s=theirs, torchrun_efficiency=ideal / theirs,
                                 ours_vs_torchrun=theirs / ours["step_s"])
                results["schedules"][schedule] = entry
            naive = time_ray_pipeline(train_config(bench, "gpipe", 1, storage), bench)
            best = min(entry["step_s"] for entry in results["schedules"].values())
            results["naive_step_s"] = naive["step_s"]
            results["pipelined_speedup"] = naive["step_s"] / best
            return results
    finally:
        if started_ray:
            ray.shutdown()


def format_report(results: dict) -> str:
    bench = results["bench"]
    m, p = bench["microbatches"], bench["stages"]
    lines = [
        f"pipeline benchmark: MLP {bench['depth']} x Linear({bench['width']}, {bench['width']}), P={p} stages, "
        f"m={m} micro-batches of {bench['rows']} rows (global batch {bench['rows'] * m}), 1 torch thread per "
        f"process, gloo; fastest of {bench['rounds']} rounds of {bench['steps']} steps",
        f"one process, {m} micro-batches with gradient accumulation: {results['single_step_s']:.3f} s/step; "
        f"ideal pipeline = x (m+p-1)/(m p) = {results['ideal_step_s']:.3f} s/step",
        f"{'schedule':<9} {'ours s/step':>12} {'efficiency':>11} {'bubble':>7} {'torchrun s/step':>16} "
        f"{'efficiency':>11} {'ours/torchrun':>14}",
    ]
    for schedule, e in results["schedules"].items():
        theirs = (f"{e['torchrun_step_s']:>16.3f} {e['torchrun_efficiency']:>11.2f} {e['ours_vs_torchrun']:>13.2f}x"
                  if "torchrun_step_s" in e else f"{'-':>16} {'-':>11} {'-':>14}")
        lines.append(f"{schedule:<9} {e['step_s']:>12.3f} {e['efficiency']:>11.2f} "
                     f"{e['bubble_fraction']:>7.2f} {theirs}")
    lines.append(f"naive model parallel (m=1): {results['naive_step_s']:.3f} s/step; pipelined speed-up "
                 f"{results['pipelined_speedup']:.2f}x")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> tuple:
    """``(BenchConfig, json path or None)`` from command-line flags (for jobs/ and the CLI)."""
    parser = argparse.ArgumentParser(description="Pipeline benchmark: efficiency, torchrun baseline, naive MP.")
    for name, default in asdict(BenchConfig()).items():
        if isinstance(default, int) and not isinstance(default, bool):
            parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--schedules", default=",".join(BenchConfig.schedules), help="comma-separated")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    values = {k: getattr(args, k) for k, v in asdict(BenchConfig()).items() if isinstance(v, int)
              and not isinstance(v, bool)}
    return BenchConfig(**values, schedules=tuple(args.schedules.split(",")), torchrun=not args.no_torchrun), args.json


if __name__ == "__main__":  # a torchrun rank of the baseline
    _parser = argparse.ArgumentParser()
    _parser.add_argument("--torchrun-worker", required=True)
    _parser.add_argument("--result", required=True)
    _args = _parser.parse_args()
    _torchrun_worker(json.loads(_args.torchrun_worker), _args.result)
