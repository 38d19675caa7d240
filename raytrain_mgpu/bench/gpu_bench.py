"""``raytrain-mgpu bench-gpu``: samples/s and MFU of ``fit``, Lightning and a plain PyTorch loop on one GPU.

    raytrain-mgpu bench-gpu [--models resnet18 transformer_lm] [--precisions 32 bf16-mixed]
                            [--runners plain fit fit-ray lightning] [--epochs 3] [--out rows.json]
                            [--profile DIR]

Side by side in one invocation, on the same device, model (same initial weights), data, batch and
optimizer, each model in each precision:

- ``plain``: what a user writes: a ``DataLoader`` over the data in memory, forward under autocast,
  cross-entropy, backward, step;
- ``fit``: ``raytrain_mgpu.fit``, one GPU worker, strategy ``ddp``, ``runner="auto"`` (one worker: in this
  process, no Ray);
- ``fit-ray``: the same with ``runner="ray"``, on a Ray Train worker (Ray is started once, here);
- ``lightning``: Lightning's ``Trainer`` on one device, where ``lightning`` or ``pytorch_lightning`` imports.

The models: torchvision's ResNet-18 at CIFAR size (3x32x32, 10 classes, batch 256, SGD), and the
``transformer_lm`` model on Markov-chain token sequences (``synthetic_text``'s chain; AdamW). Both
datasets are generated up front and held as tensors, so loading is indexing and collating.

A row: samples/s (images or tokens) over the epochs after the first (the first holds CUDA's, cuDNN's
and the allocator's warm-up), the time a step, MFU (``engine/flops.py``: FLOPs of a step counted
by ``FlopCounterMode`` over the device's dense peak for the precision) and the ratio to the plain
loop's samples/s. ``--tiny`` is a CPU smoke run in seconds (no MFU on a CPU); ``--profile DIR``
writes a trace of three steps of each plain loop (``engine/profiling.py``), after its timed epochs.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from raytrain_mgpu._cli_options import WordList, renamed
from raytrain_mgpu.bench import start_local_ray
from raytrain_mgpu.bench._gpu_bench_runners import (Measured, Options, Workload, lightning_module, run_fit,
                                                    run_lightning, run_plain)
from raytrain_mgpu.engine import flops

__all__ = ["Sizes", "FULL", "TINY", "workloads", "flops_per_sample", "measure", "rows", "format_row", "report",
           "add_arguments", "run_and_print", "main"]

COMMAND = "raytrain-mgpu bench-gpu"
MODELS = ("resnet18", "transformer_lm")
RUNNERS = ("plain", "fit", "fit-ray", "lightning")


@dataclass(frozen=True)
class Sizes:
    epochs: int
    image_samples: int  # ResNet-18: images an epoch, batch
    image_batch: int
    lm_samples: int  # the LM: sequences an epoch, batch, and its shape
    lm_batch: int
    lm_seq: int
    lm_vocab: int
    lm_layers: int
    lm_hidden: int
    lm_heads: int


# 100 steps an epoch for each model; FULL's LM: 6 blocks of hidden 512, 23 M parameters in matrix products.
FULL = Sizes(epochs=3, image_samples=25_600, image_batch=256, lm_samples=3_200, lm_batch=32, lm_seq=256,
             lm_vocab=8192, lm_layers=6, lm_hidden=512, lm_heads=8)
TINY = Sizes(epochs=2, image_samples=64, image_batch=16, lm_samples=32, lm_batch=8, lm_seq=16, lm_vocab=64,
             lm_layers=2, lm_hidden=32, lm_heads=2)


def workloads(sizes: Sizes, samples: Optional[int] = None) -> Dict[str, Workload]:
    """The two models at ``sizes``; ``samples`` replaces both models' samples an epoch."""
    lm = {"num_layers": sizes.lm_layers, "hidden": sizes.lm_hidden, "num_heads": sizes.lm_heads}
    return {
        "resnet18": Workload("resnet18", f"torchvision ResNet-18, 3x32x32, 10 classes, batch {sizes.image_batch}, "
                             f"SGD", "images", "torchvision.models:resnet18", {}, (3, 32, 32), 10,
                             samples or sizes.image_samples, sizes.image_batch, "sgd", 0.1),
        "transformer_lm": Workload("transformer_lm", f"transformer_lm {sizes.lm_layers} blocks of hidden "
                                   f"{sizes.lm_hidden}, {sizes.lm_seq} tokens, vocabulary {sizes.lm_vocab}, batch "
                                   f"{sizes.lm_batch}, AdamW", "tokens", "transformer_lm", lm, (sizes.lm_seq,),
                                   sizes.lm_vocab, samples or sizes.lm_samples, sizes.lm_batch, "adamw", 1e-3),
    }


# ----------------------------------------------------------------------------- the command


def flops_per_sample(work: Workload) -> float:
    """FLOPs of one step's forward and backward over its samples (images or tokens), counted on ``meta``."""
    with torch.device("meta"):
        model = work.build()
        if len(work.input_shape) == 1:
            x = torch.randint(work.num_classes, (work.batch, *work.input_shape))
            y = torch.randint(work.num_classes, (work.batch, *work.input_shape))
        else:
            x, y = torch.randn(work.batch, *work.input_shape), torch.randint(work.num_classes, (work.batch,))
    return flops.step_flops(model, x, y, F.cross_entropy) / y.numel()


def _run(runner: str, work: Workload, precision: str, device: torch.device, epochs: int, options: Options,
         storage: str, profile_dir: Optional[str]) -> Measured:
    if runner == "plain":
        return run_plain(work, precision, device, epochs, options, profile_dir)
    if runner in ("fit", "fit-ray"):
        return run_fit(work, precision, device, epochs, options, storage, "auto" if runner == "fit" else "ray")
    if lightning_module() is None:
        return Measured(work.name, precision, runner, [], [], note="not run: neither lightning nor "
                                                                   "pytorch_lightning is installed")
    return run_lightning(work, precision, device, epochs, options)


def measure(works: List[Workload], precisions: List[str], runners: List[str], device: torch.device, epochs: int,
            options: Options, profile_dir: Optional[str] = None,
            on_run: Callable[[Measured], None] = lambda m: None) -> List[Measured]:
    """Every (model, precision, runner), the runners in turn for each; Ray is started here for ``fit-ray``. A run
    that fails is a row that says so (its traceback on stderr): the others still run."""
    import itertools
    import traceback

    measured: List[Measured] = []
    ray_started = "fit-ray" in runners and start_local_ray()
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-gpu-") as storage:
            for work, precision, runner in itertools.product(works, precisions, runners):
                try:
                    run = _run(runner, work, precision, device, epochs, options, storage, profile_dir)
                except Exception as exc:  # one failed run must not lose the others' figures
                    traceback.print_exc()
                    first_line = (str(exc).splitlines() or [""])[0][:120]
                    run = Measured(work.name, precision, runner, [], [],
                                   note=f"failed: {type(exc).__name__}: {first_line}")
                measured.append(run)
                on_run(run)
    finally:
        if ray_started:
            import ray

            ray.shutdown()
    return measured



def rows(measured: List[Measured], works: Dict[str, Workload], peaks: Dict[str, Optional[float]],
         per_sample: Dict[str, float]) -> List[dict]:
    """The table's rows: samples/s, ms a step, MFU (None without a peak) and the ratio to the plain loop."""
    plain = {(m.model, m.precision): m for m in measured if m.runner == "plain" and m.samples}
    out = []
    for m in measured:
        work = works[m.model]
        row = {"model": m.model, "precision": m.precision, "runner": m.runner, "unit": work.unit, "note": m.note,
               "samples": m.samples, "seconds": m.seconds, **m.extra}
        if m.samples:
            samples, seconds = m.steady
            steps = samples / work.step_samples
            base = plain.get((m.model, m.precision))
            row.update(samples_per_s=m.samples_per_s, step_ms=1000 * seconds / steps,
                       mfu=flops.mfu(per_sample[m.model] * work.step_samples, steps, seconds, peaks[m.precision], 1),
                       vs_plain=m.samples_per_s / base.samples_per_s if base else None)
        out.append(row)
    return out


HEADER = (f"{'model':<15} {'precision':<10} {'runner':<9} {'samples/s':>16} {'ms/step':>8} {'MFU':>6} "
          f"{'vs plain':>8}")


def format_row(row: dict) -> str:
    head = f"{row['model']:<15} {row['precision']:<10} {row['runner']:<9}"
    if "samples_per_s" not in row:
        return f"{head} {row['note']}"
    unit = {"images": "img/s", "tokens": "tok/s"}[row["unit"]]
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    ratio = "-" if row["vs_plain"] is None else f"{row['vs_plain']:.2f}x"
    return f"{head} {row['samples_per_s']:>10,.0f} {unit} {row['step_ms']:>8.2f} {mfu:>6} {ratio:>8}"


def report(table: List[dict]) -> str:
    return "\n".join([HEADER, "-" * len(HEADER), *map(format_row, table),
                      "samples/s: over the epochs after the first; MFU: FLOPs of a step (FlopCounterMode) over the "
                      "device's dense peak for the precision; vs plain: samples/s over the plain loop's"])


def _device(name: Optional[str]) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"bench-gpu --device {name}: this machine has no CUDA device. Run it on a GPU machine, or "
                         f"pass --device cpu --tiny for a smoke run.")
    return device


def _choices(chosen: List[str], valid: tuple, option: str) -> List[str]:
    unknown = [c for c in chosen if c not in valid]
    if unknown or not chosen:
        raise ValueError(f"bench-gpu {option} {' '.join(chosen)}: unknown {unknown or 'empty'}. "
                         f"Valid: {', '.join(valid)}.")
    return list(chosen)


def _flops_text(value: float) -> str:
    scale, prefix = next((s, p) for s, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")) if value >= s
                         or s == 1)
    return f"{value / scale:.3g} {prefix}FLOPs"


def machine(device: torch.device, threads: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    return f"{name} (torch {torch.__version__}{cuda}), {threads} torch thread(s) a runner"


def add_arguments(parser) -> None:
    lists = {"--models": (MODELS, list(MODELS)), "--precisions": (flops.PRECISIONS, ["32", "bf16-mixed"]),
             "--runners": (RUNNERS, list(RUNNERS))}  # words apart or joined by commas
    for flag, (valid, default) in lists.items():
        parser.add_argument(flag, nargs="+", action=WordList, default=default, metavar=flag[2:-1].upper(),
                            help=f"any of: {', '.join(valid)}")
    parser.add_argument("--epochs", type=int, help=f"epochs a run, the first is warm-up (default {FULL.epochs}; "
                                                   f"--tiny {TINY.epochs})")
    samples = parser.add_argument("--num-samples", type=int, help="training samples an epoch, both models (images, "
                                                                  "sequences)")
    renamed(parser, samples, "--samples")
    parser.add_argument("--device", help="cuda (the default where there is one) or cpu")
    parser.add_argument("--tiny", action="store_true", help="small models and data: a CPU smoke run in seconds")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                        help="torch threads of each runner (fit: cpus_per_worker)")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes, every runner")
    parser.add_argument("--compile", nargs="?", const=True, default=False, choices=["blocks"],
                        help="torch.compile the model, every runner; --compile blocks: each block in place "
                             "(TrainConfig.compile='blocks': transformer_lm only, ResNet-18 has no blocks)")
    parser.add_argument("--channels-last", action="store_true", help="channels-last images and model, every runner")
    parser.add_argument("--profile", metavar="DIR", help="write a trace of 3 steps of each plain loop under DIR")
    parser.add_argument("--out", help="also write the rows as JSON to this file (rewritten after each run)")


def run_and_print(args) -> int:
    sizes = TINY if args.tiny else FULL
    device, epochs = _device(args.device), args.epochs or sizes.epochs
    if epochs < 1 or (args.num_samples is not None and args.num_samples < 1):
        raise ValueError(f"bench-gpu --epochs {epochs} --num-samples {args.num_samples}: both must be positive (the "
                         f"first epoch is warm-up: 2 or more epochs give a steady figure).")
    all_works = workloads(sizes, args.num_samples)
    works = [all_works[name] for name in _choices(args.models, MODELS, "--models")]
    if args.compile == "blocks" and any(w.name == "resnet18" for w in works):
        raise ValueError("bench-gpu --compile blocks compiles each block, and torchvision's ResNet-18 has none (it is "
                         "no nn.Sequential and has no blocks()). Add --models transformer_lm, or --compile for the "
                         "whole model.")
    precisions = _choices(args.precisions, flops.PRECISIONS, "--precisions")
    runners = _choices(args.runners, RUNNERS, "--runners")
    options = Options(args.compile, args.channels_last, args.loader_workers, args.threads)
    torch.set_num_threads(options.threads)  # the plain loop's and Lightning's, as fit's worker gets cpus_per_worker
    peaks = {p: flops.peak_flops_per_s(device, p) for p in precisions}
    per_sample = {w.name: flops_per_sample(w) for w in works}
    print(f"{COMMAND} on {machine(device, options.threads)}; {epochs} epochs a run", flush=True)
    for w in works:
        print(f"  {w.name}: {w.label}; {w.samples:,} samples an epoch; {_flops_text(per_sample[w.name])} "
              f"a{'n image' if w.unit == 'images' else ' token'} (forward + backward)", flush=True)
    print("  dense peak a device: " + ", ".join(f"{p}: " + (f"{v / 1e12:,.1f} TFLOP/s" if v else "none (no MFU)")
                                                 for p, v in peaks.items()) +
          f" (FP32 matrix products on TF32: {flops.tf32_matmuls()})", flush=True)
    done: List[Measured] = []

    def on_run(run: Measured) -> None:
        done.append(run)
        table = rows(done, all_works, peaks, per_sample)
        print(format_row(table[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": COMMAND, "args": vars(args), "machine": machine(device, options.threads),
                           "epochs": epochs, "sizes": asdict(sizes), "peaks": peaks, "flops_per_sample": per_sample,
                           "rows": table}, f, indent=1, default=str)

    measured = measure(works, precisions, runners, device, epochs, options, args.profile, on_run)
    print("\n" + report(rows(measured, all_works, peaks, per_sample)), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_and_print(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
