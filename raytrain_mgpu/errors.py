"""Errors that reach the user whole, from whichever process raised them.

A worker's exception travels to the driver pickled (Ray ships it). An exception whose class cannot be
rebuilt from its pickle (an ``__init__`` with required arguments that ``args`` does not hold, a common
pattern; a class the driver cannot import) used to arrive as Ray's ``WorkerHealthCheckFailedError``
around a ``TypeError`` from unpickling: what went wrong was lost. Here:

- :func:`crossing` prepares an exception for the trip: a note names the rank, node and process it was
  raised in (kept by pickling, and printed under the traceback); one that would not survive the trip is
  replaced by a :class:`WorkerError` holding its type's name, message and the worker's traceback text;
- every exception class of this package pickles with its message and fields (tests/test_errors.py walks
  them all).
"""

from __future__ import annotations

import pickle
import traceback
from typing import Optional

__all__ = ["WorkerError", "StuckRankError", "PlacementTimeoutError", "UnknownFieldError", "crossing", "add_note",
           "worker_note"]

_NOTE_PREFIX = "raised on rank "


class WorkerError(RuntimeError):
    """An exception a worker raised whose class could not be sent to the driver as it was: its type's name
    (``type_name``, e.g. ``mymodule.MyError``), its message, the worker's traceback text, and where it was
    raised. ``retryable``: the retry policy's verdict, made on the worker, where the original type was known."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "", where: str = "",
                 retryable: Optional[bool] = None):
        super().__init__(f"{type_name}: {message}" + (f" ({where})" if where else ""))
        self.type_name, self.message, self.traceback_text, self.where = type_name, message, traceback_text, where
        self.retryable = retryable

    def __reduce__(self):
        return (type(self), (self.type_name, self.message, self.traceback_text, self.where, self.retryable),
                self.__dict__)

    def __str__(self) -> str:
        text = super().__str__()
        if self.traceback_text:
            text += f"\nThe worker's traceback (its exception could not be sent as it was):\n{self.traceback_text}"
        return text


class StuckRankError(RuntimeError):
    """A rank stopped making progress while the others went on (or went silent): named by the driver from the
    ranks' heartbeats (``engine/liveness.py``), which then failed the attempt. ``ranks``: the stuck ranks;
    ``report``: per rank, where it was (node, pid, step, what it was doing) and its Python stacks."""

    def __init__(self, message: str, ranks: Optional[list] = None, report: str = ""):
        super().__init__(message)
        self.ranks, self.report = list(ranks or []), report

    def __reduce__(self):
        return (type(self), (self.args[0], self.ranks, self.report), self.__dict__)

    def __str__(self) -> str:
        return self.args[0] + (f"\n{self.report}" if self.report else "")


class UnknownFieldError(ValueError, TypeError):
    """A ``TrainConfig`` field that does not exist (``TrainConfig(batchsize=64)``, a YAML key, ``replace``), with the
    closest one named. A ``ValueError`` as every config error is; a ``TypeError`` too, as Python's own error for an
    unexpected keyword argument is, so code written against either catches it."""


class PlacementTimeoutError(RuntimeError):
    """The cluster did not grant the run's workers their resources within ``TrainConfig.placement_timeout_s``; the
    message names what is pending and the cluster's nodes and node types. Not retried: the wait was the bound."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+; kept in ``__notes__`` on 3.10, which pickling keeps too)."""
    if note in getattr(exc, "__notes__", ()):
        return
    try:
        exc.add_note(note)
    except AttributeError:  # Python 3.10
        try:
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
        except Exception:  # an exception type that refuses new attributes: the note is lost, not the error
            pass


def worker_note(exc: BaseException) -> Optional[str]:
    """The note :func:`crossing` added (where it was raised), or None."""
    return next((n for n in getattr(exc, "__notes__", ()) if n.startswith(_NOTE_PREFIX)), None)


def crossing(exc: BaseException, rank: int, node: str, pid: int, retryable: Optional[bool] = None) -> BaseException:
    """``exc`` ready to be sent to the driver: noted with where it was raised, or a :class:`WorkerError` in its
    place when it would not arrive whole (it does not pickle, or does not come back with its message).
    ``retryable``: the retry policy's verdict (``transports/retry.py``), carried in the note's attribute."""
    where = f"rank {rank}, node {node}, pid {pid}"
    add_note(exc, f"{_NOTE_PREFIX}{rank} (node {node}, pid {pid})")
    if retryable is not None:
        try:
            exc.raytrain_mgpu_retryable = retryable
        except Exception:
            pass
    if _arrives_whole(exc):
        return exc
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    stand_in = WorkerError(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text, where, retryable)
    stand_in.__cause__ = None
    return stand_in


def _arrives_whole(exc: BaseException) -> bool:
    """Whether ``exc`` pickles and unpickles (as Ray does: with cloudpickle, by value for ``__main__``'s
    classes) into the same type with the same message and notes."""
    try:
        # late: this module is standard library only (the config's checks raise its errors, and --help imports
        # no Ray); only a rank's failure, in a process that runs Ray already, asks Ray's cloudpickle
        from ray import cloudpickle as dumper
    except ImportError:  # outside Ray: the standard pickle
        dumper = pickle
    try:
        back = pickle.loads(dumper.dumps(exc))
    except Exception:
        return False
    return (type(back).__name__ == type(exc).__name__ and str(back) == str(exc)
            and getattr(back, "__notes__", None) == getattr(exc, "__notes__", None))
