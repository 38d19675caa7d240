"""Pipeline benchmark: efficiency, our runtime against torchrun + torch.distributed.pipelining,
and pipelining against naive model parallelism. All from one invocation.

Workload: a compute-bound MLP (``depth`` Linear+ReLU blocks of ``width``), ``stages``
stages, ``microbatches`` micro-batches of ``rows`` rows (CPU matmuls below ~128 rows cost
over twice as much per row), one torch thread per process, gloo.

1. efficiency = ideal / measured, ideal = (one process, the same micro-batches with
   gradient accumulation) x (m+p-1)/(m p): the time the pipeline would take if its only
   loss were the fill-and-drain bubble;
2. the same model, partition and schedule under ``torchrun`` with
   ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``):
   ours / theirs > 1 means the Ray actor group and our executor cost nothing extra;
3. naive model parallelism (m=1: the whole batch as one micro-batch, stages take turns)
   against the pipelined run with the same global batch.

Every variant reads the same in-memory random data through a ``DataLoader`` and takes
an SGD step. Variants are started and warmed up, then timed in interleaved rounds (each round
times the single process and the phase's variants for ``steps`` steps). Step times are a
variant's fastest round (other processes only ever add time); every ratio is the median
over rounds of the ratio within a round, whose runs were seconds apart, so the machine's
slow drifts cancel.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from statistics import median
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import Datasets, build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.bench._torchrun_pipeline import TorchrunPipeline, seeded_loader
from raytrain_mgpu.transports.actor_group.stage import StageWorker

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "run_benchmark", "format_report", "parse_args"]


@dataclass
class BenchConfig:
    width: int = 1024
    depth: int = 8
    rows: int = 128
    microbatches: int = 8
    stages: int = 2
    steps: int = 4
    rounds: int = 10  # at 5, a 1f1b ratio moved by 0.07 between runs: the machine drifts 10-20 %
    warmup: int = 2
    schedules: tuple = ("gpipe", "1f1b", "interleaved_1f1b")
    torchrun: bool = True

    @property
    def batch_size(self) -> int:
        return self.rows * self.microbatches


class _Rows(Dataset):
    """Rows of two in-memory tensors: reading costs a gather, so the runtime is what is timed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]

    def __getitems__(self, indices) -> list:
        index = torch.as_tensor(indices)  # one gather for the batch, as DataLoader allows
        return list(zip(self.x[index].unbind(0), self.y[index].unbind(0)))


def in_memory_data(cfg) -> Datasets:
    """``dataset="raytrain_mgpu.bench.pipeline:in_memory_data"``: seeded random rows held in memory.

    The registry's ``synthetic`` dataset draws every sample on access (~35 ms for a batch
    of 1024 x 1024 here), which would time the data generator more than the pipeline.
    """
    generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.num_samples, *cfg.input_shape, generator=generator)
    y = torch.randint(cfg.num_classes, (cfg.num_samples,), generator=generator)
    return Datasets(_Rows(x, y), _Rows(x[:64], y[:64]), tuple(cfg.input_shape), cfg.num_classes)


def train_config(bench: BenchConfig, schedule: str, microbatches: int, storage: str) -> TrainConfig:
    steps = bench.warmup + bench.rounds * bench.steps + 1
    return TrainConfig(
        model="mlp", model_kwargs={"widths": [bench.width] * bench.depth}, dataset="raytrain_mgpu.bench.pipeline:in_memory_data",
        input_shape=[bench.width], num_classes=10, num_samples=bench.batch_size * steps, strategy="pipeline",
        num_stages=bench.stages, num_microbatches=microbatches, schedule=schedule, batch_size=bench.batch_size,
        optimizer="sgd", lr=0.01, momentum=0.9, cpus_per_worker=1, epochs=1, storage_path=storage,
        name=f"bench-{schedule}-m{microbatches}", use_gpu=False, num_workers=1)


# ----------------------------------------------------------------------------- variants


class SingleProcess:
    """The unsplit model in this process, gradient accumulation over the micro-batches."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.data = data = build_datasets(cfg.data)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.batches = iter(seeded_loader(cfg, data))

    def _step(self) -> None:
        m = self.cfg.num_microbatches
        try:
            x, y = next(self.batches)
        except StopIteration:  # timed in every phase: more steps than one epoch holds
            self.batches = iter(seeded_loader(self.cfg, self.data))
            x, y = next(self.batches)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (F.cross_entropy(self.model(xs), ys) / m).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # like every pipeline process
        try:
            start = time.perf_counter()
            for _ in range(steps):
                self._step()
            return (time.perf_counter() - start) / steps
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        pass


class BenchStageWorker(StageWorker):
    """A stage actor stepped by hand from the driver: the engine set up, its steps run on request, for timing the
    schedule against torchrun's step for step."""

    def bench_start(self, attempt: str) -> None:
        """Set the engine up for stepping by hand: ``bench_steps`` runs its steps, ``bench_stats`` reads (and restarts)
        the stage's sums; for timing the schedule against torchrun's, step for step, from the driver."""
        from raytrain_mgpu.pipeline.steps import PipelineSteps
        from raytrain_mgpu.transports.actor_group.stage import StageTransport
        from raytrain_mgpu.engine.loop import Engine
        from raytrain_mgpu.engine.metrics import EpochMeter

        self.steps = PipelineSteps(self, self.partition)
        self._bench = Engine(self.cfg, self.plan, self.steps, StageTransport(self.cfg, self, attempt, None), self.data)
        self._bench.setup()
        self._meter = EpochMeter(self.device, self.objective)
        self._next = self._bench.feed.batches(self._bench.feed.epoch(0), self._meter, None)

    def bench_steps(self, num_steps: int) -> None:
        engine = self._bench
        for _ in range(num_steps):
            engine.steps.train_step(self._next, self._meter, None, engine.scaler, 1)
            engine.state.step += 1
            engine.end_step(engine.state.step)

    def bench_stats(self) -> dict:
        return self.steps.epoch_stats()


class RayPipeline:
    """Our stage actors; timed on the driver, Ray calls included."""

    def __init__(self, cfg: TrainConfig):
        from raytrain_mgpu.transports.actor_group.group import StageGroup
        from raytrain_mgpu.strategies.plan import build_plan
        from raytrain_mgpu.pipeline.plan import choose_partition

        self.partition = choose_partition(cfg)
        self.group = StageGroup(cfg, build_plan(cfg), BenchStageWorker)
        self.group.start()
        self.group.setup(self.partition)
        self.group.call("bench_start", "bench")  # the engine set up on every stage, stepped from here

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        self.group.call("bench_steps", steps)
        return (time.perf_counter() - start) / steps

    def bubble_fraction(self) -> float:
        stats = self.group.call("bench_stats")
        return sum(1 - s["busy_s"] / s["schedule_s"] for s in stats) / len(stats)

    def close(self) -> None:
        self.group.shutdown(graceful=True)


# ----------------------------------------------------------------------------- the benchmark


def run_benchmark(bench: BenchConfig) -> dict:
    """Every variant, with Ray started here if it is not running (and stopped again)."""
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        # Logical CPUs: every variant's actors stay alive (idle) between its rounds.
        ray.init(num_cpus=bench.stages * (len(bench.schedules) + 1), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING, object_store_memory=256 * 2**20)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-") as storage:
            return _run_variants(bench, storage)
    finally:
        if started_ray:
            ray.shutdown()


def _run_variants(bench: BenchConfig, storage: str) -> dict:
    """One phase per schedule (ours and torchrun's), then one for naive MP; the single
    process is timed in every round of every phase. Only the variants of one phase are
    alive at a time: an idle Ray actor or torchrun rank still costs ~2% of a core."""
    m = bench.microbatches
    configs = {s: train_config(bench, s, m, storage) for s in bench.schedules}
    single = SingleProcess(configs[bench.schedules[0]])
    single.run(bench.warmup)
    rounds: List[Dict[str, float]] = []  # every round: seconds per step of single and the phase's variants
    results = {"bench": asdict(bench), "schedules": {}}
    for schedule, cfg in configs.items():
        ours = RayPipeline(cfg)
        phase = {f"ours-{schedule}": ours}
        try:
            if bench.torchrun:
                phase[f"torchrun-{schedule}"] = TorchrunPipeline(cfg, list(ours.partition.counts), bench.warmup,
                                                                 Path(storage) / f"control-{schedule}")
            rounds += _time_phase(bench, single, phase)
            results["schedules"][schedule] = {"bubble_fraction": ours.bubble_fraction(),
                                              "partition": list(ours.partition.counts)}
        finally:
            _close(phase)
    naive = {"naive": RayPipeline(train_config(bench, "gpipe", 1, storage))}
    try:
        rounds += _time_phase(bench, single, naive)
    finally:
        _close(naive)
    return _summarise(bench, results, rounds)


def _time_phase(bench: BenchConfig, single: SingleProcess, phase: dict) -> List[Dict[str, float]]:
    for variant in phase.values():
        if isinstance(variant, TorchrunPipeline):
            variant.ready()
        else:
            variant.run(bench.warmup)
            variant.group.call("bench_stats")  # restart the busy-time counters after warm-up
    rounds = []
    for _ in range(bench.rounds):
        times = {"single": single.run(bench.steps)}
        for name, variant in phase.items():
            times[name] = variant.run(bench.steps)
        rounds.append(times)
    return rounds


def _close(phase: dict) -> None:
    for variant in phase.values():
        try:
            variant.close()
        except Exception as exc:  # teardown of the others continues
            logger.warning("closing a benchmark variant failed: %s", exc)


def _summarise(bench: BenchConfig, results: dict, rounds: List[Dict[str, float]]) -> dict:
    """Step times: the fastest round. Ratios: the median over rounds of the ratio within a
    round, whose variants ran seconds apart, so slow drifts of the machine cancel."""
    m, p = bench.microbatches, bench.stages
    factor = (m + p - 1) / (m * p)

    def best(name: str) -> float:
        return min(r[name] for r in rounds if name in r)

    def ratio(top: str, bottom: str, scale: float = 1.0) -> float:
        return median(scale * r[top] / r[bottom] for r in rounds if top in r and bottom in r)

    results.update(single_step_s=best("single"), ideal_step_s=best("single") * factor, rounds=rounds)
    for schedule, entry in results["schedules"].items():
        ours = f"ours-{schedule}"
        entry.update(step_s=best(ours), efficiency=ratio("single", ours, factor))
        if any(f"torchrun-{schedule}" in r for r in rounds):
            theirs = f"torchrun-{schedule}"
            entry.update(torchrun_step_s=best(theirs), torchrun_efficiency=ratio("single", theirs, factor),
                         ours_vs_torchrun=ratio(theirs, ours))
    results["naive_step_s"] = best("naive")
    # Naive MP runs in a phase of its own: compare both through the single process timed in
    # every round (time relative to it), not through times taken minutes apart.
    fastest = min(results["schedules"], key=lambda s: ratio(f"ours-{s}", "single"))
    results["pipelined_speedup"] = ratio("naive", "single") / ratio(f"ours-{fastest}", "single")
    results["best_schedule"] = fastest
    return results


def format_report(results: dict) -> str:
    bench = results["bench"]
    m, p = bench["microbatches"], bench["stages"]
    lines = [
        f"pipeline benchmark: MLP {bench['depth']} x Linear({bench['width']}, {bench['width']}), P={p} stages, "
        f"m={m} micro-batches of {bench['rows']} rows (global batch {bench['rows'] * m}), 1 torch thread per "
        f"process, gloo; s/step: fastest of {bench['rounds']} rounds of {bench['steps']} steps; efficiency and "
        f"ours/torchrun: median over rounds of the ratios within a round",
        f"one process, {m} micro-batches with gradient accumulation: {results['single_step_s']:.3f} s/step; "
        f"ideal pipeline = that x (m+p-1)/(m p) = {results['ideal_step_s']:.3f} s/step",
        f"{'schedule':<16} {'ours s/step':>12} {'efficiency':>11} {'bubble':>7} {'busy':>6} {'torchrun s/step':>16} "
        f"{'efficiency':>11} {'ours/torchrun':>14}",
    ]
    for schedule, e in results["schedules"].items():
        theirs = (f"{e['torchrun_step_s']:>16.3f} {e['torchrun_efficiency']:>11.2f} {e['ours_vs_torchrun']:>13.2f}x"
                  if "torchrun_step_s" in e else f"{'-':>16} {'-':>11} {'-':>14}")
        busy = e["step_s"] * (1 - e["bubble_fraction"]) / (results["single_step_s"] / p)
        lines.append(f"{schedule:<16} {e['step_s']:>12.3f} {e['efficiency']:>11.2f} "
                     f"{e['bubble_fraction']:>7.2f} {busy:>5.2f}x {theirs}")
    lines.append("bubble: measured idle share of a stage (ideal (p-1)/(m+p-1)); busy: a stage's working time "
                 "per step over 1/p of the single process's (1.00x: no slower than alone); efficiency ~ "
                 "(1 - bubble) / ((1 - ideal bubble) x busy)")
    lines.append(f"naive model parallel (m=1, ours): {results['naive_step_s']:.3f} s/step; pipelined "
                 f"({results['best_schedule']}) speed-up over it {results['pipelined_speedup']:.2f}x (each "
                 f"relative to the single process of its rounds)")
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
