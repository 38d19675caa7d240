"""The run-state contract of the one engine (``engine/loop.py``, ``checkpointing/contents.py``), whichever transport
carries it.

One place defines what survives a restart (:class:`RunState`), what a checkpoint's
``meta.json`` holds (:func:`checkpoint_meta`), what one epoch's history row holds
(:func:`epoch_row`), when a run is finished (:meth:`RunState.finished`), and which epoch
is the best and whether the run stops early (:func:`best_row`, :func:`stops_early`). A step
runner adds its own extra keys (the pipeline's, ``pipeline/steps.py``, its partition and
bubble) and a transport its rank's place (Ray Train's workers their node ids); the shared keys are
the same, so a run folder reads the same whoever wrote it. Light on purpose: no torch, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from raytrain_mgpu.config.code import monitor_mode
from raytrain_mgpu.config.factories import code_record
from raytrain_mgpu.config.redact import redact

__all__ = ["RunState", "at_max_steps", "META_KEYS", "EPOCH_KEYS", "checkpoint_meta", "epoch_row", "best_row", "stops_early",
           "metric_columns", "eval_columns", "perplexity_column"]

META_KEYS = ("model", "dataset", "strategy", "epoch", "step", "attempt", "input_shape", "num_classes", "config")
"""Every checkpoint's ``meta.json`` (plus ``format_version``): what it is, how far it got,
the shapes ``TrainResult.load_model()`` builds the model with, and the config (redacted)."""

EPOCH_KEYS = ("epoch", "step", "attempt", "workers", "lr", "train_loss", "train_accuracy", "samples_per_s",
              "training_s", "step_time_s", "data_wait_share", "peak_memory_bytes", "test_loss", "test_accuracy", "devices_per_rank",
              "backend", "gpu_ids_per_rank")
"""Every history row, in this order; ``workers`` is the world size that trained the epoch (an elastic
run's count at the epoch's end, when a resize restarted it part-way); ``samples_per_s`` is training throughput,
the samples over ``training_s``, the time in steps (the Ray Train runner's rows add ``checkpoint_s`` and ``eval_s``,
the epoch's time in checkpoints and evaluation, which training does not include); ``test_*`` are None on epochs without
evaluation, ``*_accuracy`` without an accuracy metric. Other metrics ``X`` follow as ``train_X``, ``test_X``,
then a runner's own keys; a language model's data (``Datasets.seq_len``) adds ``tokens_per_s`` (equal to
``samples_per_s``, which counts targets) and, on evaluated epochs, ``perplexity`` (``val_perplexity``)."""


def at_max_steps(cfg, step: int) -> bool:
    """Whether ``step`` global optimizer steps reach ``cfg.max_steps`` (never without one): the one test of it."""
    return cfg.max_steps is not None and step >= cfg.max_steps


@dataclass
class RunState:
    """What a run resumes from: read from its newest checkpoint, saved in every one."""

    epoch: int = 0            # epochs completed
    step: int = 0             # optimizer steps completed
    attempt: int = 0          # 0 on the first start, +1 for each resume
    history: list = field(default_factory=list)
    checkpoint: Optional[str] = None   # the newest checkpoint (path or URI), None for a new run
    meta: dict = field(default_factory=dict)
    step_in_epoch: int = 0    # steps of the unfinished epoch already trained (a step checkpoint's)

    @classmethod
    def resumed(cls, meta: dict, history: list, checkpoint: Optional[str]) -> "RunState":
        """The state after the checkpoint with ``meta``: the next attempt continues it."""
        return cls(epoch=meta["epoch"], step=meta["step"], attempt=meta.get("attempt", 0) + 1,
                   history=list(history), checkpoint=checkpoint, meta=meta,
                   step_in_epoch=meta.get("step_in_epoch", 0))

    @property
    def partition(self) -> Optional[List[int]]:
        """The pipeline's block counts per stage, if a pipeline wrote the checkpoint."""
        return self.meta.get("partition")

    def finished(self, cfg) -> bool:
        """All ``cfg.epochs`` done, ``cfg.max_steps`` reached, or stopped early (the loops stop on
        any). Early stopping is read from the history under ``cfg``'s rule, so a run stopped
        early is finished, and raising ``early_stopping_patience`` lets it train on."""
        return self.epoch >= cfg.epochs or at_max_steps(cfg, self.step) or stops_early(self.history, cfg)


def _value(row: dict, monitor: str) -> Optional[float]:
    """``row[monitor]``, None on an epoch that did not measure it (``val_*``/``test_*`` between evaluations)."""
    value, split = row.get(monitor), monitor.split("_", 1)[0]
    if value is None and (split not in ("val", "test") or row.get(f"{split}_loss") is not None):
        raise ValueError(f"TrainConfig.monitor={monitor!r} is not in the history of epoch {row.get('epoch')} "
                         f"(keys: {', '.join(k for k, v in row.items() if isinstance(v, (int, float)))}). "
                         f"Set monitor to one of them.")
    return value


def best_row(history: list, monitor: str, mode: str) -> Optional[dict]:
    """The first row with the best ``monitor`` (``mode`` min or max); None before any is measured.
    A later epoch must be strictly better to take its place; NaN is never better."""
    best = None
    for row in history:
        value = _value(row, monitor)
        if value is None or value != value:  # not measured, or NaN
            continue
        if best is None or (value < best[monitor] if mode == "min" else value > best[monitor]):
            best = row
    return best


def _epochs_since_best(history: list, monitor: str, mode: str) -> int:
    """Epochs after the best one that measured ``monitor`` (NaN counts: it did not improve)."""
    best = best_row(history, monitor, mode)
    after = history[history.index(best) + 1:] if best is not None else history
    return sum(1 for row in after if _value(row, monitor) is not None)


def stops_early(history: list, cfg) -> bool:
    """``cfg.early_stopping_patience`` measured epochs in a row without improving ``cfg.monitor``.

    Every data-parallel rank holds the same history (all-reduced metrics), so every rank
    decides the same and they stop after the same epoch."""
    patience = getattr(cfg, "early_stopping_patience", None)
    return patience is not None and _epochs_since_best(history, cfg.monitor, monitor_mode(cfg)) >= patience


def best_record(cfg, history: list) -> dict:
    """``meta.json``'s ``best`` (monitor, mode, epoch, value) and ``stopped_early``; empty without ``monitor``."""
    if getattr(cfg, "monitor", None) is None:
        return {}
    row = best_row(history, cfg.monitor, monitor_mode(cfg))
    best = None if row is None else {"monitor": cfg.monitor, "mode": monitor_mode(cfg), "epoch": row["epoch"],
                                     "value": row[cfg.monitor]}
    return {"best": best, "stopped_early": stops_early(history, cfg)}


def checkpoint_meta(cfg, state: RunState, shape_info: dict, **extra) -> dict:
    """``meta.json`` of the checkpoint after ``state``; ``shape_info``: input_shape, num_classes."""
    return {"model": code_record(cfg.model), "dataset": code_record(cfg.dataset), "strategy": cfg.strategy,
            "epoch": state.epoch,
            "step": state.step, "attempt": state.attempt, **best_record(cfg, state.history), **extra,
            **shape_info, "config": redact(cfg.to_dict())}  # no URI credentials in meta.json


def epoch_row(*, epoch: int, state: RunState, lr: float, loss_sum: float, samples: float, elapsed_s: float,
              steps: int, data_wait_share: float, peak_memory_bytes: list, devices: dict,
              metric_totals: Optional[Mapping[str, Sequence[float]]] = None, correct: Optional[float] = None,
              workers: Optional[int] = None, **extra) -> dict:
    """One epoch's history row from the epoch's sums over every rank.

    ``samples`` counts targets (tokens for a language model); ``elapsed_s`` is the
    epoch's wall time (the mean worker's, for the data-parallel loop); ``devices`` holds
    ``devices_per_rank``, ``backend`` and ``gpu_ids_per_rank``. ``metric_totals``:
    ``{metric: (sum, count)}`` over every rank and device, reported as ``train_<metric>``
    (and ``test_<metric>``, None until evaluated); ``correct`` is short for an accuracy
    whose count is ``samples``. ``train_accuracy``/``test_accuracy`` are in every row (None
    without an accuracy metric, e.g. for regression); other metrics follow the shared keys.
    ``workers``: the processes that trained the epoch (default: one per ``peak_memory_bytes`` entry,
    which the pipeline reports per stage actor).
    """
    totals = dict(metric_totals or {})
    if correct is not None:
        totals.setdefault("accuracy", (correct, samples))
    train = metric_columns("train", totals)
    others = {k: v for k, v in train.items() if k != "train_accuracy"}
    return {
        "epoch": epoch + 1, "step": state.step, "attempt": state.attempt,
        "workers": len(peak_memory_bytes) if workers is None else workers, "lr": lr,
        "train_loss": loss_sum / max(samples, 1), "train_accuracy": train.get("train_accuracy"),
        "samples_per_s": samples / max(elapsed_s, 1e-9), "training_s": elapsed_s,
        "step_time_s": elapsed_s / max(steps, 1),
        "data_wait_share": data_wait_share,
        "peak_memory_bytes": [int(b) for b in peak_memory_bytes],
        "test_loss": None, "test_accuracy": None,
        **devices, **others, **{f"test_{k[len('train_'):]}": None for k in others}, **extra,
    }


def metric_columns(prefix: str, metric_totals: Mapping[str, Sequence[float]]) -> dict:
    """``{prefix_<metric>: sum / count}`` (None for a metric that counted nothing)."""
    return {f"{prefix}_{name}": (total / count if count else None) for name, (total, count) in metric_totals.items()}


def eval_columns(loss_sum: float, samples: float, metric_totals: Mapping[str, Sequence[float]],
                 split: str = "test") -> dict:
    """An evaluation's ``<split>_loss`` and ``<split>_<metric>`` (``split``: ``test`` or ``val``) from its sums
    over every rank and device."""
    return {f"{split}_loss": loss_sum / max(samples, 1), **metric_columns(split, metric_totals)}


def perplexity_column(split: str, loss: float) -> dict:
    """A language model's evaluation (mean token cross-entropy ``loss``): ``perplexity``, exp of the test loss, or
    ``<split>_perplexity`` for another split (``val``); infinite where exp overflows."""
    return {"perplexity" if split == "test" else f"{split}_perplexity": math.exp(loss) if loss < 709 else math.inf}
