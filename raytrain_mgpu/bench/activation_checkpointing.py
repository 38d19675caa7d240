"""What activation checkpointing saves and costs: a transformer LM's step with and without it.

    raytrain-mgpu bench-checkpointing [--layers 6] [--hidden 64] [--seq-len 128] [--batch-size 64] [--steps 10]
                                      [--rounds 3]

In this process, one torch thread, rounds alternating the two: per variant (``activation_checkpointing``
0 and 1), the memory the forward leaves allocated for the backward (glibc's bytes in use after the forward
less before it: one thread allocates from the main arena), the time of a training step (forward, backward,
SGD step; median), and the memory estimate's figure for the same batch (``ModelProfile.activations``, an
upper bound). The ratios are checkpointed over plain.
"""

from __future__ import annotations

import copy
import ctypes
import os
import statistics
import time
from typing import Dict, Optional

from raytrain_mgpu._cli_options import renamed

_VARIANTS = (0, 1)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_in_use() -> Optional[int]:
    """Bytes glibc's allocator has handed out and not had back (main arena and its own mappings); None
    where there is no glibc ``mallinfo2`` (macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def run(layers: int, hidden: int, seq_len: int, batch: int, steps: int, rounds: int) -> Dict[int, dict]:
    import torch
    from torch.nn import functional as F

    from raytrain_mgpu.models import build_model
    from raytrain_mgpu.models.checkpointing import checkpoint_blocks
    from raytrain_mgpu.planning.memory import profile_model

    torch.set_num_threads(1)
    vocab, kwargs = 256, {"num_layers": layers, "hidden": hidden, "num_heads": 4}
    torch.manual_seed(0)
    base = build_model("transformer_lm", (seq_len,), vocab, kwargs)
    x, y = torch.randint(0, vocab, (batch, seq_len)), torch.randint(0, vocab, (batch, seq_len))
    with torch.device("meta"):
        meta = build_model("transformer_lm", (seq_len,), vocab, kwargs)
    measured: Dict[int, dict] = {every: {"step_s": [], "held": [], "estimated": profile_model(
        meta, (seq_len,), checkpoint_every=every).activations() * batch} for every in _VARIANTS}
    for r in range(rounds):
        for every in _VARIANTS if r % 2 == 0 else _VARIANTS[::-1]:
            model = copy.deepcopy(base)
            checkpoint_blocks(model, every)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(steps):
                start, before = time.perf_counter(), heap_in_use()
                loss = F.cross_entropy(model(x), y)
                after = heap_in_use()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                measured[every]["step_s"].append(time.perf_counter() - start)
                if before is not None:
                    measured[every]["held"].append(after - before)
    return measured


def report(measured: Dict[int, dict]) -> str:
    mib = 2**20
    lines = [f"{'activation_checkpointing':<25} {'step ms':>8} {'held MiB':>9} {'estimate MiB':>13}", "-" * 58]
    figures = {}
    for every, m in measured.items():
        step = statistics.median(m["step_s"])
        held = statistics.median(m["held"]) if m["held"] else None
        figures[every] = (step, held, m["estimated"])
        lines.append(f"{every:<25} {step * 1e3:>8.1f} {'n/a' if held is None else f'{held / mib:.0f}':>9} "
                     f"{m['estimated'] / mib:>13.0f}")
    (plain_step, plain_held, plain_est), (step, held, est) = figures[0], figures[1]
    held_ratio = "n/a (no glibc mallinfo2)" if held is None else f"{held / plain_held:.2f}x"
    lines.append(f"checkpointed / plain: step time {step / plain_step:.2f}x, held for the backward {held_ratio}, "
                 f"estimate {est / plain_est:.2f}x")
    return "\n".join(lines)


_OPTIONS = (("--layers", 6, "transformer blocks"), ("--hidden", 64, "hidden size (4 heads)"),
            ("--seq-len", 128, "tokens per sample"), ("--batch-size", 64, "samples per step"),
            ("--steps", 10, "timed steps per variant and round"),
            ("--rounds", 3, "rounds, alternating which variant goes first"))


def add_arguments(parser) -> None:
    added = {flag: parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
             for flag, default, text in _OPTIONS}
    renamed(parser, added["--batch-size"], "--batch")


def run_and_print(args) -> int:
    print(f"activation checkpointing: transformer_lm, {args.layers} blocks, hidden {args.hidden}, {args.seq_len} "
          f"tokens, batch {args.batch_size}, {args.steps} steps x {args.rounds} round(s), 1 torch thread, "
          f"{os.cpu_count()} CPU cores")
    print(report(run(args.layers, args.hidden, args.seq_len, args.batch_size, args.steps, args.rounds)))
    return 0
