"""Elastic worker counts: ``TrainConfig(num_workers=(min, max))`` for the data-parallel strategies.

Ray Train starts the run with as many workers as the cluster has room for, from ``min`` up to
``max``, and restarts the worker group from the latest checkpoint when that number changes
(a node joins: it grows; a node leaves: it shrinks). The global batch and the learning-rate
schedule stay exact at every count because the micro-batch is fixed by the largest count:

    micro = batch_size / (max x grad_accum_steps)
    W workers: each takes max x grad_accum_steps / W accumulation micro-steps per optimizer step

so step ``s`` still trains positions ``[s*B, (s+1)*B)`` of the epoch's permutation
(``engine/loop.py``), and an epoch has ``N // B`` steps at every count:
``floor(floor(N / W) / micro) // (max*A/W) = floor(N / (W * micro * max*A/W)) = N // B`` (nested
floors of positive integers). A ``batch_size`` that some count in ``[min, max]`` cannot split
is refused before Ray, with the counts that work and the fix.

Which strategies are elastic is a class attribute (``Strategy.elastic``): those whose workers
are plain data-parallel replicas. Pure: no Ray, no torch.
"""

from __future__ import annotations

import copy
import math
from typing import List, Tuple

from raytrain_mgpu.strategies import STRATEGIES, get_strategy
from raytrain_mgpu.strategies.layout import is_auto

__all__ = ["worker_range", "is_elastic", "at_count", "check_worker_range",
           "describe_range"]


def is_elastic(cfg) -> bool:
    """Whether ``cfg.num_workers`` is a ``(min, max)`` range."""
    return isinstance(cfg.num_workers, tuple)


def worker_range(cfg) -> Tuple[int, int]:
    """``(min, max)`` workers: both the count for a fixed ``num_workers``."""
    return tuple(cfg.num_workers) if is_elastic(cfg) else (cfg.num_workers, cfg.num_workers)


def at_count(cfg, count: int):
    """A shallow copy of ``cfg`` with ``num_workers=count`` (not validated again): what the strategy
    classes' driver-side methods (validate, bundles, memory model) read for one count."""
    if cfg.num_workers == count:
        return cfg
    fixed = copy.copy(cfg)
    vars(fixed)["num_workers"] = count
    return fixed


def describe_range(cfg) -> str:
    """``2`` or ``1-2`` (the banner's worker count)."""
    low, high = worker_range(cfg)
    return str(high) if low == high else f"{low}-{high}"


def _splits(low: int, high: int, batch: int, accum: int) -> List[int]:
    """The counts in ``[low, high]`` that cannot split ``batch`` with the micro-batch fixed by ``high``."""
    parts = high * accum
    bad = {w for w in range(low, high + 1) if batch % w or parts % w}
    if batch % parts:
        bad.add(high)
    return sorted(bad)


def check_worker_range(cfg) -> None:
    """``num_workers``: a positive count, or ``(min, max)`` with a strategy that is elastic and a
    ``batch_size`` every count in the range splits. ValueError names the value and the fix."""
    interval = cfg.elastic_resize_interval_s
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0 <= interval < math.inf:
        raise ValueError(f"TrainConfig.elastic_resize_interval_s={interval!r}: must be a number of seconds >= 0. "
                         f"Set it to e.g. 60 (Ray's default), or a few seconds in tests.")
    value = cfg.num_workers
    if isinstance(value, list):  # YAML
        value = cfg.num_workers = tuple(value)
    if is_auto(value):  # the strategy's layout on the devices found (strategies/layout.py), when a run starts
        return
    if not isinstance(value, tuple):
        if not _is_int(value) or value < 1:
            raise ValueError(f"TrainConfig.num_workers={value!r}: must be a positive integer, 'auto' (the strategy's "
                             f"layout on the devices found), or [min, max] for an elastic run. Set num_workers to 1 "
                             f"or more, or leave it unset.")
        return
    if len(value) != 2 or not all(_is_int(v) for v in value) or not 1 <= value[0] <= value[1]:
        raise ValueError(f"TrainConfig.num_workers={value!r}: an elastic range is (min, max) with 1 <= min <= max. "
                         f"Write e.g. num_workers=(1, 4) (YAML [1, 4], CLI --num-workers 1-4).")
    elastic = sorted(name for name, cls in STRATEGIES.items() if cls.elastic)
    if cfg.strategy == "auto" or not get_strategy(cfg.strategy).elastic:
        raise ValueError(
            f"TrainConfig.num_workers={value!r} with strategy={cfg.strategy!r}: an elastic worker count needs a "
            f"strategy whose workers are plain data-parallel replicas ({', '.join(elastic)}). Use one of them, or "
            f"a fixed num_workers={value[1]}.")
    low, high = value
    bad = _splits(low, high, cfg.batch_size, cfg.grad_accum_steps)
    if bad:
        raise ValueError(_split_message(low, high, cfg.batch_size, cfg.grad_accum_steps, bad))


def _split_message(low: int, high: int, batch: int, accum: int, bad: List[int]) -> str:
    works = [w for w in range(low, high + 1) if not _splits(low, w, batch, accum)]
    need = math.lcm(*range(low, high + 1))  # every count divides max x grad_accum_steps
    fixed_accum = next(a for a in range(accum, accum + need + 1) if high * a % need == 0)
    parts = high * fixed_accum
    fixed_batch = -(-batch // parts) * parts
    fixes = [f"num_workers=({low}, {works[-1]})"] if works else []
    fixes.append(f"batch_size={fixed_batch}" if fixed_accum == accum
                 else f"grad_accum_steps={fixed_accum} with batch_size={fixed_batch}")
    return (f"TrainConfig.num_workers=({low}, {high}) with batch_size={batch} and grad_accum_steps={accum}: "
            f"{', '.join(map(str, bad))} worker(s) cannot split it (the micro-batch is fixed by the largest count, "
            f"batch_size / ({high} x {accum}), and W workers take {high} x {accum} / W accumulation steps each: both "
            f"must be whole). Counts that work: {', '.join(map(str, works)) or 'none'}; use {' or '.join(fixes)}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
