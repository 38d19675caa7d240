"""What per-step scalars cost: ``fit`` with them every step, at the default N, and off, side by side.

    raytrain-mgpu bench --step-scalars

The same run (the data-parallel benchmark's model, data and batch, ``ddp``) three times per
round: ``log_every_n_steps=1`` (a device read and a message to the driver every step),
the default N, and off (N larger than the run's steps: rank 0 only adds the micro-batch
losses on the device). Throughput is the steady state (median of the epochs after the
first); the ratio to "off" is the median over rounds of the within-round ratio (the
machine drifts more between rounds than the differences measured here). Target: the
default N within 1 % of off (issue 15).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import fields
from typing import Dict, List

from raytrain_mgpu.bench.ddp import BENCH_CONFIG, Measured, ray_fit
from raytrain_mgpu.config import TrainConfig

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


def report(measured: Dict[str, List[Measured]]) -> str:
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
    return "\n".join(lines)


def run_and_print(args) -> int:
    steps = args.num_samples // args.batch_size
    print(f"per-step scalars on rank 0: model mlp 784-2048-2048-10, synthetic 1x28x28, global batch "
          f"{args.batch_size}, {steps} steps per epoch, ddp with {args.num_workers} worker(s), 1 torch thread "
          f"per worker, {os.cpu_count()} CPU cores, {args.rounds} round(s)")
    print(report(run(args.num_samples, args.epochs, args.rounds, args.batch_size, args.num_workers)))
    return 0
