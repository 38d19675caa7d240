"""The one retry policy (``transports/retry.py``) inside Ray Train's controller.

Ray Train's controller retries every worker-group failure while ``max_failures`` lasts, and a worker group that
did not start (its placement group pending) without limit. :class:`OneRetryPolicy` is its default policy (the
two budgets, preemptions apart) asking :func:`~raytrain_mgpu.transports.retry.verdict` first: a failure a retry
cannot fix (a non-finite loss, a config error reaching a worker, the user's code failing before any step) ends
the run the first time, and a group whose resources were not granted within ``placement_timeout_s`` (the start
timeout ``fit`` gives the controller) is not waited for again. Light on purpose: the controller unpickles it, and
imports this module without torch.
"""

from __future__ import annotations

import logging

from raytrain_mgpu.transports.retry import unwrap, verdict

logger = logging.getLogger(__name__)

__all__ = ["OneRetryPolicy"]

try:
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
except ImportError:  # another Ray Train: its own policy stays
    DefaultFailurePolicy = FailureDecision = None


if DefaultFailurePolicy is not None:

    class OneRetryPolicy(DefaultFailurePolicy):
        """Ray Train's ``DefaultFailurePolicy`` that raises at once what a retry cannot fix."""

        def make_decision(self, training_failed_error):
            failures = getattr(training_failed_error, "worker_failures", None) or {}
            fatal = {rank: verdict(exc) for rank, exc in failures.items() if not verdict(exc).retryable}
            if fatal:
                rank, judged = min(fatal.items())
                logger.info("[raytrain-mgpu] not retried: rank %d failed with %s (%s)", rank,
                            type(unwrap(failures[rank])).__name__, judged.reason)
                return FailureDecision.RAISE
            controller = getattr(training_failed_error, "controller_failure", None)
            if type(controller).__name__ == "WorkerGroupStartupTimeoutError":
                logger.info("[raytrain-mgpu] not retried: the worker group's resources were not granted in time")
                return FailureDecision.RAISE
            return super().make_decision(training_failed_error)

else:  # pragma: no cover
    OneRetryPolicy = None
