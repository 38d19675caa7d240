"""The report of :func:`raytrain_mgpu.planning.compare.compare`: its rows, the loss check, the
recommendation, and its renderings: terminal table, Markdown, Parquet, PNG.

Everything here is pure (no Ray): the tests build reports by hand.

The chart puts throughput (with the speed-up over one device) and per-device peak memory
(max and min, so an unbalanced strategy such as ``dp`` stands out) side by side, one row
per strategy, fastest first, the recommended one highlighted.
"""

from __future__ import annotations

import io
import textwrap
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from raytrain_mgpu.planning.memory import format_bytes

__all__ = ["RunRow", "Recommendation", "CompareReport", "summarize_history", "check_losses", "losses_comparable",
           "recommend", "render_text", "render_markdown", "write_outputs", "draw_chart", "LOSS_RTOL", "REFERENCE"]

MARKDOWN_FILE, PARQUET_FILE, CHART_FILE = "compare.md", "compare.parquet", "compare.png"
LOSS_RTOL = 1e-3
REFERENCE = "1 device"
"""Label of the single-device run every speed-up is measured against."""


@dataclass
class RunRow:
    """One strategy's line of the report."""

    label: str
    strategy: str
    layout: str = ""
    status: str = "ok"                         # ok | skipped | failed
    reason: str = ""
    samples_per_s: Optional[float] = None
    step_time_s: Optional[float] = None
    speedup: Optional[float] = None
    peak_memory_bytes: List[int] = field(default_factory=list)
    estimated_peak_bytes: Optional[int] = None  # busiest device at the configured batch (estimate)
    estimated_min_bytes: Optional[int] = None   # least used device at the configured batch (estimate)
    first_loss: Optional[float] = None          # mean train loss over the first epoch's steps (checked)
    first_steps: Optional[int] = None           # how many steps that is
    train_loss: Optional[float] = None          # mean over the last epoch's steps
    final_loss: Optional[float] = None          # after the last step, on final_split: "val" if there is one, else
    final_split: str = "test"                   # "test" (named in the report)
    loss_agrees: Optional[bool] = None          # first_loss vs the reference's; None: not compared
    max_batch: Optional[int] = None             # largest global batch within the budget
    max_batch_method: str = ""                  # estimate | tried | "" (no budget)
    max_batch_capped: bool = False              # tried up to the whole training split, and it fit
    wall_s: Optional[float] = None
    num_processes: Optional[int] = None         # worker or stage processes the run used
    config: Optional[object] = field(default=None, repr=False)

    @property
    def memory_max(self) -> Optional[int]:
        return max(self.peak_memory_bytes) if self.peak_memory_bytes else None

    @property
    def memory_min(self) -> Optional[int]:
        return min(self.peak_memory_bytes) if self.peak_memory_bytes else None

    @property
    def imbalance(self) -> Optional[float]:
        return self.memory_max / max(1, self.memory_min) if self.peak_memory_bytes else None

    def record(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "config"}, "memory_max_bytes": self.memory_max,
                "memory_min_bytes": self.memory_min, "memory_imbalance": self.imbalance}


@dataclass
class Recommendation:
    strategy: Optional[str]
    label: Optional[str]
    reason: str
    config: Optional[object] = field(default=None, repr=False)

    def line(self) -> str:
        return f"Recommendation: {self.reason}"


@dataclass
class CompareReport:
    """What :func:`compare` found; ``table()`` renders it for a terminal, :func:`write_outputs` as files."""

    title: str
    rows: List[RunRow]
    loss_check: str
    recommendation: Recommendation
    memory_budget_bytes: Optional[int] = None
    paths: dict = field(default_factory=dict)

    def measured(self) -> List[RunRow]:
        return [r for r in self.rows if r.status == "ok"]

    def table(self) -> str:
        return render_text(self)


# ----------------------------------------------------------------------------- pure parts


def summarize_history(history: List[dict], warmup_steps: int) -> dict:
    """Throughput, step time, peaks and losses of the epochs after the warm-up. Each epoch's time is its mean
    step time x its steps; throughput is weighted by time, so a short last epoch counts for what it is."""
    if not history:
        raise ValueError("the run reported no epoch")
    measured, previous = [], 0
    for entry in history:
        steps, previous = entry["step"] - previous, entry["step"]
        if entry["step"] > warmup_steps and steps > 0:
            measured.append((entry, steps, entry["step_time_s"] * steps))
    last = history[-1]  # its final loss on the validation split where there is one: comparing is choosing
    measured = measured or [(last, 1, last["step_time_s"])]  # everything was warm-up: the last epoch, not nothing
    seconds = sum(t for _, _, t in measured)
    peaks = [max(values) for values in zip(*(e["peak_memory_bytes"] for e, _, _ in measured))]
    return {"samples_per_s": sum(e["samples_per_s"] * t for e, _, t in measured) / max(seconds, 1e-12),
            "step_time_s": seconds / sum(s for _, s, _ in measured),
            "peak_memory_bytes": [int(p) for p in peaks],
            "first_loss": history[0]["train_loss"], "first_steps": history[0]["step"],
            "train_loss": last["train_loss"], "final_loss": last.get("val_loss", last.get("test_loss")),
            "final_split": "val" if "val_loss" in last else "test"}


def check_losses(rows: List[RunRow], comparable: bool, why_not: str, rtol: float = LOSS_RTOL,
                 optimizer: str = "") -> str:
    """Mark each measured row's ``loss_agrees`` against the first one; one line saying what was found.

    The loss checked is the mean training loss of the first epoch: every strategy sees the
    same samples from the same weights, so a bug in how one splits the batch or reduces
    gradients shows there at once. Later losses drift apart by rounding alone: fp32 sums
    a batch cut into other pieces in another order, and AdamW's normalised step turns
    those last bits into different updates (in fp64 the same runs agree to 1e-14). The
    spread of the final validation (else test) losses is reported, not checked.
    """
    measured = [r for r in rows if r.status == "ok" and r.first_loss is not None]
    if not comparable or len(measured) < 2:
        return f"losses not compared: {why_not}" if not comparable else "losses not compared: fewer than 2 runs"
    reference = measured[0]
    bad, spread = [], 0.0
    for row in measured:
        diff = abs(row.first_loss - reference.first_loss) / max(abs(reference.first_loss), 1e-12)
        row.loss_agrees, spread = diff <= rtol, max(spread, diff)
        if not row.loss_agrees:
            bad.append(f"{row.label} ({row.first_loss:.6f} vs {reference.first_loss:.6f}, rel. diff {diff:.1e})")
    steps = f"the first {reference.first_steps} steps" if reference.first_steps else "the first epoch"
    if bad:
        return (f"LOSSES DISAGREE over {steps} (> {rtol:g} relative to {reference.label}): {'; '.join(bad)}. "
                f"These strategies compute the same function from the same samples: one of them has a bug.")
    finals = [r.final_loss for r in measured if r.final_loss is not None]
    drift = ""
    if len(finals) > 1 and min(finals) > 0:
        cause = "fp32 rounding, compounded by AdamW" if optimizer == "adamw" else "fp32 rounding"
        drift = f"; the final {_final_split(measured)} losses spread by {max(finals) / min(finals) - 1:.1e} ({cause})"
    return f"losses agree: {len(measured)} runs within {spread:.1e} over {steps} (tolerance {rtol:g}){drift}"


def losses_comparable(cfg, model) -> tuple:
    """``(True, "")`` if every strategy computes the same thing for this model and config."""
    if cfg.precision != "32":
        return False, f"precision={cfg.precision!r} rounds differently per split; use precision='32'"
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            return False, f"the model has BatchNorm ({name}): its statistics depend on each device's share of the batch"
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return False, f"the model has dropout ({name}, p={module.p}): random per process"
    return True, ""


def recommend(rows: List[RunRow], batch_size: int, budget: Optional[int], on_gpu: bool = True) -> Recommendation:
    """The fastest measured strategy that fits the budget at the configured batch and agrees on the loss.

    On CPU a strategy in one process (``dp``, ``dp_balanced``, ``mp``: their "devices" are
    the same CPU) does the work of one device; it can only look faster by noise, so it is
    not recommended over one device.
    """
    measured = [r for r in rows if r.status == "ok" and r.samples_per_s]
    left_out, usable = [], []
    for row in measured:
        if not on_gpu and row.label != REFERENCE and row.num_processes == 1:
            left_out.append(f"{row.label} (one process on CPU: one device's work)")
        elif row.loss_agrees is False:
            left_out.append(f"{row.label} (loss disagrees)")
        elif budget is not None and row.max_batch is not None and row.max_batch < batch_size:
            left_out.append(f"{row.label} (batch {batch_size} does not fit {format_bytes(budget)})")
        else:
            usable.append(row)
    if not usable:
        return Recommendation(None, None, "no strategy ran and fit: " + ("; ".join(left_out) or "none ran"))
    excluded = f"; left out: {', '.join(left_out)}" if left_out else ""
    best, *others = sorted(usable, key=lambda r: r.samples_per_s, reverse=True)
    if best.label == REFERENCE:
        runner = others[0] if others else None
        beat = f" (the best, {runner.label}, reaches {runner.speedup:.2f}x)" if runner and runner.speedup else ""
        return Recommendation(best.strategy, best.label, f"train on one device: no multi-device strategy beat it on this "
                              f"cluster{beat}{excluded}", best.config)
    versus = (f", {100 * (best.samples_per_s / others[0].samples_per_s - 1):.0f}% faster than {others[0].label}"
              if others else "")
    memory = (f", peak {format_bytes(best.memory_max)} per device (max/min {best.imbalance:.2f})"
              if best.peak_memory_bytes else "")
    fits = (f", fits batches up to {best.max_batch} in {format_bytes(budget)}"
            if budget is not None and best.max_batch else "")
    speed = f" = {best.speedup:.2f}x one device" if best.speedup else ""
    return Recommendation(best.strategy, best.label,
                          f"use {best.label} ({best.layout}): {best.samples_per_s:,.0f} samples/s{speed}{versus}"
                          f"{memory}{fits}{excluded}", best.config)


# ----------------------------------------------------------------------------- rendering


def _num(fmt: str) -> Callable:
    return lambda v: "-" if v is None else format(v, fmt)


def _final_split(rows: List[RunRow]) -> str:  # of the final losses (the runs share their data): val or test
    return next((r.final_split for r in rows if r.final_loss is not None), "test")


def _columns(report: CompareReport) -> List[Tuple[str, Callable[[RunRow], str]]]:
    columns = [
        ("strategy", lambda r: r.label),
        ("layout", lambda r: r.layout),
        ("samples/s", lambda r: _num(",.0f")(r.samples_per_s)),
        ("step ms", lambda r: _num(".1f")(None if r.step_time_s is None else 1000 * r.step_time_s)),
        ("speed-up", lambda r: "-" if r.speedup is None else f"{r.speedup:.2f}x"),
        ("mem max", lambda r: format_bytes(r.memory_max)),
        ("mem min", lambda r: format_bytes(r.memory_min)),
        ("max/min", lambda r: _num(".2f")(r.imbalance)),
        ("est. peak", lambda r: format_bytes(r.estimated_peak_bytes)),
        ("loss ep. 1", lambda r: _num(".5f")(r.first_loss) + (" !" if r.loss_agrees is False else "")),
        (f"{_final_split(report.rows)} loss", lambda r: _num(".5f")(r.final_loss)),
    ]
    if report.memory_budget_bytes is not None:
        columns.append((f"max batch @{format_bytes(report.memory_budget_bytes)}",
                        lambda r: "-" if r.max_batch is None else
                        (("≥" if r.max_batch_capped else "") + f"{r.max_batch}"
                         + (" (tried)" if r.max_batch_method == "tried" else "") if r.max_batch else "none fits")))
    return columns


def _not_run(report: CompareReport) -> List[str]:
    return [f"{r.label}: {r.status}: {r.reason}" for r in report.rows if r.status != "ok"]


def render_text(report: CompareReport) -> str:
    """The terminal table, then what did not run, the loss check and the recommendation."""
    columns = _columns(report)
    rows = [[fmt(r) for _, fmt in columns] for r in report.measured()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, (h, _) in enumerate(columns)]

    def line(cells: List[str]) -> str:  # strategy and layout left-aligned, numbers right
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [report.title, line([h for h, _ in columns]), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    out += [f"not run: {item}" for item in _not_run(report)]
    out += [report.loss_check, report.recommendation.line()]
    return "\n".join(out)


def render_markdown(report: CompareReport) -> str:
    columns = _columns(report)
    out = [f"### {report.title}", "", "| " + " | ".join(h for h, _ in columns) + " |",
           "|" + "|".join("---" if i < 2 else "---:" for i in range(len(columns))) + "|"]
    out += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in report.measured()]
    out.append("")
    out += [f"- not run: {item}" for item in _not_run(report)]
    out += [f"- {report.loss_check}", "", f"**{report.recommendation.line()}**"]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- chart


def _memory_unit(values: List[float]) -> Tuple[str, float]:
    top = max(values or [1.0])
    return ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)


def _memory_panel(ax, rows: list, highs: List[Optional[float]], lows: List[Optional[float]], title: str,
                  budget: Optional[int], notes: List[str]) -> None:
    """Max and min bars per strategy (one pair per row), with the budget as a dashed line."""
    values = [v for v in highs + lows if v] + ([budget] if budget else [])
    unit, scale = _memory_unit(values)
    y = range(len(rows))
    high = [(v or 0) / scale for v in highs]
    ax.barh([v + 0.16 for v in y], high, height=0.3, color="#c44e52", label="busiest device (max)")
    ax.barh([v - 0.16 for v in y], [(v or 0) / scale for v in lows], height=0.3, color="#f4a6a6",
            label="least used device (min)")
    for yi, value, note in zip(y, high, notes):
        ax.text(value, yi + 0.16, f" {note}", va="center", fontsize=8)
    if budget:
        ax.axvline(budget / scale, color="black", ls="--", lw=1, label=f"budget {format_bytes(budget)}")
    ax.set_xlim(0, max(high + ([budget / scale] if budget else []) + [1e-9]) * 1.45)
    ax.set_xlabel(f"{unit} per device")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09 - 0.5 / max(len(rows), 1) ** 0.5 * 0.3), ncol=3,
              fontsize=7, frameon=False)


def draw_chart(report: CompareReport) -> bytes:
    """A PNG: throughput (speed-up annotated), measured and estimated per-device memory (max/min)."""
    # late: picks matplotlib's Agg backend, which must come before pyplot, when a chart is drawn (not on import)
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # late: see above

    rows = sorted(report.measured(), key=lambda r: r.samples_per_s or 0)  # fastest at the top
    best = report.recommendation.label
    reference = next((r for r in rows if r.speedup is not None and abs(r.speedup - 1) < 1e-12), None)
    fig, (ax_speed, ax_mem, ax_est) = plt.subplots(
        1, 3, figsize=(16, 2.8 + 0.6 * max(len(rows), 1)), sharey=True, gridspec_kw={"width_ratios": [1.2, 1, 1]})
    y = list(range(len(rows)))
    colors = ["#2a9d55" if r.label == best else "#8c8c8c" if r is reference else "#4c72b0" for r in rows]
    speeds = [r.samples_per_s or 0 for r in rows]
    ax_speed.barh(y, speeds, color=colors, height=0.6)
    for yi, row in zip(y, rows):
        note = f" {row.samples_per_s:,.0f}/s" + (f"  {row.speedup:.2f}x" if row.speedup else "")
        ax_speed.text(row.samples_per_s or 0, yi, note, va="center", fontsize=9)
    if reference is not None:
        ax_speed.axvline(reference.samples_per_s, color="#555555", ls=":", lw=1)
    ax_speed.set_yticks(y, [f"{r.label}\n({r.layout})" for r in rows], fontsize=9)
    ax_speed.set_xlim(0, max(speeds or [1]) * 1.4)
    ax_speed.set_xlabel("samples/s (dotted line: one device; green: recommended)")
    ax_speed.set_title("Throughput and speed-up over one device", fontsize=10)

    on_gpu = any(r.config is not None and r.config.use_gpu for r in rows)
    _memory_panel(ax_mem, rows, [r.memory_max for r in rows], [r.memory_min for r in rows],
                  "Measured peak per device" + ("" if on_gpu else " (process RSS on CPU)"),
                  report.memory_budget_bytes if on_gpu else None,
                  [f"max/min {r.imbalance:.2f}" if r.imbalance else "" for r in rows])
    batch = rows[0].config.batch_size if rows and rows[0].config is not None else None
    _memory_panel(ax_est, rows, [r.estimated_peak_bytes for r in rows], [r.estimated_min_bytes for r in rows],
                  f"Estimated per device at batch {batch}" if batch else "Estimated per device",
                  report.memory_budget_bytes,
                  [(f"max batch {r.max_batch}" if r.max_batch else "none fits") if r.max_batch is not None else ""
                   for r in rows])
    for ax in (ax_speed, ax_mem, ax_est):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", alpha=0.3)

    fig.suptitle(textwrap.shorten(report.title, 200), fontsize=10, y=0.995)
    foot = [(report.recommendation.line(), "#1a6b3c", "bold"),
            (report.loss_check, "#b00000" if "DISAGREE" in report.loss_check else "#222222", "normal")]
    foot += [(f"not run: {item}", "#555555", "normal") for item in _not_run(report)]
    for i, (text, color, weight) in enumerate(reversed(foot)):
        fig.text(0.01, 0.01 + 0.03 * i * 4 / max(fig.get_size_inches()[1], 1), textwrap.shorten(text, 230),
                 fontsize=8, color=color, weight=weight, va="bottom")
    fig.tight_layout(rect=(0, 0.02 + 0.13 * len(foot) / max(fig.get_size_inches()[1], 1), 1, 0.96))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- files


def _write(path: str, data: bytes) -> None:
    """Temporary name, then rename: a crash mid-write leaves the old file or none, never half."""
    fs, inner = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), str(Path(path)))
    fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
    tmp = f"{inner}.tmp-{uuid.uuid4().hex[:12]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, inner)


def write_outputs(report: CompareReport, out_dir: str) -> dict:
    """``compare.md``, ``compare.parquet`` (one row per strategy, skipped ones too) and ``compare.png``."""
    base = out_dir.rstrip("/")
    paths = {"markdown": f"{base}/{MARKDOWN_FILE}", "parquet": f"{base}/{PARQUET_FILE}", "chart": f"{base}/{CHART_FILE}"}
    _write(paths["markdown"], render_markdown(report).encode())
    table = pa.Table.from_pylist([row.record() for row in report.rows])
    table = table.replace_schema_metadata({"title": report.title, "loss_check": report.loss_check,
                                           "recommendation": report.recommendation.line()})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    _write(paths["parquet"], buffer.getvalue())
    _write(paths["chart"], draw_chart(report))
    return paths

