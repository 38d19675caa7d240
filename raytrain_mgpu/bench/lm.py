"""``raytrain-mgpu bench-lm``: tokens/s and MFU of LoRA on a small Llama, ``fit`` on 1 and 2 workers against a
plain ``transformers`` + ``peft`` loop in one process.

    raytrain-mgpu bench-lm [--num-workers 1 2] [--ingest loader ray_data] [--batch-size 16] [--seq-len 128]
                           [--max-steps 40] [--epochs 5] [--rounds 2] [--cpus N]

What a user brings, made first in a temporary folder with no network (``bench/_lm_materials.py``): a Llama built
from a ``LlamaConfig`` (4 layers of hidden 256, 3.2 M parameters) with random weights, saved by ``save_pretrained``; a
byte-level BPE tokenizer of 512 tokens trained with ``tokenizers`` on the text and saved beside it by
``transformers``; and the text: Python's own help pages (``pydoc_data.topics``, cut into documents at blank lines)
as Parquet, ``train/`` holding the documents that fill ``--max-steps / --epochs`` steps of ``--batch-size`` blocks
of ``--seq-len`` tokens, ``test/`` a few more. For ``--ingest ray_data``, the same text tokenized once into block
Parquet (``raytrain-mgpu data tokenize``: ``data/lm_tokenize.py``).

Then, in each of ``--rounds`` rounds (the runs in an order rotated from round to round), on that folder, text,
global batch and number of steps, AdamW at lr 1e-3 over LoRA adapters (r 8, alpha 16, on ``q_proj`` and
``v_proj``), float32:

- ``plain`` (the baseline): what a user writes in one process: ``AutoModelForCausalLM.from_pretrained``,
  ``peft.get_peft_model``, the documents tokenized and packed into blocks as ``dataset="text"`` packs them (each
  document's tokens and the EOS, one stream cut every ``seq_len + 1`` tokens), a shuffling ``DataLoader``,
  cross-entropy of the next tokens, backward, step; torch threads: ``--cpus``;
- ``fit``: ``model="hf:<folder>"``, ``dataset="text"``, ``lora={...}``, the default strategy (ddp), for each
  ``--num-workers`` and ``--ingest``, the ``--cpus`` split between the workers (``cpus_per_worker``; under
  ``ray_data`` less one, which Ray Data's read tasks need). One worker on the loader path trains in this process
  (``runner="auto"``), the others on Ray Train's workers; Ray is started once, before the first run, so that its
  own processes weigh on every run alike. A configuration ``fit`` refuses (a ``ValueError`` before training: e.g. a
  stream that would leave Ray Data no CPU) is a row saying why, and is not tried again.

Steady state only: an epoch is ``--max-steps / --epochs`` steps, and the first epoch (model build, first batch,
thread pools) is left out. A run's figure is its median later epoch's: ``fit``'s history's ``tokens_per_s`` (the
epoch's targets, its tokens, over the mean worker's time in steps: ``engine/loop.py``); the baseline's tokens over
its time in the epoch's steps, timed the same way (from asking for the first batch to the last step's end). A row:
the median over rounds, and the ratio to the same round's plain loop (median and range: a shared machine drifts).

Every run is on CPUs (``use_gpu=False``). MFU (``engine/flops.py``): a step's model FLOPs, as ``FlopCounterMode``
counts its forward and backward (``flops_per_step`` of fit's history; the same count on the baseline's model), over
the devices' dense peak. Under LoRA the frozen weights get no weight gradient, so the count is ~4 FLOPs per
parameter a token, not 6; the report prints both. A CPU has no peak in that table, so the rows' MFU is '-' and
their GFLOP/s (the model FLOPs a second) is the figure to hold against the machine's own peak.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from raytrain_mgpu.bench import start_local_ray
from raytrain_mgpu.bench._lm_materials import LLAMA, VOCAB, Setup, prepare, train_blocks

__all__ = ["LORA", "Measured", "run_plain", "fit_config", "run_fit", "rows", "report", "add_arguments",
           "run_and_print"]

COMMAND = "raytrain-mgpu bench-lm"
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
LR = 1e-3
INGESTS = ("loader", "ray_data")
_FLOP_ROWS = 4  # rows of a batch the FLOPs are counted on, scaled to the batch (as engine/observe.py does)


@dataclass
class Measured:
    """One run: per epoch, the tokens and the seconds in steps; the FLOPs of a step; or why it did not run."""

    runner: str
    ingest: str
    workers: int
    cpus_per_worker: int
    tokens: List[float] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    flops_per_step: Optional[float] = None
    note: str = ""

    @property
    def tokens_per_s(self) -> Optional[float]:
        """The median epoch's, of the epochs after the first (the only one where there is one)."""
        if not self.seconds:
            return None
        rates = [t / s for t, s in zip(self.tokens, self.seconds)]
        return statistics.median(rates[1:] or rates)

    @property
    def label(self) -> tuple:
        return self.runner, self.ingest, self.workers


# ----------------------------------------------------------------------------- the runners


def _next_token_loss(outputs, targets):
    import torch.nn.functional as F

    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run_plain(setup: Setup, threads: int) -> Measured:
    """The baseline: a plain transformers + peft loop in this process, timed per epoch as ``fit``'s rows are."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain_mgpu.engine import flops

    measured = Measured("plain", "-", 1, threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(setup.model, dtype=torch.float32)
        model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                                           target_modules=LORA["target_modules"]))
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(train_blocks(setup), batch_size=setup.batch_size, shuffle=True,
                                             drop_last=True)
        x, y = next(iter(loader))
        measured.flops_per_step = (flops.step_flops(model, x[:_FLOP_ROWS], y[:_FLOP_ROWS], _next_token_loss)
                                   * setup.batch_size / _FLOP_ROWS)
        step = 0
        for _ in range(setup.epochs):
            tokens, start = 0, time.perf_counter()
            for x, y in loader:
                loss = _next_token_loss(model(input_ids=x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tokens += y.numel()
                step += 1
                if step >= setup.max_steps:
                    break
            measured.tokens.append(tokens)
            measured.seconds.append(time.perf_counter() - start)
            if step >= setup.max_steps:
                break
    finally:
        torch.set_num_threads(previous)
    return measured


def fit_config(setup: Setup, workers: int, ingest: str, cpus_per_worker: int, storage: str):
    """``fit``'s config for one row; raises ``ValueError`` where ``fit`` refuses it (the row says why)."""
    from raytrain_mgpu.config.train import TrainConfig

    data_root = setup.blocks if ingest == "ray_data" else setup.text
    return TrainConfig(model=f"hf:{setup.model}", dataset="text", data_root=data_root, seq_len=setup.seq_len,
                       lora=dict(LORA), optimizer="adamw", lr=LR, batch_size=setup.batch_size, epochs=setup.epochs,
                       max_steps=setup.max_steps, num_workers=workers, use_gpu=False,
                       cpus_per_worker=cpus_per_worker, ingest=ingest, eval_every_epochs=setup.epochs + 1, seed=0,
                       storage_path=storage, name=f"bench-lm-{ingest}-{workers}")


def run_fit(cfg, measured: Measured) -> Measured:
    """``fit`` of one row; its history's ``tokens_per_s`` and ``training_s`` per epoch fill ``measured``."""
    from raytrain_mgpu.api import fit

    with open(os.devnull, "w") as quiet:
        history = fit(cfg, stream=quiet).history
    measured.tokens = [row["tokens_per_s"] * row["training_s"] for row in history]
    measured.seconds = [row["training_s"] for row in history]
    measured.flops_per_step = history[0].get("flops_per_step")
    return measured


# ----------------------------------------------------------------------------- the table


def rows(rounds: List[List[Measured]], setup: Setup, peak: Optional[float]) -> List[dict]:
    """One row per runner, ingest and worker count over the rounds: the median tokens/s, its model GFLOP/s and
    MFU (None without a peak), and the median and range of the ratios to the same round's plain loop."""
    from raytrain_mgpu.engine.flops import mfu

    runs: Dict[tuple, List[Measured]] = {}
    for measured in rounds:
        for m in measured:
            runs.setdefault(m.label, []).append(m)
    base = {id(measured): next((m.tokens_per_s for m in measured if m.runner == "plain"), None) for measured in rounds}
    round_of = {id(m): id(measured) for measured in rounds for m in measured}
    tokens_per_step = setup.batch_size * setup.seq_len
    table = []
    for ran in runs.values():
        first, done = ran[0], [m for m in ran if m.tokens_per_s is not None]
        row = {"runner": first.runner, "ingest": first.ingest, "workers": first.workers,
               "cpus_per_worker": first.cpus_per_worker, "note": first.note, "rounds": len(done), "tokens_per_s": None,
               "gflops_per_s": None, "mfu": None, "vs_plain": None, "vs_plain_range": None}
        if done:
            row["tokens_per_s"] = statistics.median(m.tokens_per_s for m in done)
            flops = next((m.flops_per_step for m in done if m.flops_per_step is not None), None)
            if flops is not None:
                flops_per_s = flops / tokens_per_step * row["tokens_per_s"]  # every worker's together
                row["gflops_per_s"] = flops_per_s / 1e9
                row["mfu"] = mfu(flops_per_s, 1, 1.0, peak, first.workers)  # a second's FLOPs over the peak's
            ratios = [m.tokens_per_s / base[round_of[id(m)]] for m in done if base[round_of[id(m)]]]
            if ratios:
                row["vs_plain"], row["vs_plain_range"] = statistics.median(ratios), (min(ratios), max(ratios))
        table.append(row)
    return table


HEADER = (f"{'runner':<6} {'ingest':<9} {'workers':>7} {'CPUs':>5} {'tokens/s':>9} {'GFLOP/s':>8} {'MFU':>6} "
          f"{'vs plain':>8}  rounds")


def format_row(row: dict) -> str:
    cpus = f"{row['workers']}x{row['cpus_per_worker']}"
    head = f"{row['runner']:<6} {row['ingest']:<9} {row['workers']:>7} {cpus:>5}"
    if row["tokens_per_s"] is None:
        return f"{head} {row['note']}"
    gflops = "-" if row["gflops_per_s"] is None else f"{row['gflops_per_s']:.1f}"
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    ratio = "-" if row["vs_plain"] is None else f"{row['vs_plain']:.2f}x"
    low, high = row["vs_plain_range"] or (None, None)
    spread = f"  {low:.2f}-{high:.2f}x" if row["rounds"] > 1 and low is not None else ""
    return f"{head} {row['tokens_per_s']:>9,.0f} {gflops:>8} {mfu:>6} {ratio:>8}{spread}"


def report(table: List[dict], peak: Optional[float]) -> str:
    against = (f"MFU: model FLOPs over a dense peak of {peak / 1e12:.1f} TFLOP/s a device" if peak else
               "MFU: '-', no dense peak is known for a CPU (engine/flops.py's table is of GPUs); GFLOP/s is the "
               "model FLOPs a second, to hold against the machine's own peak")
    return "\n".join([HEADER, "-" * len(HEADER), *map(format_row, table),
                      "tokens/s: the median epoch after the first (warm-up) of each run, the median over rounds; "
                      "GFLOP/s: FlopCounterMode's count of a step (forward and backward) times the steps a second; "
                      "vs plain: tokens/s over the same round's plain transformers + peft loop's (median, range)",
                      against])


# ----------------------------------------------------------------------------- the command


def add_arguments(parser) -> None:
    from raytrain_mgpu._cli_options import WordList

    parser.add_argument("--num-workers", type=int, nargs="+", default=[1, 2], metavar="N",
                        help="fit's worker counts, a row each")
    parser.add_argument("--ingest", nargs="+", action=WordList, default=list(INGESTS), metavar="INGEST",
                        help=f"fit's ingests, a row each per worker count: any of {', '.join(INGESTS)} (ray_data "
                             f"reads the text tokenized into block Parquet by data tokenize, and leaves a CPU to "
                             f"Ray Data's tasks)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens a sequence")
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps a run, warm-up included")
    parser.add_argument("--epochs", type=int, default=5, help="epochs the steps are split into (the text written "
                                                              "is one epoch); the first is warm-up, left out")
    parser.add_argument("--rounds", type=int, default=2, help="times every run is repeated, in a rotated order")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                        help="CPUs a run: the baseline's torch threads, split between fit's workers")


def _check(args) -> None:
    unknown = [i for i in args.ingest if i not in INGESTS]
    if unknown or not args.ingest:
        raise ValueError(f"{COMMAND} --ingest {' '.join(args.ingest)}: unknown {unknown or 'empty'}. "
                         f"Valid: {', '.join(INGESTS)}.")
    if args.epochs < 2 or args.max_steps < args.epochs or args.rounds < 1:
        raise ValueError(f"{COMMAND} --epochs {args.epochs} --max-steps {args.max_steps} --rounds {args.rounds}: the "
                         f"first epoch is warm-up, left out, so at least 2 epochs of at least one step each are "
                         f"needed. Set --epochs 2 or more, --max-steps at least --epochs, --rounds 1 or more.")
    outside = [n for n in args.num_workers if n < 1 or n > args.cpus]
    if outside or args.batch_size < max(args.num_workers) or args.batch_size % math.lcm(*args.num_workers):
        raise ValueError(f"{COMMAND} --num-workers {' '.join(map(str, args.num_workers))} --batch-size "
                         f"{args.batch_size} --cpus {args.cpus}: each count must be 1 to --cpus (a CPU a worker at "
                         f"least), and the global batch a multiple of each. Lower --num-workers or change "
                         f"--batch-size.")


def run_and_print(args) -> int:
    _check(args)
    import torch

    from raytrain_mgpu.engine import flops

    peak = flops.peak_flops_per_s(torch.device("cpu"), "32")
    labels = [("plain", "-", 1)] + [("fit", ingest, w) for w in sorted(set(args.num_workers)) for ingest in args.ingest]
    rounds: List[List[Measured]] = []
    ray_started = start_local_ray() if any(w > 1 or i == "ray_data" for _, i, w in labels[1:]) else False
    try:  # Ray is up (or not) for every run alike: its own processes take some of the CPUs
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-lm-") as root:
            setup = prepare(root, args.batch_size, args.seq_len, args.epochs, args.max_steps,
                            "ray_data" in args.ingest)
            print(f"{COMMAND}: LlamaForCausalLM from a LlamaConfig ({LLAMA['num_hidden_layers']} layers, hidden "
                  f"{LLAMA['hidden_size']}, vocabulary {VOCAB}; {setup.parameters / 1e6:.2f} M parameters, random), "
                  f"LoRA r {LORA['r']} alpha {LORA['alpha']} on {'/'.join(LORA['target_modules'])}, AdamW lr {LR:g}, "
                  f"float32; Python's help text, global batch {args.batch_size} x {args.seq_len} tokens, "
                  f"{setup.epochs} epochs of {setup.steps_per_epoch} steps (the first left out), {args.rounds} "
                  f"round(s); {args.cpus} CPUs a run on {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
            for r in range(args.rounds):
                measured: List[Measured] = []
                rounds.append(measured)
                refused = {m.label for done in rounds[:-1] for m in done if m.note}  # a refusal does not change
                for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                    if label not in refused:
                        measured.append(_one_run(setup, label, args.cpus, os.path.join(root, f"round-{r}")))
                        print(f"  round {r + 1}: {format_row(rows([[measured[-1]]], setup, peak)[0])}", flush=True)
    finally:
        if ray_started:
            import ray

            ray.shutdown()
    per_token = next(m.flops_per_step for m in rounds[0] if m.runner == "plain") / (args.batch_size * args.seq_len)
    print(f"\nmodel FLOPs a token: {per_token / 1e6:.1f} M counted (forward + backward; the frozen weights get no "
          f"weight gradient), 6 x parameters = {6 * setup.parameters / 1e6:.1f} M", flush=True)
    print(report(rows(rounds, setup, peak), peak), flush=True)
    return 0


def _one_run(setup: Setup, label: tuple, cpus: int, storage: str) -> Measured:
    """One run of ``label``; a configuration ``fit`` refuses (``ValueError``, before training) is a row saying why,
    a run that fails one saying so (its traceback on stderr): the others still run."""
    runner, ingest, workers = label
    if runner == "plain":
        return run_plain(setup, cpus)
    # Ray Data's read tasks need a CPU beside the workers' (fit refuses a stream that would wait for one)
    cpus_per_worker = max(1, (cpus - (ingest == "ray_data")) // workers)
    row = Measured("fit", ingest, workers, cpus_per_worker)
    try:
        run_fit(fit_config(setup, workers, ingest, cpus_per_worker, storage), row)
    except ValueError as exc:
        row.note = f"skipped: {' '.join(str(exc).split())}"
    except Exception as exc:
        traceback.print_exc()
        row.note = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return row
