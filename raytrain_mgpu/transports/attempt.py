"""The one owner of a run's attempts on the driver, whichever transport carries them (:func:`drive`).

A transport's driver side is a :class:`Carrier`: it supplies how an attempt starts, how the driver waits for it
and how it stops (Ray Train's ``trainer.fit()`` is its start and wait; the pipeline's actor group; the engine
in the driver's own process). Everything else of an attempt lives here, once for all three:

- the run's progress channel: a ``driver/progress.ProgressSink`` and its ``SinkPump`` for ranks in other
  processes, a ``DirectSink`` for the driver's own; every event also to fit's goodput ledger;
- the cleanup: the run folder's temporary checkpoint folders removed before every attempt the driver starts
  (``driver/runlock.remove_stale_temporaries``; Ray Train's own restarts are inside one such attempt);
- the failure: a callback's error first, then the ranks the heartbeats found stuck
  (:class:`~raytrain_mgpu.errors.StuckRankError`), then the carrier's own failure made whole
  (``retry.whole_failure``); restarts by the one retry policy (``retry.run_attempts``), a preemption told by a
  structured notice (:meth:`Carrier.preemption`: Ray's drain of the attempt's node), not by a line's words;
- the result, read one way from the run folder: its newest checkpoint (``RunFolder.newest_checkpoint``, with
  Ray Train's own latest where it keeps one) and that checkpoint's history, followed by the epoch rows the
  last attempt reported after it (epochs whose weights were not finite have a row and no checkpoint).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.driver.progress import DirectSink, ProgressSink, SinkPump
from raytrain_mgpu.driver.runlock import remove_stale_temporaries
from raytrain_mgpu.errors import StuckRankError
from raytrain_mgpu.transports.base import RunResult
from raytrain_mgpu.transports.preemption import was_preemption
from raytrain_mgpu.transports.retry import Verdict, run_attempts, verdict, whole_failure

logger = logging.getLogger(__name__)

__all__ = ["Carrier", "drive"]


class Carrier:
    """A transport's driver side: :meth:`start`, :meth:`wait` and :meth:`stop` an attempt; the rest has defaults.

    ``what``: an attempt's name in the retry policy's log lines; ``retries_itself``: restarts happen inside one
    start and wait (Ray Train's controller, which asks the same policy), so the driver starts one attempt;
    ``in_process``: rank 0 is the driver's own process (its events go straight to ``fit``'s ``RunEvents``);
    ``scalar_sources``: the ranks whose per-step scalars make one step's set (``SinkPump``);
    ``late_announcements``: the last checkpoint's announcement may come after the run returned (it is waited
    for: Ray Train's controller sends it, not ordered with the run's end)."""

    what = "attempt"
    retries_itself = False
    in_process = False
    scalar_sources = 1
    late_announcements = False

    def __init__(self, cfg, plan, events):
        self.cfg, self.plan, self.events = cfg, plan, events

    def start(self, sink, attempt: int) -> None:
        """Start attempt number ``attempt`` (0 first; one more per restart), its rank 0 reporting to ``sink``."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until the attempt has trained (returns) or failed (raises)."""
        raise NotImplementedError

    def stop(self, graceful: bool) -> None:
        """After every attempt, trained (``graceful``) or failed: what :meth:`start` started goes."""

    def judge(self, exc: BaseException) -> Verdict:
        """The one retry policy's verdict on a failed attempt (``retry.verdict``)."""
        return verdict(exc)

    def preemption(self):
        """After a failed attempt, before :meth:`stop`: the notice of a preemption of one of its nodes, a
        structured record (Ray's ``PreemptionInfo``: the drained nodes and the deadline), or None."""
        return None

    def latest(self):
        """The checkpoint its own system registered last (a path; None: none), or ``...`` where the run folder
        alone holds them (``RunFolder.newest_checkpoint``'s argument)."""
        return ...

    def whole(self, exc: BaseException) -> BaseException:
        """The error ``fit`` raises for the run's failure ``exc`` (``retry.whole_failure``)."""
        return whole_failure(self.cfg, exc)


class _Recorded:
    """``fit``'s events, passed on; each epoch row also kept (by epoch: a row trained again replaces it)."""

    def __init__(self, events, rows: dict):
        self.events, self.rows = events, rows

    def epoch(self, row: dict) -> None:
        self.rows[row.get("epoch")] = row
        self.events.epoch(row)

    def __getattr__(self, name):
        return getattr(self.events, name)


class _Run:
    """What the attempts of one ``fit`` leave: rank 0's first start-up times, the last attempt's epoch rows, the
    last failure's preemption notice."""

    def __init__(self):
        self.startup: Optional[dict] = None
        self.rows: dict = {}
        self.preemption = None


def drive(carrier: Carrier) -> RunResult:
    """``carrier``'s attempts until one trains, restarted from the last checkpoint by the one retry policy (or
    inside the carrier's own, ``retries_itself``); the run's result, read from its folder. The carrier's
    ``events`` (``fit``'s ``RunEvents``) get every rank's event, its goodput ledger every attempt."""
    cfg, events, run = carrier.cfg, carrier.events, _Run()
    ledger = getattr(events, "goodput", None)

    def attempt(number: int) -> None:
        _attempt(carrier, events, ledger, run, number)

    try:
        if carrier.retries_itself:
            attempt(0)
        else:
            run_attempts(cfg, attempt, carrier.judge, preempted=lambda exc: was_preemption(exc, run.preemption),
                         what=carrier.what, ledger=ledger)
    except Exception as exc:  # the original error, out of Ray's wrappers, with where the checkpoints are
        failed = carrier.whole(exc)
        if failed is exc:
            raise
        raise failed from exc
    return _result(RunFolder.of(cfg), carrier.latest(), run)


def _attempt(carrier: Carrier, events, ledger, run: _Run, number: int) -> None:
    """One attempt: the cleanup, the channel, the carrier's start and wait, its stop, always."""
    cfg = carrier.cfg
    run.rows.clear()  # the rows after the last checkpoint are the last attempt's
    run.preemption = None
    remove_stale_temporaries(RunFolder.of(cfg))  # a failed attempt's (or killed driver's) half-written checkpoints
    recorded = _Recorded(events, run.rows)
    if carrier.in_process:
        sink = DirectSink(recorded, ledger)  # a callback's error is raised in the rank, which is this process
        try:
            carrier.start(sink, number)
            carrier.wait()
        except BaseException:
            run.preemption = carrier.preemption()
            carrier.stop(graceful=False)
            raise
        finally:
            run.startup = run.startup or sink.startup
        carrier.stop(graceful=True)
        return
    sink = ProgressSink.open()
    # every rank's heartbeats judged (engine/liveness.py); every event also in fit's goodput ledger
    pump = SinkPump(sink, recorded, scalar_sources=carrier.scalar_sources, stall_timeout_s=cfg.stall_timeout_s,
                    ledger=ledger)
    graceful = False
    try:
        try:
            with pump:
                carrier.start(sink, number)
                carrier.wait()
        except BaseException as exc:
            run.preemption = carrier.preemption()
            if pump.failure is not None:  # the run was stopped for it (or failed first): the callback's error, named
                raise pump.failure
            if isinstance(exc, Exception) and pump.stall is not None:
                raise StuckRankError(pump.stall.line, pump.stall.ranks, pump.stall.report) from exc
            raise
        graceful = True
        if carrier.late_announcements:
            _announced(RunFolder.of(cfg), carrier.latest(), pump)
        if pump.failure is not None:  # on the last events, after the run ended
            raise pump.failure
    finally:
        run.startup = run.startup or pump.startup
        try:
            carrier.stop(graceful)
        finally:
            sink.close()  # after the last drain: a closed channel drops what comes later


def _announced(folder: RunFolder, latest, pump: SinkPump) -> None:
    """Wait (bounded) for the announcement of the checkpoint the carrier's own system registered last, unless it is
    the one the run resumed from (:func:`_registered_before`)."""
    if isinstance(latest, str) and not _registered_before(latest, pump.startup):
        pump.wait_for_checkpoint(folder.uri_of(latest))


def _registered_before(path: str, startup: Optional[dict]) -> bool:
    """Whether the run's last checkpoint is the one its first attempt resumed from (this fit registered none, e.g.
    every save skipped for non-finite weights): announced by an earlier ``fit``, not in this one."""
    resumed = (startup or {}).get("resumed_from")
    return bool(resumed) and os.path.basename(resumed.rstrip("/")) == os.path.basename(path.rstrip("/"))


def _newest(folder: RunFolder, latest):
    """The run's newest checkpoint and its URI (Ray Train's own path for the one it registered), or None."""
    newest = folder.newest_checkpoint(latest)
    if newest is None:
        return None
    own = isinstance(latest, str) and os.path.basename(latest.rstrip("/")) == newest.name
    return newest, folder.uri_of(latest) if own else newest.uri


def _result(folder: RunFolder, latest, run: _Run) -> RunResult:
    """The run's result from its folder: the newest checkpoint, its history, then the epoch rows the last attempt
    reported after it (trained, not checkpointed: weights that were not finite)."""
    newest = _newest(folder, latest)
    history = [] if newest is None else folder.checkpoint_history(newest[0].path)
    last = max((row.get("epoch") or 0 for row in history), default=0)
    history += [run.rows[epoch] for epoch in sorted(e for e in run.rows if e is not None and e > last)]
    return RunResult(history, None if newest is None else newest[1], run.startup)
