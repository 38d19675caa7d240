"""The Ray side of naming a stuck rank (the rule is ``engine/liveness.py``): every rank's heartbeat thread,
and the driver's end of a stuck attempt.

:class:`Heartbeat` runs on every rank of a Ray run (Ray Train workers, pipeline stage actors): every few
seconds it sends the rank's position to the run's progress channel (``driver/progress.ProgressSink``),
fire-and-forget, from a thread of its own, so it keeps beating while the main thread hangs in a collective,
a loader or the user's code; once the position has stood still for two beats it adds the rank's Python
stacks. :func:`fail_stuck` is the driver's answer to a :class:`~raytrain_mgpu.engine.liveness.Stall`: the
stuck ranks' processes are killed (a zero-CPU task on their node), which fails the attempt.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import asdict
from typing import Callable, Optional, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_mgpu.engine.liveness import DEFAULT_MIN_S, POSITION, Beat, Stall, stacks

logger = logging.getLogger(__name__)

__all__ = ["Heartbeat", "fail_stuck", "interval_s"]


def interval_s(timeout_s: Optional[float]) -> float:
    """Seconds between beats: a tenth of the threshold (its smallest, for the default rule), 0.5-10 s."""
    threshold = DEFAULT_MIN_S if timeout_s is None else timeout_s
    return min(10.0, max(0.5, threshold / 10))


class Heartbeat:
    """This rank's beats to ``sink`` (see the module docstring); ``group``: the id every rank of this attempt shares,
    or a function that finds it (called in the thread: it may wait). Stopped by :meth:`stop` (idempotent)."""

    def __init__(self, sink, rank: int, world_size: int, group: Union[str, Callable[[], str]],
                 timeout_s: Optional[float]):
        self.sink, self.rank, self.world_size, self.group = sink, rank, world_size, group
        self.interval_s = interval_s(timeout_s)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.enabled = sink is not None and timeout_s != 0 and world_size > 1

    def start(self) -> "Heartbeat":
        self.enabled = self.enabled and ray.is_initialized()  # a stage outside Ray (the tests' harness): no beats
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="raytrain-mgpu-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            group = self.group() if callable(self.group) else self.group
            node, node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        except Exception:  # never in the way of training: no beats
            logger.debug("no heartbeats", exc_info=True)
            return
        last = None
        still = 0
        while not self._stop.is_set():
            now = POSITION.snapshot()
            position = (now["step"], now["seq"])
            still = still + 1 if position == last else 0
            last = position
            beat = Beat(group, self.rank, self.world_size, now["step"], now["seq"], now["phase"], node, node_id,
                        os.getpid(), now["step_time_s"], stacks() if still >= 2 else None)
            try:
                self.sink.put.remote("beat", asdict(beat))  # fire-and-forget: no wait, no ref kept
            except Exception:  # the mailbox is gone (the run ended): stop quietly
                return
            self._stop.wait(self.interval_s)


def fail_stuck(stall: Stall) -> None:
    """Kill the stuck ranks' processes (a zero-CPU task on each one's node): the attempt fails, and the retry
    policy decides what comes next. A node that is gone takes its processes with it; nothing waits longer than
    ten seconds here."""
    kill = ray.remote(num_cpus=0, max_retries=0)(_kill)
    refs = []
    for beat in stall.beats:
        if not beat.node_id or not beat.pid:
            continue
        try:
            refs.append(kill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(beat.node_id, soft=False))
                        .remote(beat.pid))
        except Exception:
            logger.debug("could not ask node %s to end pid %s", beat.node, beat.pid, exc_info=True)
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=10)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
