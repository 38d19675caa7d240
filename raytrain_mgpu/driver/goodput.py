"""The goodput ledger: where a run's wall time went, by kind, across its attempts (``TrainResult.goodput``).

The driver records each attempt in ``goodput.json`` in the run folder (:class:`Ledger`), after every attempt and at the
end, so that a driver that dies leaves what it knew; :func:`read_ledger` reads it back without Ray. One record per
attempt, every transport's from the same two sources:

- the attempt loop: :func:`~raytrain_mgpu.transports.retry.run_attempts` (the in-process runner, the pipeline's actor
  group) marks when the driver starts an attempt and when it saw it fail; Ray Train's controller tells the driver of
  a failure it detected (``transports/ray_train/policy.CheckpointAnnouncer``);
- rank 0's events on the run's progress channel (``driver/progress.py``): its start-up (when its first step began),
  its first step (the step it resumed from is the one before), and its last step, sent when the attempt ends (or the
  last step event that came, for a process that was killed); every checkpoint announced counts a save.

The kinds, in seconds (a ``fit`` call that resumes a run adds its time to the earlier calls'):

- ``startup``: from each attempt's start to its first step (the first attempt's from ``fit``'s call). An attempt
  starts when the driver's attempt loop starts it or, on Ray Train, when its controller found the failure before it
  (there the old worker group's shutdown and the new one's start are the new attempt's start-up);
- ``restart``: from a failed attempt's last step to the next attempt's start (the failure's detection, and in the
  driver's loop the teardown; the step the failure cut short);
- ``redone``: the steps trained again: a failed attempt's steps after the checkpoint the next attempt resumed from,
  counted at the run's mean step time (``training_s`` over the steps: their data waits included);
- ``productive``, ``data_wait``, ``checkpoint``, ``eval``: the kept epochs' history rows (``training_s`` less its
  data wait, the data wait, ``checkpoint_s``, ``eval_s``); a resumed epoch's row holds the steps its earlier attempt
  kept in a step checkpoint;
- ``wall``: from ``fit``'s call to the end of its last attempt on rank 0.

The rule for an epoch a failure cut short: its steps up to the checkpoint the next attempt resumed from are in the
resumed epoch's row (the step checkpoint carries their times), the steps after it are ``redone``, and the stall of
that last step checkpoint is in no kind. With each epoch's end (its reductions; in the driver's own process also the
epoch's line, loggers and callbacks) that is what the kinds leave out: they add up to ``wall`` within a few per cent.

The figures a projection reads (``planning/goodput.py``): ``step_s`` (the mean step), ``checkpoint_s`` (the mean
stall per save), ``interval_s`` (the mean training time between saves, the stalls not included), ``startup_s`` (the
first attempt's), ``restart_s`` (from a failed attempt's last step to the next one's first, the mean; None without a
restart), ``saves``, ``restarts``, ``redone_steps``; with replica groups ``short_steps`` (steps averaged over fewer
groups than the run has: where a recovered run differs from an uninterrupted one) and ``dropped_steps``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

from raytrain_mgpu.checkpointing.run_folder import RunFolder

logger = logging.getLogger(__name__)

__all__ = ["Ledger", "read_ledger", "summarize", "describe", "LEDGER_FILE", "KINDS"]

LEDGER_FILE = "goodput.json"
KINDS = ("productive", "redone", "startup", "checkpoint", "eval", "data_wait", "restart")
"""The kinds that add up to ``wall``."""


class Ledger:
    """One ``fit`` call's record of its attempts (see the module docstring), written to ``folder``'s
    ``goodput.json`` after the earlier calls' (None: kept in memory). Every method is safe from any thread and never
    raises: the ledger must not fail training."""

    def __init__(self, folder=None, started: Optional[float] = None):
        self.folder, self._lock = folder, threading.Lock()
        try:  # the earlier fit calls' attempts on this run
            earlier = (folder.read_json(folder.join(LEDGER_FILE)) if folder is not None else None) or {}
        except Exception:
            logger.warning("could not read %s: this call's time is recorded alone", LEDGER_FILE, exc_info=True)
            earlier = {}
        self.sessions: List[dict] = list(earlier.get("sessions") or [])
        self.session = {"start": time.time() if started is None else started, "end": None, "saves": 0, "attempts": []}
        self.sessions.append(self.session)

    # ------------------------------------------------------------------ the attempt loop

    def begin(self, now: Optional[float] = None) -> None:
        """The driver starts an attempt."""
        with self._lock:
            attempts = self.session["attempts"]
            self._new(self.session["start"] if not attempts else time.time() if now is None else now)

    def end(self, failed: bool, now: Optional[float] = None) -> None:
        """The driver saw the current attempt end (``failed``: with an error)."""
        with self._lock:
            attempt = self._current()
            if attempt is not None and attempt.get("end") is None:
                now = time.time() if now is None else now
                attempt["end"], attempt["failed"] = now if failed else attempt.get("finished", now), failed
        self.write()

    def close(self, now: Optional[float] = None) -> None:
        """``fit``'s run is over (trained, or failed for good)."""
        with self._lock:
            attempt, now = self._current(), time.time() if now is None else now
            if attempt is not None and attempt.get("end") is None:
                attempt["end"] = attempt.get("finished", now)
            self.session["end"] = attempt["end"] if attempt is not None else now
        self.write()

    # ------------------------------------------------------------------ rank 0's events

    def event(self, kind: str, payload) -> None:
        """One event of the run's progress channel (``WorkerReporter``'s kinds, the controller's ``failed``)."""
        try:
            with self._lock:
                written = self._event(kind, payload)
            if written:
                self.write()
        except Exception:  # progress never fails training
            logger.debug("goodput event %s not recorded", kind, exc_info=True)

    def _event(self, kind: str, payload) -> bool:
        attempt = self._current()
        if kind == "startup":
            if attempt is None or attempt.get("first_step") is not None or attempt.get("end") is not None:
                # an attempt the driver did not start (Ray Train's controller): from the last one's failure
                start = attempt.get("end") if attempt is not None else self.session["start"]
                attempt = self._new(start if start is not None else payload["entered"])
            attempt["first_step"] = payload["first_step"]
            return True
        if attempt is None:
            return False
        if kind == "step":  # (steps done in the epoch, steps per epoch, epoch from 1)
            done, total, epoch = payload
            step = (epoch - 1) * total + done
            attempt.setdefault("resumed", step - 1)  # its first step's event is always sent
            attempt["reached"], attempt["reached_at"] = max(step, attempt.get("reached") or 0), time.time()
        elif kind == "reached":  # rank 0's last step and its time, and when its attempt ended there
            attempt["reached"], attempt["reached_at"], attempt["finished"] = (
                payload["step"], payload["at"], payload["finished"])
        elif kind == "failed" and attempt.get("end") is None:  # Ray Train's controller detected a failure
            attempt["end"], attempt["failed"] = payload, True
            return True
        elif kind == "checkpoint":
            self.session["saves"] += 1
        return False

    def _new(self, start: float) -> dict:
        attempt = {"start": start, "first_step": None, "end": None, "failed": False}
        self.session["attempts"].append(attempt)
        return attempt

    def _current(self) -> Optional[dict]:
        attempts = self.session["attempts"]
        return attempts[-1] if attempts else None

    def write(self) -> None:
        if self.folder is None:
            return
        try:
            with self._lock:
                record = {"version": 1, "sessions": self.sessions}
                self.folder.write_json(LEDGER_FILE, record)
        except Exception:
            logger.warning("could not write %s", self.folder.join(LEDGER_FILE), exc_info=True)

    def summary(self, rows: list) -> dict:
        """The ledger of this run, with the epochs of ``rows`` (the run's history); empty if it cannot be made (a
        finished run's result is not lost for it)."""
        try:
            with self._lock:
                return summarize(self.sessions, rows)
        except Exception:
            logger.warning("could not sum up where the run's time went", exc_info=True)
            return {}


# ----------------------------------------------------------------------------- the arithmetic


def _attempt_times(session: dict) -> tuple:
    """``(startup, restart, restart spans, wall)`` of one ``fit`` call's attempts."""
    attempts, start = session.get("attempts") or [], session["start"]
    startup = restart = 0.0
    spans = []  # from a failed attempt's last step to the next attempt's first
    end = session.get("end")
    last_known = start
    for i, attempt in enumerate(attempts):
        begun = start if i == 0 else attempt.get("start", last_known)
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        first = attempt.get("first_step")
        # a driver killed mid-attempt recorded no end: its attempt's last step is the last time known
        stop = (attempt.get("end") or (following or {}).get("start") or end
                or max(attempt.get("reached_at") or 0.0, first or 0.0, begun))
        startup += max((first if first is not None else stop) - begun, 0.0)
        last = max(attempt.get("reached_at") or 0.0, first) if first is not None else stop
        if following is not None:
            restart += max(following.get("start", stop) - last, 0.0)
            if following.get("first_step") is not None:
                spans.append(following["first_step"] - last)
        last_known = stop
    return startup, restart, spans, (end if end is not None else last_known) - start


def _redone_steps(attempts: list) -> int:
    """The steps trained twice: each attempt's steps after the step the next one resumed from."""
    redone = 0
    for attempt, following in zip(attempts, attempts[1:]):
        reached, resumed = attempt.get("reached"), following.get("resumed")
        if reached is not None and resumed is not None:
            redone += max(reached - resumed, 0)
    return redone


def summarize(sessions: list, rows: list) -> dict:
    """The ledger (the module docstring's kinds and figures) of the attempt records ``sessions`` (``goodput.json``'s)
    and the run's history ``rows``."""
    rows = [row for row in rows or [] if row.get("training_s") is not None]
    training = sum(row["training_s"] for row in rows)
    data_wait = sum(row["training_s"] * (row.get("data_wait_share") or 0.0) for row in rows)
    steps, before = 0, 0
    for row in rows:
        steps, before = steps + max(row["step"] - before, 0), row["step"]
    step_s = training / steps if steps else None
    startup = restart = wall = 0.0
    spans: list = []
    first_startup = None
    for session in sessions:
        s_startup, s_restart, s_spans, s_wall = _attempt_times(session)
        attempts = session.get("attempts") or []
        if first_startup is None and attempts and attempts[0].get("first_step") is not None:
            first_startup = attempts[0]["first_step"] - session["start"]
        startup, restart, wall = startup + s_startup, restart + s_restart, wall + s_wall
        spans += s_spans
    redone_steps = _redone_steps([attempt for session in sessions for attempt in session.get("attempts") or []])
    kinds = {"productive": training - data_wait, "redone": redone_steps * (step_s or 0.0), "startup": startup,
             "checkpoint": sum(row.get("checkpoint_s") or 0.0 for row in rows),
             "eval": sum(row.get("eval_s") or 0.0 for row in rows), "data_wait": data_wait, "restart": restart}
    saves = sum(session.get("saves") or 0 for session in sessions)
    trained = kinds["productive"] + kinds["redone"] + kinds["data_wait"] + kinds["eval"]
    return {**kinds, "wall": wall, "checkpoint_s": kinds["checkpoint"] / saves if saves else None,
            "restart_s": sum(spans) / len(spans) if spans else None, "startup_s": first_startup, "step_s": step_s,
            "interval_s": trained / saves if saves else None, "saves": saves,
            "restarts": sum(max(len(session.get("attempts") or []) - 1, 0) for session in sessions),
            "redone_steps": redone_steps,
            # fault_tolerance="replica_groups": steps averaged over fewer groups than the run has (a group lost or
            # not yet back), steps no group counted (a group lost inside one): engine/replica_groups.py
            "short_steps": sum(row.get("short_steps") or 0 for row in rows),
            "dropped_steps": sum(row.get("dropped_steps") or 0 for row in rows)}


# ----------------------------------------------------------------------------- reading and showing


def read_ledger(run: str) -> dict:
    """The ledger of the run folder ``run`` (a path or URI), from its ``goodput.json`` and history, without Ray.
    FileNotFoundError for a run folder without one (a run trained before the ledger was kept, or none there)."""
    folder = RunFolder(run)
    record = folder.read_json(folder.join(LEDGER_FILE))
    if not record or not record.get("sessions"):
        raise FileNotFoundError(f"{folder.display} has no {LEDGER_FILE}: no run was trained there by a version of "
                                f"raytrain-mgpu that records where its time went. Train (or resume) it to record one.")
    rows = folder.read_history()
    if rows is None:  # a driver killed before it wrote history.parquet: the newest checkpoint's
        rows = folder.state().history
    return summarize(record["sessions"], rows)


def describe(ledger: dict) -> str:
    """The CLI's line: each kind's seconds and share of the wall time (empty for no ledger)."""
    wall = (ledger or {}).get("wall")
    if not wall:
        return ""
    parts = ", ".join(f"{kind.replace('_', ' ')} {ledger[kind]:.3g} s ({100 * ledger[kind] / wall:.2g} %)"
                      for kind in KINDS if ledger.get(kind))
    short = (f"; {ledger['short_steps']} steps averaged over fewer replica groups than the run has"
             if ledger.get("short_steps") else "")
    return f"\n  time:       {wall:.1f} s: {parts}{short}"
