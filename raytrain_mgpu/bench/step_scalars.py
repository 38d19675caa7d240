"""What per-step scalars cost: ``fit`` with them every step, at the default N, and off, side by side.

    raytrain-mgpu bench --step-scalars

The same run (the data-parallel benchmark's model, data and batch, ``ddp``) three times per
round: ``log_every_n_steps=1`` (a device read and a message to the driver every step),
the default N, and off (N larger than the run's steps: rank 0 only adds the micro-batch
losses on the device). Throughput is the steady state (median of the epochs after the
first); the ratio to "off" is the median over rounds of the within-round ratio (the
machine drifts more between rounds than the differences measured here). Target: the
default N within 1 % of off.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import fields
from typing import Dict, List

from raytrain_mgpu.bench.ddp import BENCH_CONFIG, Measured, ray_fit
from raytrain_mgpu.config.train import TrainConfig

DEFAULT_N = next(f.default for f in fields(TrainConfig) if f.name == "log_every_n_steps")
OFF = 10**9
TARGET = 0.99


def variants() -> Dict[str, int]:
    """Label -> ``log_every_n_steps``; "off" is the baseline."""
    return {"every step (N=1)": 1, f"default (N={DEFAULT_N})": DEFAULT_N, "off": OFF}


def run(num_samples: int, epochs: int, rounds: int, batch_size: int, num_workers: int = 1) -> Dict[str, List[Measured]]:
    """Every variant once per round, in an order rotated from round to round."""
    import ray

    base = TrainConfig(**{**BENCH_CONFIG, "num_samples": num_samples, "epochs": epochs, "batch_size": batch_size,
                          "num_workers": num_workers})
    measured: Dict[str, List[Measured]] = {label: [] for label in variants()}
    labels = list(measured)
    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            for r in range(rounds):
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    cfg = base.replace(log_every_n_steps=variants()[label], name=f"bench-scalars-{labels.index(label)}-r{r}")
                    measured[label].append(ray_fit(cfg, storage))
    finally:
        ray.shutdown()
    return measured


def window_cost_s(steps: int = 2000, repeats: int = 5) -> tuple:
    """``(per step, per read)`` seconds rank 0 adds (a micro-batch loss and a clipped norm added on
    the device, the host counters; one read), timed in this process: the fastest of ``repeats``
    (other processes only ever add time), so it holds on a loaded machine where the fits cannot
    resolve 1 %."""
    import torch

    from raytrain_mgpu.engine.step_scalars import StepWindow

    window, loss, norm = StepWindow(torch.device("cpu")), torch.tensor(0.5), torch.tensor(1.5)
    per_step, per_read = [], []
    for _ in range(repeats):
        window.resume()
        start = time.perf_counter()
        for _ in range(steps):
            window.add_loss(loss, 256)
            window.add_data_wait(0.0)
            window.end_step(0.1, norm)
        per_step.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        window.read()
        per_read.append(time.perf_counter() - start)
    return min(per_step), min(per_read)


def report(measured: Dict[str, List[Measured]], batch_size: int = 0, cost: tuple = ()) -> str:
    """One line per variant: median samples/s, median within-round ratio to "off", its range."""
    off = measured["off"]
    lines = [f"{'per-step scalars':<22} {'samples/s':>10}  {'vs off':>7}  {'range':>11}", "-" * 56]
    for label, runs in measured.items():
        ratios = [m.samples_per_s / o.samples_per_s for m, o in zip(runs, off)]
        rate = statistics.median(m.samples_per_s for m in runs)
        flag = ""
        if label.startswith("default"):
            flag = f"  target >= {TARGET} {'ok' if statistics.median(ratios) >= TARGET else 'BELOW'}"
        lines.append(f"{label:<22} {rate:>10,.0f}  {statistics.median(ratios):>6.3f}x  "
                     f"{min(ratios):.3f}-{max(ratios):.3f}x{flag}")
    lines.append(f"samples/s: median over {len(off)} round(s) of the steady state; ratio: median of the "
                 f"within-round ratios (range: lowest-highest round)")
    if cost and batch_size:
        step_s = batch_size / statistics.median(o.samples_per_s for o in off)
        per_step, per_read = cost
        lines.append(f"rank 0's added work, timed in-process: {per_step * 1e6:.1f} us per step + {per_read * 1e6:.1f} us "
                     f"per read (every N steps), against a {step_s * 1e3:.0f} ms step: "
                     f"{100 * (per_step + per_read / DEFAULT_N) / step_s:.3f} % at N={DEFAULT_N}, "
                     f"{100 * (per_step + per_read) / step_s:.3f} % at N=1 (plus its message to the driver)")
    return "\n".join(lines)


def run_and_print(args) -> int:
    steps = args.num_samples // args.batch_size
    print(f"per-step scalars on rank 0: model mlp 784-2048-2048-10, synthetic 1x28x28, global batch "
          f"{args.batch_size}, {steps} steps per epoch, ddp with {args.num_workers} worker(s), 1 torch thread "
          f"per worker, {os.cpu_count()} CPU cores, {args.rounds} round(s)")
    measured = run(args.num_samples, args.epochs, args.rounds, args.batch_size, args.num_workers)
    print(report(measured, args.batch_size, window_cost_s()))
    return 0
