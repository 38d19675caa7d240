"""A rank that stops making progress is named within minutes, not when ``collective_timeout_s`` fires.

Each rank keeps its :data:`POSITION`: the global step it is in and a count of the marks the engine passes
within that step (data waited for, batch in hand, backward begun, checkpoint, evaluation batches), each a
plain attribute write: no I/O, no collective, no host-device sync. A heartbeat thread on every rank of a
Ray run (``driver/heartbeat.Heartbeat``) sends the position to the driver's mailbox every few seconds, with
the rank's Python stacks once it has stood still a while. The driver's :class:`Judge` (fed by the progress
pump) names a rank as stuck when

- it has not moved for the threshold while another rank of its group stands further on (the others wait
  for it in a collective: in DDP the waiting rank is inside its backward's all-reduce, one mark further), or
- its heartbeats stopped for the threshold while the others' still come (a frozen process, a lost link).

Ranks that all stand at the same place (a long checkpoint write, a slow evaluation, a collective every rank
waits in) are not judged: nobody is behind, and ``collective_timeout_s`` stays the backstop. The threshold is
``TrainConfig.stall_timeout_s``, by default ``max(120 s, 20 x the median step time)``; 0 turns this off. The
pump then fails the attempt (the stuck process is killed), so the retry policy applies
(``transports/retry.py``), and the error names the rank, node, step and what it was doing, with its stacks.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional

__all__ = ["POSITION", "Position", "Beat", "Judge", "Stall", "stacks", "WAITING", "DEFAULT_MIN_S",
           "DEFAULT_STEP_FACTOR"]

WAITING = "waiting"
"""The start of a phase in which a rank waits for another (a pipeline stage's receive): never the stuck one while
another rank works."""
DEFAULT_MIN_S = 120.0
DEFAULT_STEP_FACTOR = 20.0
_MAX_STACK_CHARS = 12_000


class Position:
    """Where this process's rank is in its run (see the module docstring). The engine writes it; the heartbeat
    thread reads it. ``stepped``: whether this attempt took a step (the retry policy's "before the first step")."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new attempt begins, in the thread that trains (its stack comes first in :func:`stacks`)."""
        self.step, self.seq, self.phase, self.stepped = 0, 0, "setup", False
        self.thread = threading.get_ident()
        self.changed = time.monotonic()
        self.step_times: deque = deque(maxlen=64)

    def mark(self, phase: str) -> None:
        """One more mark within the step (every rank passes the same marks in the same order)."""
        self.seq += 1
        self.phase = phase
        self.changed = time.monotonic()

    def at_step(self, step: int) -> None:
        """A new step begins (``step`` optimizer steps done so far)."""
        self.step, self.seq, self.phase = step, 0, "step"
        self.changed = time.monotonic()

    def stepped_in(self, seconds: float) -> None:
        """A step ended, after ``seconds``."""
        self.stepped = True
        self.step_times.append(seconds)

    def median_step_s(self) -> Optional[float]:
        times = list(self.step_times)
        return statistics.median(times) if times else None

    def snapshot(self) -> dict:
        return {"step": self.step, "seq": self.seq, "phase": self.phase, "step_time_s": self.median_step_s(),
                "still_s": time.monotonic() - self.changed}


POSITION = Position()
"""This process's rank (one engine runs at a time in a process)."""


def stacks(limit: int = _MAX_STACK_CHARS) -> str:
    """Every thread's Python stack, the training thread's first (as ``faulthandler`` prints them, as text)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    training = getattr(POSITION, "thread", threading.main_thread().ident)
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != training)
    parts = []
    for ident, frame in frames:
        if ident == threading.get_ident():
            continue  # the heartbeat thread itself
        label = " (training)" if ident == training else ""
        parts.append(f"Thread {names.get(ident, ident)}{label}:\n" + "".join(traceback.format_stack(frame)))
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + "\n... (cut)"


@dataclass
class Beat:
    """One heartbeat of one rank (what ``driver/progress.Heartbeat`` sends)."""

    group: str
    rank: int
    world_size: int
    step: int
    seq: int
    phase: str
    node: str = ""
    node_id: str = ""
    pid: int = 0
    step_time_s: Optional[float] = None
    stack: Optional[str] = None

    @property
    def position(self) -> tuple:
        return (self.step, self.seq)

    def where(self) -> str:
        return f"rank {self.rank} (node {self.node}, pid {self.pid})"


@dataclass
class Stall:
    """The judge's finding: the stuck ranks' last beats, a one-line summary and the report with stacks."""

    beats: List[Beat]
    reason: str
    threshold_s: float
    line: str = ""
    report: str = ""

    def __post_init__(self) -> None:
        what = "; ".join(f"{b.where()} at step {b.step} ({b.phase})" for b in self.beats)
        self.line = (f"stuck: {what}: {self.reason} for {self.threshold_s:.0f} s (stall_timeout_s); failing the "
                     f"attempt")
        self.report = "\n".join(
            f"{b.where()}, last at step {b.step} doing {b.phase}; its Python stacks:\n{b.stack}" if b.stack else
            f"{b.where()}, last at step {b.step} doing {b.phase}; no stacks (its heartbeats stopped)"
            for b in self.beats)

    @property
    def ranks(self) -> List[int]:
        return [b.rank for b in self.beats]


@dataclass
class _Seen:
    beat: Beat
    seen: float
    moved: float


@dataclass
class Judge:
    """The driver's side (see the module docstring): ``add`` every beat with the driver's clock (never the
    workers': their clocks may disagree), ask :meth:`stall` after; a group is judged once."""

    timeout_s: Optional[float] = None
    group: Optional[str] = None
    ranks: Dict[int, _Seen] = field(default_factory=dict)
    judged: set = field(default_factory=set)

    @property
    def enabled(self) -> bool:
        return self.timeout_s is None or self.timeout_s > 0

    def threshold_s(self) -> float:
        if self.timeout_s is not None:
            return float(self.timeout_s)
        times = [s.beat.step_time_s for s in self.ranks.values() if s.beat.step_time_s]
        return max(DEFAULT_MIN_S, DEFAULT_STEP_FACTOR * statistics.median(times)) if times else DEFAULT_MIN_S

    def add(self, beat: Beat, now: float) -> None:
        if beat.group != self.group:
            if beat.group in self.judged:
                return  # a late beat of a group already failed
            self.group, self.ranks = beat.group, {}  # a new attempt's group: the old one is gone
        seen = self.ranks.get(beat.rank)
        still = seen is not None and seen.beat.position == beat.position
        moved = seen.moved if still else now
        if beat.stack is None and still:  # the stacks of a rank standing still stay until it moves
            beat.stack = seen.beat.stack
        self.ranks[beat.rank] = _Seen(beat, now, moved)

    def stall(self, now: float) -> Optional[Stall]:
        if not self.enabled or self.group is None or self.group in self.judged or len(self.ranks) < 2:
            return None
        limit = self.threshold_s()
        beating = [s for s in self.ranks.values() if now - s.seen <= limit]
        silent = [s for s in self.ranks.values() if now - s.seen > limit]
        if silent and beating:
            return self._found(silent, "its heartbeats stopped while the other ranks' still come", limit)
        world = max(s.beat.world_size for s in self.ranks.values())
        if len(self.ranks) < world:
            return None  # a rank has not beaten yet: judged once all have
        still = [s for s in self.ranks.values() if now - s.moved > limit]
        working = [s for s in still if not s.beat.phase.startswith(WAITING)]
        if working and len(working) < len(still) == len(self.ranks):  # the others wait (a pipeline's receives)
            return self._found(working, "no progress while the other ranks wait for it", limit)
        furthest = max(s.beat.position for s in self.ranks.values())
        behind = [s for s in working if s.beat.position < furthest]
        if behind:
            low = min(s.beat.position for s in behind)
            return self._found([s for s in behind if s.beat.position == low],
                               "no progress while another rank stands further on", limit)
        return None

    def _found(self, seen: List[_Seen], reason: str, limit: float) -> Stall:
        self.judged.add(self.group)
        return Stall(sorted((s.beat for s in seen), key=lambda b: b.rank), reason, limit)
