"""``use_gpu="auto"`` and ``num_workers="auto"``: a strategy laid out by its own class. Pure: no Ray, no torch.

The defaults of ``TrainConfig`` are ``use_gpu="auto"`` and ``num_workers="auto"``: the GPUs found are used, in
the layout the strategy gives itself (``Strategy.auto_layout``: ``ddp`` one worker per GPU, ``dp`` one worker
holding a node's GPUs, ...). The fields keep the word until a run starts and the devices are read
(``planning/auto_devices.py``: ``fit``, ``compare`` and ``tune`` call it first); from there on every value is
concrete, and :func:`laid_out` gives the changes. Only the layout keys the user left at their default are
taken: an explicit ``gpus_per_worker=2`` stays 2.

At construction no device is read (a config is plain data, built the same anywhere), so the config's check
lays the strategy out on :data:`CPU_DEVICES` instead, with the worker count alone (``Strategy.auto_num_workers``:
no model is built and no data read there), on a shallow copy (:func:`provisional`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Tuple

from raytrain_mgpu.strategies import get_strategy

__all__ = ["AUTO", "Devices", "CPU_DEVICES", "is_auto", "laid_out", "provisional"]

AUTO = "auto"


@dataclass(frozen=True)
class Devices:
    """The devices a layout is made for (what ``Strategy.auto_layout`` reads).

    On GPU a device is a GPU; on CPU it is a worker process (CPU cores are shared, so more
    processes are no more devices).
    """

    devices_per_node: Tuple[int, ...]
    use_gpu: bool

    @property
    def num_devices(self) -> int:
        return sum(self.devices_per_node)

    @property
    def num_nodes(self) -> int:
        return len(self.devices_per_node)


CPU_DEVICES = Devices((2,), False)
"""No GPU: two CPU worker processes, the layout every config had before ``"auto"`` (``ddp``: 2 workers;
``dp``, ``mp``: 1 worker over 2 CPU stand-in devices)."""


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


def _with(cfg, **changes):
    """A shallow copy of ``cfg`` with ``changes``, not validated (as ``elastic.at_count`` makes one)."""
    fixed = copy.copy(cfg)
    vars(fixed).update(changes)
    return fixed


def laid_out(cfg, devices: Devices) -> dict:
    """The changes that lay ``cfg`` (``num_workers="auto"``) out on ``devices``: ``num_workers`` and the other
    keys of its strategy's ``auto_layout`` that ``cfg`` leaves at their default.

    One worker per device where the strategy has no layout of its own. A strategy that cannot lay itself out on
    :data:`CPU_DEVICES` (``ddp_mp``, ``ddp_pipeline`` need more devices) runs there as configured, one worker per
    CPU process as before ``"auto"``; on GPUs a ValueError says why and what to set.
    """
    if cfg.strategy == AUTO:  # strategy="auto" lays itself out when fit starts (planning/auto.py), on these devices
        return {"num_workers": devices.num_devices}
    try:
        layout = get_strategy(cfg.strategy).auto_layout(_with(cfg, use_gpu=devices.use_gpu), devices)
    except ValueError as exc:
        if devices.use_gpu:
            raise ValueError(
                f"TrainConfig.num_workers='auto' with strategy={cfg.strategy!r} on {devices.num_devices} GPU(s) on "
                f"{devices.num_nodes} node(s): {exc}. Set num_workers (and gpus_per_worker, num_stages) yourself, "
                f"or use strategy='auto'.") from None
        layout = {}
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    changes = {key: value for key, value in layout.items() if getattr(cfg, key) == defaults.get(key)}
    changes["num_workers"] = layout.get("num_workers", devices.num_devices)
    return changes


def provisional(cfg, use_gpu: bool = False):
    """``cfg`` as the config's check at construction reads it: ``use_gpu="auto"`` as ``use_gpu``, and
    ``num_workers="auto"`` as its strategy's worker count on :data:`CPU_DEVICES` (no model built, no device read).
    A shallow copy: ``cfg`` keeps ``"auto"``; ``cfg`` itself when nothing is ``"auto"``."""
    changes = {"use_gpu": use_gpu} if is_auto(cfg.use_gpu) else {}
    if is_auto(cfg.num_workers):
        changes["num_workers"] = CPU_DEVICES.num_devices
        if cfg.strategy != AUTO:
            try:
                count = get_strategy(cfg.strategy).auto_num_workers(_with(cfg, use_gpu=False), CPU_DEVICES)
            except ValueError:  # laid out as configured there, as laid_out does
                count = None
            changes["num_workers"] = count or CPU_DEVICES.num_devices
    return _with(cfg, **changes) if changes else cfg
