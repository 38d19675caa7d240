"""Watching a run from the driver: the :class:`Callback` protocol and :class:`RunEvents`.

Both runners report to one :class:`RunEvents` (``fit`` builds it): Ray Train's rank 0
through the ``ProgressSink`` actor and the driver's ``SinkPump`` thread, the pipeline's
driver directly. It keeps the progress printer's ``banner``/``step``/``epoch`` and adds
``scalars`` and ``checkpoint``, and fans every event out to the printer, the loggers
(``TrainConfig.loggers``, :mod:`raytrain_mgpu.driver.loggers`) and the user's callbacks
(``TrainConfig.callbacks``), in that order. The same events, in the same order, reach a
callback whichever runner trains::

    on_train_start(run)            once per fit call, before the first step (run.resumed on a resume)
    on_step(step, scalars)         every log_every_n_steps optimizer steps (rank 0's scalars)
    on_epoch_end(epoch, metrics)   after each epoch: its history row
    on_checkpoint(path)            after each checkpoint (epoch or step) is persisted: its path or URI; the
                                   upload runs in the background, so this may follow the next epoch's first steps
    on_train_end(result)           once, with the TrainResult, when fit succeeds

A run restarted after a failure (``max_failures``) resumes from its last checkpoint inside
the same fit call: steps after that checkpoint are sent again (with the same step numbers),
and so is an epoch whose row was sent but whose checkpoint was not persisted.

An exception in a callback (or a logger) fails the run with the callback named; it is never
swallowed. After the first failure no further events are delivered.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

from raytrain_mgpu.config.factories import load_factory

logger = logging.getLogger(__name__)

__all__ = ["Callback", "RunInfo", "RunEvents", "CallbackError", "load_callbacks", "stop_main_thread_on_failure",
           "HOOKS"]

HOOKS = ("on_train_start", "on_step", "on_epoch_end", "on_checkpoint", "on_train_end")


@dataclass(frozen=True)
class RunInfo:
    """What ``on_train_start`` gets."""

    config: dict
    """The run's ``TrainConfig`` as a dict, with URI credentials redacted (as in ``meta.json``)."""
    path: str
    """The run folder ``{storage_path}/{name}`` (a path or URI)."""
    resumed: bool
    """True when this fit call continues from a checkpoint of an earlier one."""
    start_epoch: int
    """Epochs already trained (0 for a new run)."""
    start_step: int
    """Optimizer steps already taken (0 for a new run)."""


class Callback:
    """Subclass and override the hooks you need; each does nothing by default.

    Called on the driver, in the thread that receives the event (for Ray Train runs a
    background thread of the driver): keep hooks short, they hold up the events after them.
    Name one in a config as ``"package.module:Class"`` (built with no arguments), or pass
    an instance from Python.
    """

    def on_train_start(self, run: RunInfo) -> None:
        """Once per fit call, before training starts."""

    def on_step(self, step: int, scalars: dict) -> None:
        """Rank 0's scalars at global optimizer ``step`` (``train/loss``, ``train/lr``, ...)."""

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        """The history row of ``epoch`` (1-based), as ``TrainResult.history`` holds it."""

    def on_checkpoint(self, path: str) -> None:
        """A checkpoint was persisted at ``path`` (a local path, or a URI for a storage URI)."""

    def on_train_end(self, result) -> None:
        """Once, with the ``TrainResult``, when fit succeeds."""


class CallbackError(RuntimeError):
    """A callback or logger raised; names it, the hook, and the exception (its ``__cause__``).

    Its ``args`` rebuild it (``label, hook, "Type: message"``), so it copies and pickles: Ray Tune
    copies a trial's error, and Ray sends errors between processes."""

    def __init__(self, label: str, hook: str, exc: Union[BaseException, str]):
        super().__init__(label, hook, exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")
        self.label, self.hook = label, hook

    def __str__(self) -> str:
        return "{} raised in {}: {}".format(*self.args)


def _label(field: str, entry) -> str:
    name = entry if isinstance(entry, str) else f"{type(entry).__module__}:{type(entry).__qualname__}"
    return f"{field} entry {name!r}"


def load_callbacks(entries: list) -> List[Tuple[str, Any]]:
    """``TrainConfig.callbacks`` as ``(label, callback)`` pairs: a ``"module:Class"`` is imported
    and built with no arguments (errors name the entry and the fix); an instance is used as it is."""
    loaded = []
    for entry in entries or []:
        if isinstance(entry, str):
            factory = load_factory(entry, "callbacks")
            try:
                callback = factory()
            except Exception as exc:
                raise ValueError(f"TrainConfig.callbacks entry {entry!r}: building it with no arguments raised "
                                 f"{type(exc).__name__}: {exc}. Give its __init__ defaults for every argument, "
                                 f"or pass an instance from Python.") from exc
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise ValueError(f"TrainConfig.callbacks entry {entry!r} built a {type(callback).__name__}, which "
                                 f"has none of the hooks {', '.join(HOOKS)}. Name a Callback subclass "
                                 f"(raytrain_mgpu.driver.callbacks.Callback).")
        else:
            callback = entry
        loaded.append((_label("callbacks", entry), callback))
    return loaded


class RunEvents:
    """What the runners report to: the printer's ``banner``/``step``/``epoch``, plus ``scalars``
    and ``checkpoint``; fanned out to the printer, then ``receivers`` (``(label, callback)``).

    ``failure``: the first :class:`CallbackError`, once one was raised. ``on_failure``: called
    once with it (the Ray Train runner sets it to stop the run early from the pump thread).
    """

    def __init__(self, printer, receivers: List[Tuple[str, Any]] = ()):
        self.printer = printer
        self.receivers = list(receivers)
        self.failure: Optional[CallbackError] = None
        self.on_failure: Optional[Callable[[CallbackError], None]] = None

    # the printer's events
    def banner(self, text: str) -> None:
        self.printer.banner(text)

    def step(self, step: int, total: int, epoch: int = 0) -> None:
        self.printer.step(step, total, epoch)  # the progress bar only: on_step gets the scalars

    def scalars(self, step: int, values: dict) -> None:
        self.printer.scalars(step, values)
        self._emit("on_step", step, dict(values))

    def epoch(self, row: dict) -> None:
        self.printer.epoch(row)
        self._emit("on_epoch_end", row["epoch"], dict(row))

    def checkpoint(self, path: str) -> None:
        self._emit("on_checkpoint", path)

    def train_start(self, run: RunInfo) -> None:
        self._emit("on_train_start", run)

    def train_end(self, result) -> None:
        self._emit("on_train_end", result)

    def close(self) -> None:
        """Flush and close the loggers (also after a failed run); never raises."""
        for label, receiver in self.receivers:
            close = getattr(receiver, "close", None)
            if callable(close):
                try:
                    close(failed=self.failure is not None)
                except Exception:  # a logger that cannot close must not hide the run's own outcome
                    logger.warning("%s could not close", label, exc_info=True)

    def _emit(self, hook: str, *args) -> None:
        if self.failure is not None:
            return  # the run is failing: later events would only repeat the error
        for label, receiver in self.receivers:
            method = getattr(receiver, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception as exc:
                self.failure = CallbackError(label, hook, exc)
                self.failure.__cause__ = exc
                if self.on_failure is not None:
                    self.on_failure(self.failure)
                raise self.failure from exc


@contextlib.contextmanager
def stop_main_thread_on_failure(events: RunEvents) -> Iterator[None]:
    """Around Ray Train's ``trainer.fit()`` in the main thread: a callback failure in the pump
    thread interrupts it (SIGINT to this process's main thread, which Ray Train's own handler
    answers by aborting the run, workers included), so a failed callback does not wait for
    the run's end. Elsewhere (fit in another thread) the run ends first, then the failure is raised."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lock, armed = threading.Lock(), [True]
    previous = signal.getsignal(signal.SIGINT)

    def interrupt(_failure: CallbackError) -> None:
        with lock:  # never after trainer.fit has returned
            if armed[0]:
                _thread.interrupt_main(signal.SIGINT)

    events.on_failure = interrupt
    try:
        yield
    finally:
        with lock:
            armed[0] = False
        events.on_failure = None
        signal.signal(signal.SIGINT, previous)  # Ray Train leaves its handler, bound to a finished run
