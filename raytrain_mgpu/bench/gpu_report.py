"""``raytrain-mgpu gpu-report``: every GPU figure docs/performance.md asks for, from one command.

On a machine with GPUs it runs the GPU-only tests (``pytest -m gpu``, from a source
checkout) and measures, each with ``fit`` on the GPUs Ray finds:

- every strategy with ``use_gpu=True`` for a few steps: finished, seconds a step, peak
  memory per device; ``dp`` vs ``dp_balanced`` vs ``ddp`` on a model with a 1,000-class
  output is seed 001's GPU-0 imbalance (max / min peak over the devices);
- d2l's workload: ResNet-18 (d2l variant) on Fashion-MNIST-shaped data (60,000 x 1x28x28,
  10 classes), batch 256, SGD lr 0.1: seconds per epoch and images/s on 1 and 2 GPUs,
  against a plain PyTorch loop on the same GPU (d2l reports 12.2 s an epoch);
- fp16 (``16-mixed``) and bf16 (``bf16-mixed``) speed-up over fp32 on that workload;
- every pipeline schedule finishing (stages on distinct GPUs);
- start-up: ``raytrain-mgpu bench-startup``'s seconds to the first step with one GPU worker;
- models bigger than one GPU, a transformer LM sharded by ``fsdp`` over up to 4 GPUs: peak
  memory and time a step with ``cpu_offload=True`` and with ``activation_checkpointing=1``, each
  against the plain sharded run, and the time each epoch's checkpoint stalls training.

It prints the rows for the results table (docs/performance.md), each with the device named.

Under emulation (``RAYTRAIN_MGPU_EMULATE_GPUS=N``, no CUDA) the same report runs with
small sizes on the CPU, every row marked "emulated": CI runs it that way so the command
keeps working; those figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch

from raytrain_mgpu._cli_options import WordList
from raytrain_mgpu.engine import devices
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.strategies import STRATEGIES as _REGISTRY
from raytrain_mgpu.strategies import get_strategy

__all__ = ["Row", "run_report", "format_rows", "main"]

COMMAND = "raytrain-mgpu gpu-report"
STRATEGIES = tuple(_REGISTRY)  # every registered strategy, in the registry's order
# The strategy whose schedules the report times: the first registered one that reads ``schedule``.
SCHEDULED = next(name for name, cls in _REGISTRY.items() if "schedule" in cls.options_used)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# The strategy the scale section shards with: the first registered one that reads ``cpu_offload``.
SHARDED = next(name for name, cls in _REGISTRY.items() if "cpu_offload" in cls.options_used)
CHECKOUT = Path(__file__).resolve().parents[2]
"""A source checkout's root (raytrain_mgpu/ and tests/ in it), where the GPU-only tests run from."""


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is: the results table's sizes on GPUs, tiny under emulation."""

    d2l_samples: int
    d2l_epochs: int
    d2l_batch: int
    strategy_steps: int  # an epoch's; a step's time is the second epoch's (the first holds CUDA's warm-up)
    wide_classes: int
    lm_layers: int  # the scale section's transformer LM: blocks, hidden size, tokens a sample, samples a GPU
    lm_hidden: int
    lm_seq: int
    lm_batch: int


# FULL's LM: 12 blocks of hidden 1024 (~150 M parameters, 0.6 GB of fp32 weights, 1.8 GB with AdamW's state).
FULL = Sizes(d2l_samples=60_000, d2l_epochs=3, d2l_batch=256, strategy_steps=20, wide_classes=1000,
             lm_layers=12, lm_hidden=1024, lm_seq=512, lm_batch=8)
QUICK = Sizes(d2l_samples=256, d2l_epochs=1, d2l_batch=64, strategy_steps=2, wide_classes=100,
              lm_layers=2, lm_hidden=32, lm_seq=16, lm_batch=4)


@dataclass
class Row:
    """One line of the results table (docs/performance.md)."""

    what: str
    figure: str
    machine: str
    command: str = COMMAND


def machine() -> str:
    """The device named, as the results table wants it."""
    versions = f"torch {torch.__version__}"
    n = devices.emulated_gpus()
    if n and not torch.cuda.is_available():
        return (f"EMULATED: {n} fake GPU(s) on a {os.cpu_count()}-core CPU ({versions}); "
                f"checks the command, not a GPU figure")
    count = torch.cuda.device_count()
    return f"{count} x {torch.cuda.get_device_name(0)} ({versions}, CUDA {torch.version.cuda})"


def num_gpus() -> int:
    """GPUs to measure on: real ones, else the emulated count; 0 means the report cannot run."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return devices.emulated_gpus()


def require_gpus() -> int:
    gpus = num_gpus()
    if gpus == 0:
        raise ValueError(f"gpu-report needs GPUs: this machine has no CUDA device and {devices.EMULATE_ENV} is "
                         f"not set. Run it on a GPU machine, or set {devices.EMULATE_ENV}=4 to check the command "
                         f"under emulation (its figures are then not GPU figures).")
    return gpus


# ---------------------------------------------------------------------------- measurements


def _fit(cfg: TrainConfig) -> list:
    from raytrain_mgpu.api import fit

    with open(os.devnull, "w") as quiet:
        return fit(cfg, stream=quiet).history


def _steady(history: list, key: str) -> float:
    """Median over the epochs after the first (or the only one)."""
    values = [row[key] for row in history if row.get(key) is not None]
    return statistics.median(values[1:] or values)


def _gib(peaks: list) -> str:
    return "/".join(f"{p / 2**30:.2f}" for p in peaks) + " GiB"


def _strategy_config(name: str, gpus: int, sizes: Sizes, storage: str, schedule: str = "1f1b") -> TrainConfig:
    """A few steps of a wide-output MLP (the output that fills GPU 0 under dp) with ``name``.

    10 blocks (flatten, 8 hidden layers, the classifier): enough for interleaved 1F1B's
    2 chunks on each of 4 stages.
    """
    layout = get_strategy(name).demo_layout(gpus)  # ValueError: too few GPUs
    if "num_stages" in layout:
        layout["schedule"] = schedule
    batch = 64 * layout["num_workers"] * layout.get("num_microbatches", 1)
    return TrainConfig(model="mlp", model_kwargs={"widths": [512] * 8}, dataset="synthetic",
                       input_shape=(1, 28, 28), num_classes=sizes.wide_classes,
                       num_samples=batch * sizes.strategy_steps, strategy=name, use_gpu=True, batch_size=batch,
                       epochs=2, optimizer="sgd", lr=0.01, storage_path=storage, eval_every_epochs=100,
                       name=f"gpu-report-{name}-{schedule}", **layout)


def strategy_rows(gpus: int, sizes: Sizes, storage: str, where: str) -> List[Row]:
    rows = []
    for name in STRATEGIES:
        try:
            cfg = _strategy_config(name, gpus, sizes, storage)
        except ValueError as exc:  # too few GPUs for this strategy's layout
            rows.append(Row(f"strategy `{name}`, use_gpu=True", f"not run: {exc}", where))
            continue
        rows.append(strategy_row(cfg, _fit(cfg), where))
    return rows


def strategy_row(cfg: TrainConfig, history: list, where: str) -> Row:
    """The row of one strategy's run: steps, time a step, peak memory per device and its imbalance."""
    peaks = history[-1]["peak_memory_bytes"]
    imbalance = max(peaks) / max(1, min(peaks))
    return Row(f"strategy `{cfg.strategy}`, use_gpu={cfg.use_gpu}: {cfg.num_workers} worker(s), "
               f"{cfg.num_classes}-class {cfg.model}, batch {cfg.batch_size}",
               f"finished {history[-1]['step']} steps, {_steady(history, 'step_time_s') * 1000:.1f} ms a "
               f"step; peak memory per device {_gib(peaks)} (max/min {imbalance:.2f})", where)


def schedule_rows(gpus: int, sizes: Sizes, storage: str, where: str) -> List[Row]:
    rows = []
    if gpus < 2:
        return [Row("pipeline schedules", "not run: needs 2 GPUs", where)]
    for schedule in SCHEDULES:
        cfg = _strategy_config(SCHEDULED, gpus, sizes, storage, schedule)
        history = _fit(cfg)
        rows.append(Row(f"{SCHEDULED} `{schedule}`, {cfg.num_stages} stages on distinct GPUs, m={cfg.num_microbatches}",
                        f"finished {history[-1]['step']} steps, {_steady(history, 'step_time_s') * 1000:.1f} ms a "
                        f"step", where))
    return rows


def _d2l_config(sizes: Sizes, storage: str, workers: int, precision: str = "32") -> TrainConfig:
    from raytrain_mgpu.planning.auto import ClusterInfo, candidates

    plain = candidates(ClusterInfo((workers,), True))[0]  # the plain model, one worker per GPU (ddp)
    return TrainConfig(model="resnet18", dataset="synthetic", input_shape=(1, 28, 28), num_classes=10,
                       num_samples=sizes.d2l_samples, strategy=plain, num_workers=workers, use_gpu=True,
                       batch_size=sizes.d2l_batch * workers, epochs=sizes.d2l_epochs, optimizer="sgd", lr=0.1 * workers,
                       momentum=0.0, precision=precision, storage_path=storage, eval_every_epochs=100,
                       name=f"gpu-report-d2l-{workers}-{precision}")


def plain_loop_seconds_per_epoch(cfg: TrainConfig) -> float:
    """d2l's own loop on one device (the first GPU; the CPU under emulation), no Ray."""
    from torch.utils.data import DataLoader

    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.models import build_model

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                        pin_memory=device.type == "cuda")
    seconds = []
    for _ in range(cfg.epochs):
        start = time.perf_counter()
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.to(device, non_blocking=True)),
                                                     y.to(device, non_blocking=True))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the epoch ends when the GPU is done
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:] or seconds)


def _epoch_seconds(history: list, cfg: TrainConfig) -> float:
    steps_per_epoch = cfg.num_samples // cfg.batch_size
    return _steady(history, "step_time_s") * steps_per_epoch


def d2l_rows(gpus: int, sizes: Sizes, storage: str, where: str) -> List[Row]:
    shape = f"{sizes.d2l_samples:,} x 1x28x28, batch {sizes.d2l_batch}"
    one = _d2l_config(sizes, storage, 1)
    history = _fit(one)
    fit_s, rate = _epoch_seconds(history, one), _steady(history, "samples_per_s")
    plain_s = plain_loop_seconds_per_epoch(one)
    rows = [Row(f"d2l ResNet-18, Fashion-MNIST-shaped ({shape}), 1 GPU, fp32",
                f"{fit_s:.1f} s/epoch, {rate:,.0f} images/s; plain PyTorch loop {plain_s:.1f} s/epoch "
                f"(fit {plain_s / fit_s:.2f}x its speed; d2l reports 12.2 s/epoch)", where)]
    for precision in ("16-mixed", "bf16-mixed"):
        cfg = _d2l_config(sizes, storage, 1, precision)
        mixed = _steady(_fit(cfg), "samples_per_s")
        rows.append(Row(f"d2l ResNet-18, 1 GPU, precision {precision} vs fp32",
                        f"{mixed:,.0f} vs {rate:,.0f} images/s: {mixed / rate:.2f}x", where))
    if gpus >= 2:
        two = _d2l_config(sizes, storage, 2)
        history2 = _fit(two)
        rate2 = _steady(history2, "samples_per_s")
        rows.append(Row(f"d2l ResNet-18, 2 GPUs (ddp, batch {two.batch_size}, lr {two.lr:g}), fp32",
                        f"{_epoch_seconds(history2, two):.1f} s/epoch, {rate2:,.0f} images/s: {rate2 / rate:.2f}x "
                        f"one GPU", where))
    return rows


SCALE_VOCAB = 1024


def _scale_config(gpus: int, sizes: Sizes, storage: str, **changes) -> TrainConfig:
    """The scale section's run: a transformer LM sharded by ``fsdp`` over up to 4 GPUs, AdamW (the state
    that offload moves), ``sizes.strategy_steps`` steps an epoch, a checkpoint after each of its 3 epochs."""
    workers = min(gpus, 4)
    batch = sizes.lm_batch * workers
    variant = "-".join(f"{k}-{v}" for k, v in sorted(changes.items())) or "plain"
    return TrainConfig(model="transformer_lm", dataset="synthetic_text", input_shape=(sizes.lm_seq,),
                       num_classes=SCALE_VOCAB, num_samples=batch * sizes.strategy_steps,
                       model_kwargs={"num_layers": sizes.lm_layers, "hidden": sizes.lm_hidden, "num_heads": 4},
                       strategy=SHARDED, num_workers=workers, use_gpu=True, batch_size=batch, epochs=3,
                       optimizer="adamw", lr=1e-3, storage_path=storage, eval_every_epochs=100,
                       name=f"gpu-report-scale-{variant}", **changes)


def scale_rows(gpus: int, sizes: Sizes, storage: str, where: str) -> List[Row]:
    """Models bigger than one GPU: what ``cpu_offload`` and ``activation_checkpointing`` save in peak memory per
    device and cost in time a step, each against the same sharded run without it, and the time each
    epoch's checkpoint (sharded: each rank writes its own shards) stalls training."""
    plain_cfg = _scale_config(gpus, sizes, storage)
    plain = _fit(plain_cfg)
    what = (f"`{SHARDED}` on {plain_cfg.num_workers} GPU(s): transformer LM, {sizes.lm_layers} blocks of hidden "
            f"{sizes.lm_hidden}, {sizes.lm_seq} tokens, batch {plain_cfg.batch_size}, AdamW")
    rows = []
    for label, changes in (("cpu_offload=True", {"cpu_offload": True}),
                           ("activation_checkpointing=1", {"activation_checkpointing": 1})):
        rows.append(versus_row(f"{what}: {label} vs without", plain, _fit(_scale_config(gpus, sizes, storage, **changes)),
                               where))
    # The run's last checkpoint is uploaded before fit returns (synchronously): the others are what a run pays.
    stall = statistics.median(row["checkpoint_s"] for row in plain[:-1])
    train = statistics.median(row["training_s"] for row in plain[:-1])
    rows.append(Row(f"{what}: each epoch's checkpoint (sharded, each rank its own shards), the last one left out",
                    f"training stood still {stall * 1000:.0f} ms an epoch ({100 * stall / max(train, 1e-9):.1f} % of "
                    f"its {train:.2f} s in steps)", where))
    return rows


def versus_row(what: str, without: list, with_it: list, where: str) -> Row:
    """Peak memory per device (the largest) and time a step of a run with an option against one without."""
    peak, plain_peak = max(with_it[-1]["peak_memory_bytes"]), max(without[-1]["peak_memory_bytes"])
    step, plain_step = _steady(with_it, "step_time_s"), _steady(without, "step_time_s")
    return Row(what, f"peak memory per device {peak / 2**30:.2f} vs {plain_peak / 2**30:.2f} GiB "
                     f"({peak / max(1, plain_peak):.2f}x); {step * 1000:.1f} vs {plain_step * 1000:.1f} ms a step "
                     f"({step / plain_step:.2f}x)", where)


def gpu_tests_row(where: str, root: Optional[Path]) -> Row:
    """``pytest -m gpu`` from a source checkout; its closing line is the figure."""
    if root is None or not (root / "tests").is_dir():
        return Row("GPU-only tests (`pytest -m gpu`)", "not run: no tests/ folder (run from a source checkout)",
                   where)
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=root, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    return Row("GPU-only tests (`pytest -m gpu`)", (lines[-1].strip("= ") if lines else "no output") +
               ("" if out.returncode in (0, 5) else f" (exit {out.returncode})"), where, "python -m pytest -m gpu")


def startup_rows(where: str) -> List[Row]:
    """``bench-startup``'s one-worker figures, on one GPU (the CPU under emulation): fresh processes, each
    starting a Ray of its own, so none of this process's may be up."""
    from raytrain_mgpu.bench import startup

    what, figure, command = startup.one_worker_row(torch.cuda.is_available())
    return [Row(what, figure, where, command)]


# ---------------------------------------------------------------------------- the command


SECTIONS = {"tests": None, "startup": None, "strategies": strategy_rows, "schedules": schedule_rows,
            "d2l": d2l_rows, "scale": scale_rows}


def run_report(sections=tuple(SECTIONS), quick: Optional[bool] = None, root: Optional[Path] = None,
               on_row: Callable[[Row], None] = lambda row: None) -> List[Row]:
    """Every row of ``sections``; Ray is started here (with the emulated GPUs, if any) unless connected."""
    import ray

    gpus = require_gpus()
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"gpu-report --only {','.join(unknown)}: unknown section(s). Valid: {', '.join(SECTIONS)}.")
    sizes = QUICK if (quick if quick is not None else not torch.cuda.is_available()) else FULL
    where = machine()
    rows: List[Row] = []
    started = False  # a Ray this process started, for the sections that fit through it
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-gpu-report-") as storage:
            for section in sections:
                if section == "tests":
                    new = [gpu_tests_row(where, root)]
                elif section == "startup":
                    if started:  # the measurements start Rays of their own
                        ray.shutdown()
                        started = False
                    new = startup_rows(where)
                else:
                    if not ray.is_initialized():
                        ray.init(log_to_driver=False, **devices.local_ray_init_kwargs())
                        started = True
                    new = SECTIONS[section](gpus, sizes, storage, where)
                for row in new:
                    on_row(row)
                rows += new
    finally:
        if started:
            ray.shutdown()
    return rows


def format_rows(rows: List[Row]) -> str:
    """Markdown rows in the results table's order: what | figure | command | machine."""
    return "\n".join(f"| {r.what} | {r.figure} | `{r.command}` | {r.machine} |" for r in rows)


def add_arguments(parser) -> None:
    parser.add_argument("--only", nargs="+", action=WordList, help=f"sections (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", default=None,
                        help="small sizes (the default under emulation): checks that every part runs")
    parser.add_argument("--out", help="also write the Markdown rows to this file")


def run_and_print(args) -> int:
    sections = tuple(args.only or SECTIONS)
    require_gpus()
    print(f"gpu-report on {machine()}", flush=True)
    rows = run_report(sections, args.quick, CHECKOUT, on_row=lambda row: print(format_rows([row]), flush=True))
    text = "| what | figure | command | machine |\n|---|---|---|---|\n" + format_rows(rows) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print("\ndocs/performance.md rows:\n" + text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_and_print(parser.parse_args(argv))
