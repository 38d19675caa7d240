"""The training loop both runners share: the epochs (:func:`run_epochs`: train an epoch, evaluate it when
due, record its row, checkpoint it) and the end of every step (:class:`OptimizerStep`).

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

Within an epoch each runner forwards and backwards a step's micro-batches its own way (a Ray Train
worker through its strategy's model, a pipeline stage through its schedule); once the gradients are in
place both end the step with :class:`OptimizerStep`, which also calls :data:`STEP_EVENTS`.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from raytrain_mgpu.runtime.run_state import RunState, stops_early

__all__ = ["run_epochs", "evaluation_due", "OptimizerStep", "STEP_EVENTS"]


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


STEP_EVENTS: List[Callable[[int], None]] = []
"""Called with the global step after every optimizer step, in every process that trains (each Ray Train
worker, each pipeline stage actor), by :class:`OptimizerStep`: the engine's hook for what observes or
disturbs training from outside (tests register probes here; a run registers none)."""


class OptimizerStep:
    """The end of every training step, the same in both runners, once the step's gradients are in place
    (after the micro-batches' backward passes and, where replicas sync by hand, their average):

    the rate the step used read, gradients unscaled (fp16's ``scaler``) and clipped to
    ``grad_clip_norm`` by ``clip`` (the runner's norm: over this model, or over every stage of a
    pipeline), the optimizer stepped, gradients dropped, the LR schedule moved, the step's scalars added
    to ``window`` (a :class:`~raytrain_mgpu.runtime.step_scalars.StepWindow`, on the reporting processes),
    :data:`STEP_EVENTS` called.
    """

    def __init__(self, cfg, optimizer, scheduler, clip: Callable[[float], object], scaler=None, window=None):
        self.cfg, self.optimizer, self.scheduler, self.clip = cfg, optimizer, scheduler, clip
        # fp16's scaler only: a disabled one's step()/update() are calls that do nothing but cost a few us a step
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.window = window

    def __call__(self, step: int) -> Optional[dict]:
        """Take global step ``step`` (counted from 1 by the caller); the ``train/*`` scalars of the
        ``log_every_n_steps`` window it closes (one device read), else None."""
        optimizer = self.optimizer
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
        grad_norm = None
        if self.cfg.grad_clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            grad_norm = self.clip(self.cfg.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        for event in STEP_EVENTS:
            event(step)
        if self.window is None:
            return None
        self.window.end_step(lr, grad_norm)
        return self.window.read() if step % self.cfg.log_every_n_steps == 0 else None
