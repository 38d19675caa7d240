"""Whole attempts of a run, retried from the last checkpoint, where Ray Train's controller does not do it:
the pipeline's actor group and the in-process runner. Two budgets, as Ray Train's ``FailureConfig`` has:
``max_failures`` for failures, ``max_preemption_failures`` for attempts lost to a node's preemption
(-1: unlimited). A ``ValueError`` is a configuration error: retrying would fail the same way."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["run_attempts"]

T = TypeVar("T")


def _left(budget: int, used: int) -> bool:
    return budget == -1 or used < budget


def run_attempts(cfg, attempt: Callable[[int], T], retryable: Callable[[BaseException], bool],
                 preempted: Callable[[BaseException], bool] = lambda exc: False, what: str = "attempt") -> T:
    """``attempt(failures)`` until one returns; a retryable failure starts the next from the last checkpoint
    while its budget lasts (``preempted(exc)``: it counts against ``max_preemption_failures``)."""
    failures = preemptions = 0
    while True:
        try:
            return attempt(failures + preemptions)
        except Exception as exc:
            if isinstance(exc, ValueError) or not retryable(exc):
                raise
            if preempted(exc):
                if not _left(cfg.max_preemption_failures, preemptions):
                    raise
                preemptions += 1
                budget, used = cfg.max_preemption_failures, preemptions
            else:
                if not _left(cfg.max_failures, failures):
                    raise
                failures += 1
                budget, used = cfg.max_failures, failures
            logger.warning("%s failed (%s: %s); restart %d of %s from the last checkpoint", what,
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", used,
                           "unlimited" if budget == -1 else budget)
