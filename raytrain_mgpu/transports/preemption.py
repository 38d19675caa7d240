"""The Ray side of preemption notices (the engine's side is ``checkpointing/preemption.PreemptionCheck``): where a
worker's notice comes from, Ray Train's watcher where no notice can come, a pipeline stage's own watcher of
Ray's draining nodes (also the driver's, of an attempt's actor group), and whether a failed attempt was a
preemption.

Where no notice can come, no watcher (:func:`watcher_where_notices_come`). Ray Train starts its
watcher, one more actor process, when the worker group has started, so its start (importing Ray
Train: ~2.5 CPU-s) runs beside the workers' set-up and first steps. On a Ray instance that this
process started with ``ray.init()`` (``fit``'s own, or a driver's ``ray.init()`` without an address)
nothing drains a node for preemption: the cloud's reclaim is seen by ``spot-watch`` on cluster nodes,
which a driver joins by address. Measured (2 workers x 1 CPU on a 2-core machine, mlp 64 on
digits, 10 epochs, 2 runs each, /proc per process): with the watcher its process used 0.9-1.0 CPU-s
during the 1.7-1.9 s of training and was still starting when the run ended; the time in steps was
0.93 s against 0.68-0.73 s without it, the median samples/s 15,100-16,600 against 20,000-20,500, and
the workers' set-up 5.7-5.8 s against 4.6-4.9 s. ``raytrain-mgpu bench --short-epochs 10 --rounds 2``:
fit's samples/s 0.99x the hand-written Ray Train loop's without the watcher, 0.78x with it
(``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1``, the invocation after); the loop's 2 s waits between
epochs absorb the watcher's start, fit's 10 epochs (~0.7 s of steps) fell inside it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

import ray._private.state
import ray._private.worker

from raytrain_mgpu.transports.ray_train.faults import WATCHER_ENV

__all__ = ["watcher_where_notices_come", "ray_started_here", "ray_train_notices", "DrainWatcher", "was_preemption",
           "WATCHER_ENV"]


def ray_started_here() -> bool:
    """Whether this process's ``ray.init()`` started the Ray instance it is connected to (not joined
    one by address). Ray keeps that on its node object (``ray_init_cluster``); a Ray without it: False."""
    return bool(getattr(getattr(ray._private.worker, "_global_node", None), "ray_init_cluster", False))


@contextlib.contextmanager
def watcher_where_notices_come() -> Iterator[None]:
    """Around ``TorchTrainer.fit()``: Ray Train's preemption watcher off on a Ray this process started
    (see the module's docstring), on elsewhere, as Ray Train has it. A value the user set is kept."""
    if WATCHER_ENV in os.environ or not ray_started_here():
        yield
        return
    os.environ[WATCHER_ENV] = "0"
    try:
        yield
    finally:
        os.environ.pop(WATCHER_ENV, None)


def ray_preemption_info():
    # late: Ray Train (0.96 s of import) is only on its workers; the in-process runner imports this module too
    import ray.train

    return ray.train.get_preemption_info()


def ray_local_notice():
    """The notice Ray Train's watcher handed to this worker (``mark_preempt``), or None: what
    ``get_preemption_info`` broadcasts from rank 0, read here without its barrier."""
    # late: Ray Train, only on its workers (see ray_preemption_info); and tests replace the context's get_train_context
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def ray_train_notices() -> dict:
    """``PreemptionCheck``'s hooks on a Ray Train worker: its watcher's notice, and Ray's agreed one."""
    return {"get_info": ray_preemption_info, "local_notice": ray_local_notice}


def _draining_nodes() -> dict:
    """Ray's draining nodes, ``{node id: deadline in ms}`` (what Ray Train's watcher polls)."""
    return ray._private.state.state.get_draining_nodes() or {}


class DrainWatcher:
    """Notices where Ray Train's watcher does not run: a thread polls Ray's draining nodes every ``poll_s`` (Ray
    Train's interval, 5 s) and keeps the first drain of ``node_id`` (one node id, or several: a pipeline stage
    watches its own node, the driver the nodes of an attempt's actor group); :meth:`local_notice` reads it (no
    call), :meth:`poll` asks once more, :meth:`agreed` asks Ray once a rank has seen one. ``draining``: the poll
    (tests pass fakes)."""

    def __init__(self, node_id, poll_s: Optional[float] = None, draining: Callable[[], dict] = _draining_nodes):
        import threading

        self.node_ids = {node_id} if isinstance(node_id, str) else set(node_id)
        self.draining = draining
        self.poll_s = poll_s if poll_s is not None else float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", 5))
        self._seen = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-mgpu-drains", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.poll() is not None:
                return

    def poll(self):
        """The first drain of a watched node, asked of Ray now unless one was seen already (None: none; a poll that
        fails is asked again next time)."""
        if self._seen is None:
            try:
                drains = self.draining()
            except Exception:
                return None
            mine = {node: deadline for node, deadline in drains.items() if node in self.node_ids}
            if mine:
                self._seen = self._info(mine)
        return self._seen

    @staticmethod
    def _info(drains: dict):
        from ray.train.v2.api.preemption import PreemptionInfo  # late: Ray Train (see ray_preemption_info)

        deadlines = [d for d in drains.values() if d]
        return PreemptionInfo(deadline_ms=min(deadlines) if deadlines else None,
                              preempted_node_to_ranks={node: [] for node in drains})

    def local_notice(self):
        return self._seen

    def agreed(self):
        """The notice once any rank has seen one: every drained node Ray reports now (this rank's, if none)."""
        try:
            drains = self.draining()
        except Exception:
            drains = {}
        return self._info(drains) if drains else (self._seen or self._info(dict.fromkeys(self.node_ids, 0)))

    def close(self) -> None:
        self._stop.set()


def was_preemption(exc: BaseException, notice=None) -> bool:
    """Whether a failed attempt was lost to a preemption: a drain of one of its nodes was noticed (``notice``: the
    structured notice, e.g. :meth:`DrainWatcher.poll`'s, or None), or an actor died with its node drained for
    preemption (Ray marks the error)."""
    if notice is not None:
        return True
    while exc is not None:
        if getattr(exc, "preempted", False):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
