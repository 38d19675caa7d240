"""The epoch loop both runners share: train an epoch, evaluate it when due, record its row, checkpoint it.

The Ray Train worker function (``runtime/loop.train_worker``, on every rank) and the pipeline's
driver (``pipeline/driver.train_attempt``, for its actor group) differ in how they train an epoch,
evaluate and checkpoint; what happens between epochs, and in which order, is :func:`run_epochs`:

- a finished run (``RunState.finished``: every epoch done, ``max_steps`` reached, or stopped early
  under ``early_stopping_patience``) trains no further epoch; a resumed one starts at ``state.epoch``;
- the last epoch is evaluated, also one that ``max_steps`` or an early stop makes the last, and
  otherwise every ``eval_every_epochs``-th; ``eval_s`` is the evaluation's wall time;
- with a validation split (``has_val``) an evaluated epoch measures it (``val_*``, which ``monitor`` and
  early stopping read) and the test split only after the run's last epoch (or on every evaluated
  epoch with ``test_every_epoch``); without one the test split is the evaluated one;
- the row joins ``state.history`` before it is checkpointed, so the checkpoint holds it.
"""

from __future__ import annotations

import time
from typing import Callable

from raytrain_mgpu.runtime.run_state import RunState, stops_early

__all__ = ["run_epochs", "evaluation_due"]


def evaluation_due(cfg, state: RunState, row: dict) -> bool:
    """Whether the epoch just trained (``state.epoch`` counts it) is evaluated."""
    return (state.finished(cfg) or stops_early(state.history + [row], cfg)
            or state.epoch % cfg.eval_every_epochs == 0)


def run_epochs(cfg, state: RunState, train_epoch: Callable[[int], dict], evaluate: Callable[[str], dict],
               end_epoch: Callable[[dict], None], has_val: bool = False) -> None:
    """Train ``state``'s remaining epochs of ``cfg``: ``train_epoch(epoch)`` returns the epoch's row (0-based
    ``epoch``), ``evaluate(split)`` the columns of ``"val"`` or ``"test"``, ``end_epoch(row)`` checkpoints and
    reports it; ``has_val``: the data has a validation split."""
    for epoch in range(state.epoch, cfg.epochs):
        if state.finished(cfg):
            break
        row = train_epoch(epoch)
        state.epoch = epoch + 1
        if evaluation_due(cfg, state, row):
            started = time.perf_counter()
            if has_val:
                row.update(evaluate("val"))
            last = state.finished(cfg) or stops_early(state.history + [row], cfg)  # an early stop on val_*
            if not has_val or last or cfg.test_every_epoch:
                row.update(evaluate("test"))
            row["eval_s"] = time.perf_counter() - started
        state.history.append(row)
        end_epoch(row)
