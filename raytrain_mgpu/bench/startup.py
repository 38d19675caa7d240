"""Start-up: how long until the first optimizer step, ``fit`` against a hand-written Ray Train loop.

    raytrain-mgpu bench-startup [--num-workers 1 2] [--use-gpu] [--model lenet] [--rounds 1]

Each variant runs in a fresh Python process (nothing imported, no Ray running), timed from just before Ray
starts (the process has imported torch and this package, as a user's script has) to rank 0's first step:

- ``fit, in-process``: ``runner="local"``, one worker in the driver's own process (no Ray at all);
- ``fit, Ray Train``: ``runner="ray"``, ``fit`` starting a local Ray and its worker group;
- ``ray train``: what Ray Train's documentation shows a user writing (``ray.init()``, ``TorchTrainer`` with
  ``prepare_model``/``prepare_data_loader``), the same model and data, its first step's time written by rank 0.

Printed: each variant's seconds to the first step (median over ``--rounds``) and its ratio to the hand-written
loop with the same number of workers. Targets: in-process <= 0.30x the hand-written one-worker loop, ``fit``
through Ray <= 0.80x the hand-written loop's with two workers.

``--tune``: instead, whole calls' seconds (from before Ray starts to their return, in fresh processes): a Ray Tune
search of three one-worker trials of ``--epochs`` epochs (``raytrain_mgpu.tune.trainable``: each trial trains in its
own process) against one hand-written ``TorchTrainer`` run of the same size. Target: no longer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from raytrain_mgpu._cli_options import renamed
from raytrain_mgpu.bench._ray_train_loop import hand_written_loop

VARIANTS = ("fit, in-process", "fit, Ray Train", "ray train")
FIELDS = dict(model="lenet", dataset="digits", epochs=1, batch_size=128)  # the run measured, by default


def measure_whole(variant: str, cfg_fields: dict, storage: str) -> float:
    """In this (fresh) process: seconds from before Ray starts to the call's return (``--tune``)."""
    import torch  # noqa: F401 (imported before the clock starts)

    import ray

    import raytrain_mgpu as rtm

    cfg = rtm.TrainConfig(**{**cfg_fields, "num_workers": 1, "storage_path": storage, "name": "whole"})
    started = time.time()
    ray.init(log_to_driver=False)
    try:
        if variant == "tune, 3 trials":
            from ray import tune

            from raytrain_mgpu.tune import trainable

            tune.Tuner(trainable(cfg), param_space={"lr": tune.grid_search([0.01, 0.02, 0.05])},
                       run_config=tune.RunConfig(storage_path=storage, name="tune", verbose=0)).fit()
        else:
            from ray.train import RunConfig, ScalingConfig
            from ray.train.torch import TorchTrainer

            TorchTrainer(hand_written_loop, train_loop_config={"cfg": cfg.to_dict()},
                         scaling_config=ScalingConfig(num_workers=1),
                         run_config=RunConfig(name="trainer", storage_path=storage)).fit()
    finally:
        ray.shutdown()
    return time.time() - started


def measure(variant: str, cfg_fields: dict, workers: int, storage: str) -> float:
    """In this (fresh) process: seconds from before Ray starts to rank 0's first step."""
    import torch  # noqa: F401 (imported before the clock starts, as a user's script has it)

    import raytrain_mgpu as rtm

    cfg = rtm.TrainConfig(**{**cfg_fields, "num_workers": workers, "storage_path": storage,
                             "name": f"startup-{workers}-{variant.replace(' ', '').replace(',', '-')}"})
    started = time.time()
    if variant != "ray train":
        result = rtm.fit(cfg.replace(runner="local" if variant == "fit, in-process" else "ray"),
                         stream=open(os.devnull, "w"))
        return result.startup["first_step_s"]  # from fit's call, a moment after ``started``
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(storage, "rows.jsonl")
    ray.init(log_to_driver=False)
    try:
        TorchTrainer(hand_written_loop, train_loop_config={"cfg": cfg.to_dict(), "out": out},
                     scaling_config=ScalingConfig(num_workers=workers, use_gpu=cfg.use_gpu),
                     run_config=RunConfig(name=cfg.name, storage_path=storage)).fit()
    finally:
        ray.shutdown()
    with open(out) as f:
        return json.loads(f.readline())["first_step"] - started


def _in_fresh_process(variant: str, cfg_fields: dict, workers: int, whole: bool = False) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as storage:
        call = (f"measure_whole({variant!r}, {cfg_fields!r}, {storage!r})" if whole
                else f"measure({variant!r}, {cfg_fields!r}, {workers}, {storage!r})")
        code = ("import json, sys; from raytrain_mgpu.bench.startup import measure, measure_whole; "
                f"print('RESULT', json.dumps({call}))")
        # a local start is what is measured: not a cluster that RAY_ADDRESS names (fit would join it)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{variant} ({workers} worker(s)) failed: {done.stderr[-2000:]}")
        return float(json.loads(lines[-1][len("RESULT "):]))


def run(cfg_fields: dict, workers: List[int], rounds: int = 1) -> Dict[tuple, List[float]]:
    """``{(variant, workers): [seconds to the first step, per round]}``; the in-process runner for one worker only."""
    measured: Dict[tuple, List[float]] = {}
    for _ in range(rounds):
        for count in workers:
            for variant in VARIANTS:
                if variant == "fit, in-process" and count != 1:
                    continue
                measured.setdefault((variant, count), []).append(_in_fresh_process(variant, cfg_fields, count))
    return measured


def one_worker_row(use_gpu: bool) -> tuple:
    """gpu-report's start-up row, ``(what, figure, command)``: one round with one worker (on one GPU)."""
    measured = run(dict(FIELDS, use_gpu=use_gpu), [1])
    seconds = {variant: statistics.median(measured[(variant, 1)]) for variant in VARIANTS}
    base = seconds["ray train"]
    figure = ", ".join(f"{label} {seconds[variant]:.1f} s ({seconds[variant] / base:.2f}x)"
                       for variant, label in (("fit, in-process", "`fit` in-process"),
                                              ("fit, Ray Train", "`fit` through Ray Train")))
    return (f"start-up: seconds to the first step, 1 worker{' on 1 GPU' if use_gpu else ''}, {FIELDS['model']} on "
            f"{FIELDS['dataset']}", f"{figure}; a hand-written `TorchTrainer` loop {base:.1f} s",
            "raytrain-mgpu bench-startup --num-workers 1" + (" --use-gpu" if use_gpu else ""))


def report(measured: Dict[tuple, List[float]]) -> str:
    lines = [f"{'variant':<18} {'workers':>7} {'first step':>11} {'vs ray train':>13}"]
    for (variant, count), seconds in sorted(measured.items(), key=lambda item: (item[0][1], item[0][0])):
        median = statistics.median(seconds)
        base = measured.get(("ray train", count))
        ratio = f"{median / statistics.median(base):.2f}x" if base else "-"
        lines.append(f"{variant:<18} {count:>7} {median:>9.1f} s {ratio:>13}")
    return "\n".join(lines)


def run_tune(cfg_fields: dict, rounds: int = 1) -> Dict[str, List[float]]:
    """``{variant: [whole seconds, per round]}`` of ``--tune``."""
    measured: Dict[str, List[float]] = {}
    for _ in range(rounds):
        for variant in ("ray train, 1 run", "tune, 3 trials"):
            measured.setdefault(variant, []).append(_in_fresh_process(variant, cfg_fields, 1, whole=True))
    return measured


def report_tune(measured: Dict[str, List[float]]) -> str:
    base = statistics.median(measured["ray train, 1 run"])
    lines = [f"{'call':<18} {'seconds':>8} {'vs ray train':>13}"]
    for variant, seconds in measured.items():
        median = statistics.median(seconds)
        lines.append(f"{variant:<18} {median:>8.1f} {median / base:>12.2f}x")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    workers = parser.add_argument("--num-workers", type=int, nargs="+", default=[1, 2], help="worker counts")
    renamed(parser, workers, "--workers")
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each variant (median)")
    parser.add_argument("--model", default=FIELDS["model"], help="the model (a registry name)")
    parser.add_argument("--dataset", default=FIELDS["dataset"], help="the dataset (a registry name)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--tune", action="store_true", help="whole calls instead: a Tune search of 3 one-worker "
                                                            "trials against one hand-written TorchTrainer run")
    parser.add_argument("--epochs", type=int, default=2, help="--tune: epochs a run")


def run_and_print(args) -> int:
    fields = dict(FIELDS, model=args.model, dataset=args.dataset, use_gpu=args.use_gpu)
    if args.tune:
        print(report_tune(run_tune({**fields, "epochs": args.epochs}, args.rounds)))
        return 0
    print(report(run(fields, args.num_workers, args.rounds)))
    return 0
