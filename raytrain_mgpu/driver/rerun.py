"""A run started again under its name (``{storage_path}/{name}``): what it finds, and what it is asked to change.

- :func:`check_resume`: ``TrainConfig.resume``: ``never`` refuses a run folder that holds a checkpoint (a
  script that must start fresh), ``must`` one that holds none (a script that must continue); ``auto``
  resumes whatever is there. ``driver/preflight.check_run_folder`` calls it before it records anything.
- :func:`training_changes`: the settings that would train the run otherwise than its newest checkpoint
  recorded. ``api._stored_result`` refuses them for a finished run (it would answer from its folder and the
  new values would silently not be used) and names them in one line on a resume, which trains on with them
  (that is how a run is extended).

No torch, no Ray: it reads the config and a checkpoint's ``meta.json``.
"""

from __future__ import annotations

import json
from typing import Iterable, List, Optional, Tuple

from raytrain_mgpu.config.code import better_mode
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.strategies import STRATEGIES
from raytrain_mgpu.strategies.base import OPTIONAL_FIELDS

__all__ = ["check_resume", "training_changes", "describe_changes", "NOT_TRAINING_FIELDS"]


def check_resume(cfg, run: str, newest) -> None:
    """``cfg.resume`` against run folder ``run`` (for errors) whose newest checkpoint is ``newest``
    (``engine.run_folder.CheckpointInfo``, or None)."""
    if cfg.resume == "never" and newest is not None:
        raise ValueError(
            f"TrainConfig.resume='never': run folder {run!r} already holds a checkpoint ({newest.name}, after epoch "
            f"{newest.meta.get('epoch')}, step {newest.meta.get('step')}), and this run must start fresh. Use another "
            f"`name` (--name) for a new run, or delete that folder to train this one from the start.")
    if cfg.resume == "must" and newest is None:
        raise ValueError(
            f"TrainConfig.resume='must': run folder {run!r} holds no checkpoint to resume from. Set the `name` and "
            f"`storage_path` of the run to continue (its folder is storage_path/name), or resume='auto' to start "
            f"a new run there.")


NOT_TRAINING_FIELDS = (
    # which run, and where it lives
    "name", "storage_path", "resume",
    # how far it trains: raising these is how a run is extended (a finished run compares the rest)
    "epochs", "max_steps", "early_stopping_patience",
    # where its processes run and what they hold: the same steps, placed elsewhere
    "address", "runner", "placement", "resources_per_worker", "accelerator_type", "label_selector",
    "cpus_per_worker", "tensor_parallel_across_nodes", "elastic_resize_interval_s",
    # what strategy="auto" chooses with: its choice, the layout, is compared
    "auto_measure", "memory_budget_bytes",
    # where the data is (its shape, classes and split size are compared by check_run_folder) and how many
    # processes read it: the same samples in the same order, the same weights
    "data_root", "download", "loader_workers", "prefetch_factor", "persistent_workers", "data_on_device",
    # waits and failure budgets
    "placement_timeout_s", "stall_timeout_s", "collective_timeout_s", "max_failures", "max_preemption_failures",
    "preemption_grace_s",
    # how often a checkpoint is written and how many are kept
    "num_checkpoints_to_keep", "checkpoint_every_n_steps", "checkpoint_every_n_minutes",
    "expected_reclaims_per_gpu_hour",
    # who watches it, and what evaluation reports (monitor, mode and keep_best, which choose the best, are compared)
    "verbose", "loggers", "mlflow_tracking_uri", "callbacks", "log_every_n_steps", "profile_steps", "metrics",
    "eval_every_n_steps", "eval_every_epochs", "test_every_epoch",
)
"""The fields a run started again may change without changing what it trains. Every other field is compared
with the config its newest checkpoint recorded (:func:`training_changes`), so a new field is compared until it
is listed here: a needless question beats a setting silently not used."""


# Fields read only where another field has one of some values (momentum by sgd alone, ...): not a difference where
# neither the recorded run nor this config reads them.
_READ_ONLY_WITH = {"momentum": ("optimizer", ("sgd",)), "lr_step_epochs": ("lr_schedule", ("step",)),
                   "lr_step_gamma": ("lr_schedule", ("step",)), "decay_fraction": ("lr_schedule", ("wsd",)),
                   "base_batch_size": ("lr_scaling", ("linear", "sqrt"))}


def _unread(key: str, recorded: dict, mine: dict) -> bool:
    controlling, readers = _READ_ONLY_WITH.get(key, (None, ()))
    return controlling is not None and recorded.get(controlling) not in readers and mine.get(controlling) not in readers


def training_changes(cfg, recorded: dict, left_auto: Iterable[str] = ()) -> List[Tuple[str, object, object]]:
    """``(field, recorded value, cfg's value)`` for each field of ``cfg`` that differs from ``recorded`` (the config
    in a run's newest checkpoint) and would change its training. Not compared: ``NOT_TRAINING_FIELDS``, options
    ``cfg``'s strategy never reads, an option neither side's optimizer or schedule reads (``momentum`` with adamw),
    a field the record lacks (a folder from before it existed), a value ``"auto"``
    on either side and the fields ``left_auto`` names (the user's ``"auto"``, already resolved: what the run
    resolved it to is the run's own); ``mode`` as it resolves for ``monitor``, and not at all without one."""
    strategy = STRATEGIES.get(cfg.strategy)
    unread = set(OPTIONAL_FIELDS) - set(strategy.options_used) if strategy is not None else set()
    left_auto = set(left_auto)
    mine = _as_stored(redact(cfg.to_dict()))  # as meta.json holds the recorded one
    changes = []
    for key, value in mine.items():
        if (key in NOT_TRAINING_FIELDS or key in unread or key in left_auto or key not in recorded
                or _unread(key, recorded, mine)):
            continue
        old, new = (_mode(recorded, cfg), _mode(mine, cfg)) if key == "mode" else (recorded[key], value)
        if old != new and "auto" not in (old, new):
            changes.append((key, old, new))
    return changes


def describe_changes(changes: List[Tuple[str, object, object]]) -> str:
    """``lr 0.02 -> 0.05, precision '32' -> 'bf16-mixed'``."""
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)


def _mode(values: dict, cfg) -> Optional[str]:
    """How ``values["monitor"]`` ranks epochs, ``"auto"`` resolved with ``cfg``'s metrics; None without a monitor."""
    if values.get("monitor") is None:
        return None
    try:
        return better_mode(values["monitor"], cfg.metrics, values.get("mode") or "auto")
    except ValueError:  # a recorded monitor this config's metrics do not know: as written
        return values.get("mode")


def _as_stored(value):
    return json.loads(json.dumps(value, default=str))  # tuples as lists, objects as text: as meta.json stores them
