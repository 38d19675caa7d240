"""The one retry policy of every transport: what a retry can fix, what it cannot, and the budgets.

A failed attempt restarts from the last checkpoint when a retry can fix what failed; otherwise the run fails
the first time, with the original error (a restart would pay the start and the lost steps again, and fail the
same way). The table (docs/reliability.md: Retries) is :func:`verdict`:

=============================================================  ===========
what failed                                                    retried?
=============================================================  ===========
a lost process or node (Ray's actor, worker or node errors)    yes
a node's preemption                                            yes (``max_preemption_failures``)
a collective timeout, a rank named stuck, a lost peer          yes
a storage hiccup (``OSError`` other than a missing file,       yes
permissions, a path that is not a folder)
any other error after this attempt's first step                yes
a non-finite loss (``on_nonfinite="stop"``)                    no
a config or validation error (``ValueError``)                  no
an import error (a module of the config's code)                no
out of memory (torch's or Ray's), at the same batch size       no
a missing file, a permission refused                           no
any other error before this attempt's first step (the user's   no
model, loss or data code: a shape error, a bug)
a callback's or logger's error                                 no
the workers' resources not granted within placement_timeout_s  no
=============================================================  ===========

Ray Train's controller asks its failure policy (``transports/ray_train/policy.py``), which asks
:func:`verdict`; for the pipeline's actor group and the in-process runner the attempt driver
(``transports/attempt.py``) runs :func:`run_attempts` with it. The
verdict on "before the first step" is made where the error was raised (the worker knows whether it stepped),
carried to the driver on the exception (``errors.crossing``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple, TypeVar

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.errors import PlacementTimeoutError, StuckRankError, WorkerError, add_note, crossing, worker_note

logger = logging.getLogger(__name__)

__all__ = ["Verdict", "verdict", "unwrap", "root_cause", "sent_whole", "errors_whole", "failure_note", "whole_failure",
           "run_attempts"]

T = TypeVar("T")

_LOST = ("ActorDiedError", "RayActorError", "NodeDiedError", "WorkerCrashedError", "ActorUnavailableError",
         "OwnerDiedError", "ObjectLostError", "WorkerHealthCheckFailedError", "PreemptionError", "LocalRayletDiedError",
         "RaySystemError")
"""Ray's names for a process or node that went away (by name: no Ray import to classify an error)."""
_PEER_LOST = ("connection closed by peer", "connection reset", "broken pipe", "remote process exited",
              "communicator was aborted", "timed out", "timeout", "socket closed", "connection refused")
"""A collective's words when a peer died or never came (gloo, NCCL): the error of the ranks left behind."""
_MISSING = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# A storage that refuses writes (a read-only mount, a refused access) raises a plain OSError with one of these: the
# same node refuses them again, as a PermissionError would be
_REFUSED = {errno.EROFS, errno.EACCES, errno.EPERM}


class Verdict(NamedTuple):
    retryable: bool
    reason: str


def unwrap(exc: BaseException) -> BaseException:
    """The error itself, out of Ray's and Ray Train's wrappers (a task's error, a worker's error with its
    traceback text)."""
    for _ in range(8):
        inner = getattr(exc, "_base_exc", None)  # Ray Train's UserExceptionWithTraceback
        if inner is None and type(exc).__name__.startswith("RayTaskError"):
            inner = getattr(exc, "cause", None)
        if not isinstance(inner, BaseException) or inner is exc:
            return exc
        exc = inner
    return exc


def _names(exc: BaseException) -> set:
    return {cls.__name__ for cls in type(exc).__mro__}


def verdict(exc: BaseException, stepped: Optional[bool] = None) -> Verdict:
    """Whether a restart from the last checkpoint can fix ``exc``, and why. ``stepped``: whether the attempt
    that raised it had taken a step (None: unknown, as on the driver; the worker's verdict, carried on the
    exception, is used when there is one)."""
    exc = unwrap(exc)
    carried = getattr(exc, "retryable" if isinstance(exc, WorkerError) else "raytrain_mgpu_retryable", None)
    if isinstance(carried, bool):
        return Verdict(carried, "judged where it was raised")
    names = _names(exc)
    if "PipelineStepError" in names and isinstance(exc.__cause__, BaseException):
        return verdict(exc.__cause__, stepped)  # a stage's action failed: what failed in it decides
    if isinstance(exc, KeyboardInterrupt):
        return Verdict(False, "interrupted")
    if "NonFiniteError" in names:
        return Verdict(False, "a non-finite loss: the same steps give the same NaN")
    if "CallbackError" in names:
        return Verdict(False, "a callback's or logger's error")
    if "PlacementTimeoutError" in names:
        return Verdict(False, "the workers' resources were not granted in time")
    if "OutOfMemoryError" in names:
        return Verdict(False, "out of memory: the same batch size needs the same memory")
    if isinstance(exc, (ImportError, ValueError)):
        return Verdict(False, "a configuration or code error: a retry raises it again")
    if isinstance(exc, _MISSING) or (isinstance(exc, OSError) and exc.errno in _REFUSED):
        return Verdict(False, "a missing file or a refused permission")
    if names & set(_LOST):
        return Verdict(True, "a lost process or node")
    if isinstance(exc, StuckRankError) or "CollectiveTimeoutError" in names:
        return Verdict(True, "a stuck rank or a collective timeout")
    if isinstance(exc, OSError):
        return Verdict(True, "a storage or network hiccup")
    if any(words in str(exc).lower() for words in _PEER_LOST):
        return Verdict(True, "a lost peer")
    if stepped is False:
        return Verdict(False, "raised before the attempt's first step (model, loss or data code): a retry raises "
                              "it again")
    return Verdict(True, "raised after the attempt's first step")


def root_cause(failures: Dict[int, BaseException]) -> Tuple[int, BaseException]:
    """The failure to show of several ranks' (``{rank: error}``): one a retry cannot fix first (the user's error,
    not the others' lost peer), then one that is not a lost process or peer, then the lowest rank."""
    def order(item):
        rank, exc = item
        exc = unwrap(exc)
        lost = bool(_names(exc) & set(_LOST)) or any(w in str(exc).lower() for w in _PEER_LOST)
        return (verdict(exc).retryable, lost, rank)

    rank, exc = min(failures.items(), key=order)
    return rank, unwrap(exc)


def sent_whole(exc: BaseException, rank: int, node: str, pid: int) -> BaseException:
    """A worker's ``exc``, ready for the trip to the driver (``errors.crossing``) with this policy's verdict made
    here, where the original type is known and whether this attempt took a step
    (``engine/liveness.POSITION``). Raise what it returns (the same exception when it travels whole)."""
    return crossing(exc, rank, node, pid, retryable=verdict(exc, stepped=POSITION.stepped).retryable)


def errors_whole(where: Callable[..., Optional[Tuple[int, str]]]) -> Callable[[Callable], Callable]:
    """Decorate a rank's entry point (a Ray Train worker function, a pipeline stage's ``run``): its exception
    leaves the process whole (:func:`sent_whole`). ``where(*args)``: this rank and its node, or None where the
    error stays in this process (the tests' local stages)."""

    def decorate(entry: Callable) -> Callable:
        @functools.wraps(entry)
        def wrapper(*args, **kwargs):
            try:
                return entry(*args, **kwargs)
            except Exception as exc:
                rank_node = where(*args)
                sent = exc if rank_node is None else sent_whole(exc, *rank_node, os.getpid())
                if sent is exc:
                    raise
                raise sent from None

        return wrapper

    return decorate


def failure_note(cfg) -> str:
    """The note every transport adds to the error ``fit`` raises: where the run's checkpoints are, and how to resume."""
    return (f"training run {cfg.name!r} failed. Checkpoints written so far are kept in {RunFolder.of(cfg).display}; "
            f"run again with the same name and storage_path to resume.")


def whole_failure(cfg, error: BaseException, failures: Optional[Dict[int, BaseException]] = None, stall=None,
                  placement: Optional[str] = None) -> BaseException:
    """What ``fit`` raises for a failed run, every transport's: the failure that caused it, whole (the type the
    worker raised, its message, its notes: the worker's traceback and where it ran), chosen by :func:`root_cause`
    among several ranks' ``failures``; a :class:`~raytrain_mgpu.errors.StuckRankError` for the ranks the driver
    found stuck (``stall``: the heartbeats' verdict); a :class:`~raytrain_mgpu.errors.PlacementTimeoutError` with
    the ``placement`` message for resources never granted; else ``error`` out of Ray's wrappers. Noted with where
    the run's checkpoints are (:func:`failure_note`)."""
    if stall is not None:
        exc = StuckRankError(stall.line, stall.ranks, stall.report)
    elif placement is not None:
        exc = PlacementTimeoutError(placement)
    elif failures:
        rank, exc = root_cause(failures)
        traceback_text = getattr(failures[rank], "_traceback_str", None)  # Ray Train's copy of the worker's
        if worker_note(exc) is None and not isinstance(exc, WorkerError):  # a WorkerError says where itself
            add_note(exc, f"raised on rank {rank}")
        if traceback_text and not getattr(exc, "traceback_text", None):
            add_note(exc, f"The worker's traceback (rank {rank}):\n{traceback_text.rstrip()}")
    else:
        exc = unwrap(error)
    add_note(exc, failure_note(cfg))
    return exc


def _left(budget: int, used: int) -> bool:
    return budget == -1 or used < budget


def run_attempts(cfg, attempt: Callable[[int], T], judge: Callable[[BaseException], Verdict] = verdict,
                 preempted: Callable[[BaseException], bool] = lambda exc: False, what: str = "attempt",
                 ledger=None) -> T:
    """``attempt(failures)`` until one returns; a failure that ``judge`` (default :func:`verdict`) finds retryable
    starts the next from the last checkpoint while its budget lasts (``preempted(exc)``: it counts against
    ``max_preemption_failures``, else ``max_failures``). ``ledger``: told when each attempt starts and ends
    (``driver/goodput.Ledger``)."""
    failures = preemptions = 0
    while True:
        if ledger is not None:
            ledger.begin()
        try:
            result = attempt(failures + preemptions)
        except Exception as exc:
            if ledger is not None:
                ledger.end(failed=True)
            judged = judge(exc)
            if not judged.retryable:
                logger.info("%s failed, not retried (%s): %s", what, judged.reason, type(unwrap(exc)).__name__)
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
            continue
        if ledger is not None:
            ledger.end(failed=False)
        return result
