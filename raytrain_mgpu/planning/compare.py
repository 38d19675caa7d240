"""``compare``: the same model, data, global batch and seed under each strategy, side by side.

    raytrain-mgpu compare --model lenet --dataset digits --memory-budget 64MiB
    report = rtm.compare(cfg, strategies=["ddp", "dp", "mp", "pipeline"])

One Ray connection for all runs; the strategies run one after another, each a fresh run
(its own name under ``<storage>/compare-<time>/runs``) laid out on the devices the
cluster has (:func:`raytrain_mgpu.planning.auto.plan_config`), in every layout ``auto`` tries for it (``fsdp``
also with tensor groups of a node's devices, its ``auto_variants``: one row each, with its memory estimate);
those that cannot run here are reported with the reason. Each run trains ``warmup_steps`` and then ``steps`` optimizer
steps. The worker loop reports per epoch, so the warm-up is rounded up to whole epochs
and throughput is measured over the epochs after it.

The speed-up is over one device: ``ddp`` with one worker (the plain model, one process,
the whole global batch). Peak memory is the CUDA allocator's peak on GPU and each
process's peak RSS on CPU. The largest batch within a per-device memory budget comes
from the estimate in :mod:`raytrain_mgpu.planning.memory`, or, with ``batch_search="try"`` (the
default on GPU), from short trial runs that start at the estimate.

Strategies that compute the same function of the same samples (every built-in one, for a
model without BatchNorm or dropout, in fp32) must have the same loss over the first
epoch; the report flags any that differ by more than ``LOSS_RTOL`` (later losses drift
apart by rounding alone: see :func:`raytrain_mgpu.planning.compare_report.check_losses`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import Callable, List, Optional, Sequence

from raytrain_mgpu.config.factories import code_name
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.planning.auto import (ClusterInfo, candidates, cluster_info, describe_layout, layout_label, layouts,
                                         plan_config)
from raytrain_mgpu.planning.auto_devices import resolve_auto_devices
from raytrain_mgpu.planning.compare_report import (LOSS_RTOL, REFERENCE, CompareReport, Recommendation, RunRow,
                                          check_losses, losses_comparable, recommend, summarize_history,
                                          write_outputs)
from raytrain_mgpu.config.units import parse_bytes
from raytrain_mgpu.data import build_datasets, check_data
from raytrain_mgpu.driver.cluster import check_placeable, keep_ray_started
from raytrain_mgpu.models import build_model_shapes
from raytrain_mgpu.planning.memory import (batch_granularity, device_memory, format_bytes, largest_batch,
                                  profile_config)
from raytrain_mgpu.strategies import strategy_names
from raytrain_mgpu.strategies.plan import build_plan

logger = logging.getLogger(__name__)

__all__ = ["compare", "CompareReport", "RunRow", "Recommendation", "LOSS_RTOL"]


# ----------------------------------------------------------------------------- planning


def _check_arguments(strategies: Optional[Sequence[str]], steps: int, warmup_steps: int,
                     batch_search: Optional[str]) -> List[str]:
    valid = strategy_names()
    names = list(strategies) if strategies is not None else valid
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"compare: strategies={list(names)} has unknown name(s) {unknown}. Valid names: "
                         f"{', '.join(valid)}." if unknown else "compare: strategies=[] is empty. Name at "
                         "least one, or pass None for all.")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"compare: steps={steps!r} must be a positive integer (measured optimizer steps). Use e.g. 20.")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"compare: warmup_steps={warmup_steps!r} must be an integer >= 0. Use e.g. 5.")
    if batch_search not in (None, "estimate", "try"):
        raise ValueError(f"compare: batch_search={batch_search!r} must be 'estimate' or 'try'.")
    return list(dict.fromkeys(names))


def _run_settings(planned, num_train: int, steps: int, warmup_steps: int, storage: str, label: str):
    """``planned`` set up to stop after the rounded warm-up plus ``steps``; returns (config, warm-up steps)."""
    per_epoch = build_plan(planned, num_train).steps_per_epoch  # ValueError: no full step in the split
    warm = math.ceil(warmup_steps / per_epoch) * per_epoch
    total = warm + steps
    epochs = max(planned.epochs, math.ceil(total / per_epoch))
    name = re.sub(r"[^\w.-]+", "-", label)  # "fsdp, tensor_parallel_size=2": fsdp-tensor_parallel_size-2
    return planned.replace(name=name, storage_path=storage, max_steps=total, epochs=epochs, max_failures=0,
                           num_checkpoints_to_keep=1, eval_every_epochs=epochs + 1), warm


def _plan(cfg, names: List[str], info: ClusterInfo) -> List[RunRow]:
    """One row per run: the single-device reference first, then each name in each layout ``auto`` tries for it
    (:func:`~raytrain_mgpu.planning.auto.layouts`: its own, then e.g. ``fsdp``'s tensor groups), laid out on
    ``info``."""
    from dataclasses import replace

    one_device = replace(info, devices_per_node=(1,))
    first = candidates(one_device)[0]  # what auto runs on one device: the plain model
    reference = plan_config(cfg, first, one_device)
    rows = [RunRow(REFERENCE, first, describe_layout(reference), config=reference, num_processes=1)]
    for name in names:
        for variant in layouts(cfg, name, info):
            row = _row(cfg, name, variant, info, reference)
            if variant and row.status == "skipped" and any(r.strategy == name and r.reason == row.reason for r in rows):
                continue  # e.g. a model without a tensor-parallel plan: said once, not once per group size
            rows.append(row)
    return rows


def _row(cfg, name: str, variant: dict, info: ClusterInfo, reference) -> RunRow:
    """Strategy ``name`` in layout ``variant`` on ``info``: a row to run, or skipped with the reason."""
    label = layout_label(name, variant)
    try:
        candidate = plan_config(cfg, name, info, variant)
    except ValueError as exc:
        return RunRow(label, name, status="skipped", reason=str(exc))
    if candidate == reference:  # e.g. ddp laid out on one worker
        return RunRow(label, name, describe_layout(candidate), status="skipped",
                      reason=f"the same run as '{REFERENCE}'")
    return RunRow(label, name, describe_layout(candidate), config=candidate,
                  num_processes=build_plan(candidate).num_processes)


def _skip_unplaceable(rows: List[RunRow], use_gpu: bool, capacity) -> None:
    """Mark the rows the cluster can never place as skipped (``capacity``: what it can have,
    so an autoscaling cluster with no GPU node up yet still runs them)."""
    for row in rows:
        if row.config is None:
            continue
        plan = build_plan(row.config)
        try:
            check_placeable(list(plan.bundles), use_gpu, f"strategy={row.strategy!r} ({row.layout})", capacity,
                            labels=row.config.label_selector, group_size=plan.tensor_group_size,
                            groups_may_span=row.config.tensor_parallel_across_nodes)
        except ValueError as exc:
            row.status, row.reason, row.config = "skipped", str(exc), None


def _estimate_columns(rows: List[RunRow], profile, budget: Optional[int]) -> None:
    """Estimated peak at the configured batch, and (with a budget) the largest batch by the estimate.

    Raises ValueError before anything runs when the budget fits no strategy at any batch.
    """
    smallest = []
    for row in rows:
        if row.config is None:
            continue
        try:
            devices = device_memory(row.strategy, row.config, profile)
        except ValueError as exc:  # a user strategy without a memory model
            logger.debug("no estimate for %s: %s", row.strategy, exc)
            continue
        row.estimated_peak_bytes = max(d.at(row.config.batch_size) for d in devices)
        row.estimated_min_bytes = min(d.at(row.config.batch_size) for d in devices)
        if budget is None:
            continue
        granularity = batch_granularity(row.strategy, row.config)
        row.max_batch = largest_batch(lambda b: max(d.at(b) for d in devices) <= budget, granularity)
        row.max_batch_method = "estimate"
        smallest.append((max(d.at(granularity) for d in devices), row.label, granularity))
    if smallest and all(row.max_batch == 0 for row in rows if row.max_batch is not None):
        need, label, granularity = min(smallest)
        raise ValueError(
            f"compare: memory_budget_bytes={budget} ({format_bytes(budget)} per device) is too small for any "
            f"batch: the smallest need is {need} bytes ({format_bytes(need)}, {label} at global batch "
            f"{granularity}). Raise the budget to at least {format_bytes(need)}.")


# ----------------------------------------------------------------------------- running


def compare(cfg, strategies: Optional[Sequence[str]] = None, steps: int = 20, warmup_steps: int = 5,
            memory_budget_bytes: Optional[int] = None, out_dir: Optional[str] = None, *,
            storage_path: Optional[str] = None, batch_search: Optional[str] = None,
            stream=None, fit: Callable) -> CompareReport:
    """Run ``cfg`` under each strategy (default: all that can run here) and report side by side.

    ``fit`` trains one config (``raytrain_mgpu.api.fit``: users call ``raytrain_mgpu.compare``,
    which passes it; planning sits below the api and never imports it).

    ``memory_budget_bytes``: per-device budget for the largest-batch column, bytes or a
    size such as ``"24GiB"`` (default: ``cfg.memory_budget_bytes``, else the GPU's memory;
    none on CPU). ``out_dir``: where the Markdown, Parquet and PNG go
    (default ``<storage_path>/compare-<time>``). ``stream``: where each run's progress
    lines go (default: nowhere).
    """
    # late: looked up at the call (a test replaces connect)
    from raytrain_mgpu.driver.cluster import connect, read_capacity

    names = _check_arguments(strategies, steps, warmup_steps, batch_search)
    cfg, devices_line = resolve_auto_devices(cfg)  # use_gpu/num_workers "auto": the GPUs found, the layout on them
    if devices_line and stream is not None:
        stream.write(f"devices: {devices_line}\n")
    if isinstance(cfg.num_workers, tuple):  # a range would compare whatever count the cluster gave each run
        raise ValueError(f"compare: TrainConfig.num_workers={cfg.num_workers} is an elastic range; strategies are "
                         f"compared at one worker count. Pass num_workers={cfg.num_workers[1]} (or the count to compare).")
    if memory_budget_bytes is None:
        memory_budget_bytes = getattr(cfg, "memory_budget_bytes", None)
    if memory_budget_bytes is not None:
        memory_budget_bytes = parse_bytes(memory_budget_bytes, "compare: memory_budget_bytes")
    # Everything that can fail without Ray fails here: the model, the data, the budget (CPU).
    profile = profile_config(cfg)
    num_train = len(build_datasets(cfg.data).train)
    info = None if cfg.use_gpu else cluster_info(cfg)
    rows = _prepare(cfg, names, info, profile, memory_budget_bytes) if info else None
    root = f"{(storage_path or cfg.storage_path).rstrip('/')}/compare-{time.strftime('%Y%m%d-%H%M%S')}"
    started = connect(cfg.address, cfg.verbose, local_has_gpu_check=cfg.use_gpu)
    sink = stream or open(os.devnull, "w")
    try:
        capacity = read_capacity()  # one reading for the layouts and the placement checks
        if info is None:
            info = cluster_info(cfg, capacity)
            rows = _prepare(cfg, names, info, profile, memory_budget_bytes)
        _skip_unplaceable(rows, cfg.use_gpu, capacity)
        budget = memory_budget_bytes or info.device_memory_bytes
        warm = 0
        for row in rows:
            if row.config is not None:
                warm = _run(row, num_train, steps, warmup_steps, f"{root}/runs", sink, fit)
        if budget is not None and (batch_search or ("try" if cfg.use_gpu else "estimate")) == "try":
            for row in rows:
                if row.status == "ok":
                    _try_max_batch(row, budget, num_train, f"{root}/runs", sink, fit)
    finally:
        if stream is None:
            sink.close()
        keep_ray_started(started)  # a fit or compare after this one finds it up
    report = _finish(cfg, rows, info, budget, steps, warm, profile)
    report.paths = _write_report(report, out_dir or root)
    logger.info("compare: %s", report.recommendation.line())
    return report


def _write_report(report: CompareReport, out_dir: str) -> dict:
    """``write_outputs``, with URI credentials kept out of the paths shown and of its errors."""
    try:
        return redact(write_outputs(report, out_dir))
    except (OSError, ValueError) as exc:
        # pyarrow's message holds the URI as given, credentials included; `from None` because
        # the chained original would print them again in the traceback.
        kind = ValueError if isinstance(exc, ValueError) else OSError
        raise kind(f"compare: writing the report to {redact(out_dir)!r} failed: {redact(str(exc))}. Check "
                   f"out_dir (or storage_path) and that this machine may write there.") from None


def _prepare(cfg, names, info: ClusterInfo, profile, budget: Optional[int]) -> List[RunRow]:
    rows = _plan(cfg, names, info)
    _estimate_columns(rows, profile, budget or info.device_memory_bytes)
    return rows


def _run(row: RunRow, num_train: int, steps: int, warmup_steps: int, storage: str, stream, fit: Callable) -> int:
    """Train ``row``'s config; fills the row in (or marks it failed). Returns the warm-up steps used."""
    run_cfg, warm = _run_settings(row.config, num_train, steps, warmup_steps, storage, row.label)
    logger.info("compare: %s (%s), %d warm-up + %d measured steps", row.label, row.layout, warm, steps)
    start = time.perf_counter()
    try:
        result = fit(run_cfg, stream=stream)
        summary = summarize_history(result.history, warm)
    except Exception as exc:  # one strategy failing must not lose the others' results
        row.status, row.reason = "failed", redact(f"{type(exc).__name__}: {exc}")  # the report is shared
        logger.warning("compare: %s failed: %s", row.label, row.reason)
        return warm
    for key, value in summary.items():
        setattr(row, key, value)
    row.wall_s = time.perf_counter() - start
    return warm


def _try_max_batch(row: RunRow, budget: int, num_train: int, storage: str, stream, fit: Callable) -> None:
    """The largest batch by trial runs (2 steps each), starting from the estimate's answer."""
    def fits(batch: int) -> bool:
        trial, _ = _run_settings(row.config.replace(batch_size=batch), num_train, 2, 0, storage,
                                 f"{row.label}-try-{batch}")
        try:
            result = fit(trial, stream=stream)
        except Exception as exc:
            if "out of memory" in str(exc).lower() or "OutOfMemoryError" in str(exc):
                return False
            raise
        return max(result.metrics["peak_memory_bytes"]) <= budget

    try:
        granularity = batch_granularity(row.strategy, row.config)
        row.max_batch = largest_batch(fits, granularity, num_train, start=row.max_batch or None, resolution=1 / 8)
        row.max_batch_method = "tried"
        row.max_batch_capped = row.max_batch == num_train // granularity * granularity
    except Exception as exc:
        logger.warning("compare: trying batch sizes for %s failed (%s); keeping the estimate", row.label,
                       redact(str(exc)))


def _finish(cfg, rows: List[RunRow], info: ClusterInfo, budget: Optional[int], steps: int, warm: int,
            profile) -> CompareReport:
    reference = next((r for r in rows if r.label == REFERENCE and r.status == "ok"), None)
    for row in rows:
        if row.status == "ok" and reference is not None:
            row.speedup = row.samples_per_s / reference.samples_per_s
    input_shape, num_classes = check_data(cfg.data)
    model = build_model_shapes(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    comparable, why_not = losses_comparable(cfg, model)
    loss_check = check_losses(rows, comparable, why_not, optimizer=cfg.optimizer)
    title = (f"{code_name(cfg.model)} on {code_name(cfg.dataset)}, global batch {cfg.batch_size}, "
             f"{code_name(cfg.optimizer)} lr {cfg.lr:g}, "
             f"seed {cfg.seed}: {steps} measured steps after {warm} warm-up, {info.describe()}")
    return CompareReport(title, rows, loss_check, recommend(rows, cfg.batch_size, budget, cfg.use_gpu), budget)
