"""What runs inside Ray Train's controller: the one retry policy (``transports/retry.py``), and the driver told of
each checkpoint registered (:class:`CheckpointAnnouncer`).

Ray Train's controller retries every worker-group failure while ``max_failures`` lasts, and a worker group that
did not start (its placement group pending) without limit. :class:`OneRetryPolicy` is its default policy (the
two budgets, preemptions apart) asking :func:`~raytrain_mgpu.transports.retry.verdict` first: a failure a retry
cannot fix (a non-finite loss, a config error reaching a worker, the user's code failing before any step) ends
the run the first time, and a group whose resources were not granted within ``placement_timeout_s`` in all is not
waited for again (Ray Train waits 60 s a try, then tries again, an elastic run with another worker count). Light on
purpose: the controller unpickles both, and
imports this module without torch.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from raytrain_mgpu.transports.retry import unwrap, verdict

logger = logging.getLogger(__name__)

__all__ = ["OneRetryPolicy", "CheckpointAnnouncer"]

try:
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
except ImportError:  # another Ray Train: its own policy stays
    DefaultFailurePolicy = FailureDecision = None
from ray.train import UserCallback


class CheckpointAnnouncer(UserCallback):
    """Tells the driver (its ``on_checkpoint``, through the run's progress channel ``sink``) of each checkpoint
    Ray Train registers: called in the controller once every rank's report is in and the upload is done, in
    report order, once each; and of each failure its poll finds (:meth:`after_exception`). ``scheme``: the storage
    URI's (``s3``, ...; None for a local path), which Ray Train's paths leave out."""

    def __init__(self, sink, scheme: Optional[str]):
        self.sink, self.scheme = sink, scheme

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is None:
            return
        try:  # fire and forget: the driver waits for the last one (driver.py)
            self.sink.put.remote("checkpoint", f"{self.scheme}://{checkpoint.path}" if self.scheme else checkpoint.path)
        except Exception:  # progress never fails training (the controller would fail the run)
            logger.exception("could not tell the driver of checkpoint %s", checkpoint.path)

    def after_exception(self, run_context, worker_exceptions) -> None:
        """A worker group failed, found by the controller's poll: when, for the driver's goodput ledger (the
        attempt's end; ``driver/goodput.py``)."""
        try:
            self.sink.put.remote("failed", time.time())
        except Exception:
            logger.debug("could not tell the driver of a failure", exc_info=True)


if DefaultFailurePolicy is not None:

    class OneRetryPolicy(DefaultFailurePolicy):
        """Ray Train's ``DefaultFailurePolicy`` that raises at once what a retry cannot fix, and stops waiting for a
        worker group's resources once ``placement_timeout_s`` has passed (each of Ray Train's waits lasts
        ``start_timeout_s``; None: no bound, Ray Train's own behaviour)."""

        def __init__(self, failure_config, placement_timeout_s: Optional[float] = None,
                     start_timeout_s: float = 60.0):
            super().__init__(failure_config)
            self.placement_timeout_s, self.start_timeout_s = placement_timeout_s, start_timeout_s
            self._pending_since: Optional[float] = None

        def make_decision(self, training_failed_error):
            failures = getattr(training_failed_error, "worker_failures", None) or {}
            fatal = {rank: verdict(exc) for rank, exc in failures.items() if not verdict(exc).retryable}
            if fatal:
                rank, judged = min(fatal.items())
                logger.info("[raytrain-mgpu] not retried: rank %d failed with %s (%s)", rank,
                            type(unwrap(failures[rank])).__name__, judged.reason)
                return FailureDecision.RAISE
            controller = getattr(training_failed_error, "controller_failure", None)
            if type(controller).__name__ != "WorkerGroupStartupTimeoutError":
                self._pending_since = None
                return super().make_decision(training_failed_error)
            # Ray Train tries again, perhaps with another worker count (elastic): while the wait lasts
            now = time.monotonic()
            self._pending_since = self._pending_since or now - self.start_timeout_s
            if self.placement_timeout_s is not None and now - self._pending_since >= self.placement_timeout_s:
                logger.info("[raytrain-mgpu] not retried: the worker group's resources were not granted within "
                            "placement_timeout_s=%g s", self.placement_timeout_s)
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

else:  # pragma: no cover
    OneRetryPolicy = None
