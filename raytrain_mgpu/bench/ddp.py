"""Data-parallel benchmark: ``fit`` against a plain PyTorch loop and ``torchrun``, side by side.

    raytrain-mgpu bench            # or: python jobs/benchmark.py

One invocation runs, on the same model, data, global batch and thread count per process:

1. a plain single-process PyTorch loop vs ``fit`` with 1 worker (target >= 0.97x);
2. ``torchrun`` DDP with 2 processes vs ``fit`` with 2 workers (target >= 1.0x);
3. ``fit`` with 2 workers vs 1 worker (target >= 1.8x on a compute-bound model).

Throughput is steady state: the median samples/s of the epochs after the first (the
first pays for warm-up). ``fit``'s start-up (Ray, worker group) is reported separately.
Every variant runs ``--rounds`` times, interleaved (see :func:`run`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from raytrain_mgpu.config.train import TrainConfig

BENCH_CONFIG = dict(model="mlp", model_kwargs={"widths": [2048, 2048]}, dataset="synthetic",
                    input_shape=(1, 28, 28), num_samples=8192, batch_size=256, epochs=4,
                    optimizer="sgd", lr=0.01, cpus_per_worker=1, eval_every_epochs=100, use_gpu=False)


@dataclass
class Measured:
    label: str
    samples_per_s: float
    startup_s: float = 0.0
    background_cpu: Optional[float] = None
    """% of one core used by every process but the training ones, in steady state."""


class BackgroundCpu:
    """CPU used by all other processes while the training processes compute (Linux ``/proc``).

    On a small machine that is CPU taken from training: a thread samples every process's
    CPU time each second; an interval counts when the training processes (command line
    containing ``pattern``) used more than 3/4 of their ``cores`` in it. :attr:`share` is what the others
    used in those intervals, in % of one core (None where ``/proc`` is missing).
    """

    def __init__(self, pattern: str, cores: int, interval_s: float = 1.0):
        self.pattern, self.cores, self.interval_s = pattern.encode(), cores, interval_s
        self.share: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-cpu")
        self._busy = {"training": 0.0, "other": 0.0, "seconds": 0.0}

    def __enter__(self) -> "BackgroundCpu":
        if os.path.isdir("/proc/self"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            if self._busy["seconds"]:
                self.share = 100 * self._busy["other"] / self._busy["seconds"]

    def _run(self) -> None:
        last, last_t = _cpu_times(self.pattern), time.monotonic()
        while not self._stop.wait(self.interval_s):
            now, now_t = _cpu_times(self.pattern), time.monotonic()
            # A pooled Ray worker becomes a training process when the actor starts in it:
            # compare each PID with its last reading, whichever side it was on.
            before = {**last["other"], **last["training"]}
            used = {key: sum(cpu - before.get(pid, 0) for pid, cpu in now[key].items()) for key in now}
            if used["training"] / (now_t - last_t) > 0.75 * self.cores:  # steady state: training computes
                self._busy["training"] += used["training"]
                self._busy["other"] += used["other"]
                self._busy["seconds"] += now_t - last_t
            last, last_t = now, now_t


def _cpu_times(pattern: bytes) -> Dict[str, Dict[int, float]]:
    """CPU seconds (user + system) of every process, split into training (cmdline has ``pattern``) and other."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: Dict[str, Dict[int, float]] = {"training": {}, "other": {}}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        key = "training" if pattern in cmdline else "other"
        out[key][int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def steady(per_epoch: list) -> float:
    """Median of every epoch but the first (or the only one)."""
    return statistics.median(per_epoch[1:] or per_epoch)


def plain_loop(cfg: TrainConfig) -> Measured:
    """The baseline: what a user writes without Ray, one process, one thread per worker slot."""
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.models import build_model

    torch.set_num_threads(cfg.cpus_per_worker)
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    rates = [plain_epoch(model, optimizer, loader) for _ in range(cfg.epochs)]
    return Measured("plain PyTorch loop, 1 process", steady(rates))


def plain_epoch(model, optimizer, loader, world: int = 1) -> float:
    """Samples per second of one epoch of what a user writes: forward, cross-entropy, backward, step
    (the plain loop's, and each ``torchrun`` rank's, which counts the ``world`` ranks' samples)."""
    start, samples = time.perf_counter(), 0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        samples += len(y) * world
    return samples / (time.perf_counter() - start)


def torchrun_ddp(cfg: TrainConfig, nproc: int) -> Measured:
    """The same DDP loop launched by ``torchrun`` (see ``raytrain_mgpu.bench._torchrun_ddp``)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.cpus_per_worker)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raytrain_mgpu.bench._torchrun_ddp", json.dumps(cfg.to_dict())]
    # The ranks' command lines name the module (the torchrun agent's does too: it counts as training).
    with BackgroundCpu("raytrain_mgpu.bench._torchrun_ddp", nproc * cfg.cpus_per_worker) as cpu:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"torchrun failed:\n{out.stderr[-3000:]}")
    rates = json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]
    return Measured(f"torchrun DDP, {nproc} processes", steady(rates), background_cpu=cpu.share)


def ray_fit(cfg: TrainConfig, storage: str) -> Measured:
    from raytrain_mgpu.api import fit

    start = time.perf_counter()
    with BackgroundCpu("RayTrainWorker", cfg.num_workers * cfg.cpus_per_worker) as cpu:
        result = fit(cfg.replace(storage_path=storage), stream=open(os.devnull, "w"))
    wall = time.perf_counter() - start
    rates = [h["samples_per_s"] for h in result.history]
    train_s = sum(h["step_time_s"] * (cfg.num_samples // cfg.batch_size) for h in result.history)
    return Measured(f"raytrain-mgpu fit, ddp, {cfg.num_workers} worker(s)", steady(rates), wall - train_s,
                    cpu.share)


def run(num_samples: int = BENCH_CONFIG["num_samples"], epochs: int = BENCH_CONFIG["epochs"],
        rounds: int = 3, batch_size: int = BENCH_CONFIG["batch_size"]) -> list:
    """Every measurement, ``rounds`` times interleaved; rows of (comparison, ours, baseline, ratios, target).

    This machine's speed drifts by 10-20 % within minutes (other tenants of the host), more
    than the differences we look for. So each round runs every variant once, in an order
    rotated from round to round, and a comparison's figure is the median over rounds of
    the ratio within a round, whose runs were seconds apart.
    """
    import ray

    base = TrainConfig(**{**BENCH_CONFIG, "num_samples": num_samples, "epochs": epochs, "batch_size": batch_size})
    one, two = base.replace(num_workers=1), base.replace(num_workers=2)
    measured: Dict[str, List[Measured]] = {name: [] for name in ("plain", "torchrun", "fit1", "fit2")}
    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            variants = {
                "plain": lambda r: plain_loop(one),
                "torchrun": lambda r: torchrun_ddp(two, 2),
                "fit1": lambda r: ray_fit(one.replace(name=f"bench-1-r{r}"), storage),  # a new run each round
                "fit2": lambda r: ray_fit(two.replace(name=f"bench-2-r{r}"), storage),
            }
            names = list(variants)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    measured[name].append(variants[name](r))
    finally:
        ray.shutdown()
    return [(measured["fit1"], measured["plain"], 0.97), (measured["fit2"], measured["torchrun"], 1.0),
            (measured["fit2"], measured["fit1"], 1.8)]


def report(rows: list) -> str:
    lines = [f"{'ours':<40} {'samples/s':>10}   {'baseline':<34} {'samples/s':>10}  {'ratio':>6}  "
             f"{'range':>11}  target", "-" * 132]
    for ours, baseline, target in rows:
        ratios = [o.samples_per_s / b.samples_per_s for o, b in zip(ours, baseline)]
        ratio = statistics.median(ratios)
        flag = "ok" if ratio >= target else "BELOW"
        lines.append(f"{ours[0].label:<40} {_median_rate(ours):>10,.0f}   {baseline[0].label:<34} "
                     f"{_median_rate(baseline):>10,.0f}  {ratio:>5.2f}x  {min(ratios):.2f}-{max(ratios):.2f}x"
                     f"  >= {target} {flag}")
    startups = {r[0][0].label: statistics.median(m.startup_s for m in r[0]) for r in rows}
    lines.append(f"samples/s: median over {len(rows[0][0])} round(s); ratio: median of the within-round ratios "
                 f"(range: lowest-highest round)")
    lines.append("start-up (Ray + worker group + checkpoints, outside the steady state): " +
                 ", ".join(f"{label}: {s:.1f} s" for label, s in startups.items()))
    background = {runs[0].label: statistics.median(m.background_cpu for m in runs)
                  for row in rows for runs in row[:2] if all(m.background_cpu is not None for m in runs)}
    if background:
        lines.append("CPU used by all other processes while training computes (Ray's daemons and actors, the "
                     "driver; % of one core): " + ", ".join(f"{label}: {v:.1f}" for label, v in background.items()))
    return "\n".join(lines)


def _median_rate(runs: List[Measured]) -> float:
    return statistics.median(m.samples_per_s for m in runs)


def add_arguments(parser) -> None:
    """The benchmark's options (for ``jobs/benchmark.py`` and ``raytrain-mgpu bench`` alike)."""
    parser.add_argument("--num-samples", type=int, default=BENCH_CONFIG["num_samples"],
                        help="training samples per epoch")
    parser.add_argument("--epochs", type=int, default=BENCH_CONFIG["epochs"],
                        help="epochs per measurement (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="times every variant runs, interleaved")
    parser.add_argument("--batch-size", type=int, default=BENCH_CONFIG["batch_size"],
                        help="global batch; larger batches make a step compute-bound (the all-reduce stays 23 MB)")
    parser.add_argument("--step-scalars", action="store_true",
                        help="instead: fit with per-step scalars every step, at the default log_every_n_steps and "
                             "off, side by side (raytrain_mgpu.bench.step_scalars)")
    parser.add_argument("--num-workers", type=int, default=1, help="ddp workers for --step-scalars")
    parser.add_argument("--short-epochs", type=int, metavar="EPOCHS",
                        help="instead: fit against a hand-written Ray Train loop on EPOCHS short epochs (digits, 2 "
                             "workers), and fit with a step checkpoint every 10 steps (raytrain_mgpu.bench.short_epochs)")


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_and_print(parser.parse_args(argv))


def run_and_print(args) -> int:
    print(f"model mlp 784-2048-2048-10, synthetic 1x28x28, global batch {args.batch_size}, "
          f"1 torch thread per process, {os.cpu_count()} CPU cores, {args.rounds} round(s)")
    print(report(run(args.num_samples, args.epochs, args.rounds, args.batch_size)))
    return 0
