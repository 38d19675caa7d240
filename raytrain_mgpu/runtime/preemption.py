"""Preemption notices on the workers: a step checkpoint saved right away, then training goes on.

In Ray a preemption notice is a node drain with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
deadline (``raytrain-mgpu spot-watch`` issues it on a spot node: ``runtime/spot_watch.py``).
Ray Train's watcher polls the drained nodes (every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``,
5 s) and hands the notice to every worker; ``ray.train.get_preemption_info()`` returns it.

Every :data:`CHECK_EVERY_N_STEPS` optimizer steps every rank looks at the notice Ray Train's watcher
left on its own worker (no call, no barrier) and the ranks agree whether any has one with a
one-number all-reduce on a gloo group of their own; only then does every rank call
``ray.train.get_preemption_info()``, Ray's agreed notice (a barrier over the ranks). On the first
notice of a run attempt the loop saves a step checkpoint (the same one as
``checkpoint_every_n_steps``: the resume continues mid-epoch), tells the driver, and keeps training:
Ray Train tears the group down at the deadline (plus ``preemption_grace_s``) and restarts it from
that checkpoint, counting the restart against ``max_preemption_failures``, not ``max_failures``.
Returning instead would end the run as finished.

Why not ``get_preemption_info()`` at every check, as Ray's docs show: measured with
``raytrain-mgpu bench-preemption`` (2 CPU workers of a ``TorchTrainer``, 2-core machine), one call
takes ~2 ms (Ray's synchronization actor), 0.2 ms a step at a check every 10 steps: 8 % of the
README's 2.4 ms steps, most of what ``fit`` trailed a hand-written loop by. The
all-reduce of a flag takes a tenth of that (the bench prints both). A notice is acted on at most
10 steps after Ray's watcher has handed it to a worker.

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
import time
from typing import Callable, Iterator, Optional

from raytrain_mgpu.runtime.faults import WATCHER_ENV
from raytrain_mgpu.runtime.step_checkpoints import step_checkpoint_due

__all__ = ["PreemptionCheck", "CHECK_EVERY_N_STEPS", "notice_line", "resume_line", "watcher_where_notices_come",
           "WATCHER_ENV", "DrainWatcher", "was_preemption"]

CHECK_EVERY_N_STEPS = 10
"""Global optimizer steps between two ``get_preemption_info`` barriers."""


def ray_started_here() -> bool:
    """Whether this process's ``ray.init()`` started the Ray instance it is connected to (not joined
    one by address). Ray keeps that on its node object (``ray_init_cluster``); a Ray without it: False."""
    import ray._private.worker

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


def _ray_preemption_info():
    import ray.train  # only on a Ray Train worker (the loop without Ray never checks)

    return ray.train.get_preemption_info()


def _ray_local_notice():
    """The notice Ray Train's watcher handed to this worker (``mark_preempt``), or None: what
    ``get_preemption_info`` broadcasts from rank 0, read here without its barrier."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


class AnyRank:
    """``any_rank(seen)``: whether any rank's ``seen`` is true, the same answer on every rank.

    One all-reduce (max) of one number on a gloo group of the ranks' own, made at the first call
    (every rank makes its first check at the same global step): a CPU tensor whatever the training
    backend, so a check never waits for a GPU's queued work. Without a process group (one worker
    outside Ray Train) the rank's own answer.
    """

    def __init__(self):
        self._group = None

    def __call__(self, seen: list) -> list:
        """Every flag of ``seen`` true on some rank (one all-reduce of all of them)."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return list(seen)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        flags = torch.tensor([1 if flag else 0 for flag in seen], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return [bool(flag) for flag in flags.tolist()]


def notice_line(info, step: int, now_s: Optional[float] = None) -> str:
    """The driver's one line for a notice: the drained node(s), the time left, the step saved."""
    nodes = ", ".join(node[:12] for node in sorted(info.preempted_node_to_ranks)) or "?"
    deadline = ""
    if info.deadline_ms:
        left = info.deadline_ms / 1000 - (time.time() if now_s is None else now_s)
        deadline = f", deadline in {max(left, 0):.0f} s"
    return f"preempted (node {nodes}{deadline}): saved step {step}"


def resume_line(step: int, epoch: int, step_in_epoch: int, steps_per_epoch: int) -> str:
    """The driver's one line when a restarted (or resumed) run starts training again."""
    where = f"{step_in_epoch}/{steps_per_epoch} steps of epoch {epoch + 1} done" if step_in_epoch else f"epoch {epoch + 1}"
    return f"resuming at step {step} ({where})"


class PreemptionCheck:
    """The loop's preemption hook for one run attempt (a restart builds a new one).

    ``local_notice``: this worker's notice, without a barrier; ``any_rank``: whether any rank saw one
    (:class:`AnyRank`); ``get_info``: ``ray.train.get_preemption_info``, the ranks' agreed notice (tests
    pass fakes).
    """

    def __init__(self, cfg, reporter=None, every: int = CHECK_EVERY_N_STEPS, get_info: Optional[Callable] = None,
                 local_notice: Optional[Callable] = None, any_rank: Optional[Callable[[bool], bool]] = None,
                 enabled: bool = True, since_save: Optional[Callable[[], float]] = None):
        self.cfg, self.reporter, self.every = cfg, reporter, every
        # checkpoint_every_n_minutes: the seconds since the last checkpoint, on this rank's clock; the ranks agree at
        # the same check whether any clock says a checkpoint is due (the checks' all-reduce carries it too)
        minutes = getattr(cfg, "checkpoint_every_n_minutes", None)
        self.interval_s = None if minutes is None or since_save is None else minutes * 60.0
        self.since_save = since_save
        # A Ray Data stream restarts its epoch on resume (config_checks refuses checkpoint_every_n_steps
        # with it): a step checkpoint could not continue mid-epoch, so such a run does not ask. Nor does a
        # transport where no notice can come (``enabled=False``: the in-process runner).
        self.enabled = enabled and getattr(cfg, "ingest", None) != "ray_data"
        self.get_info = get_info or _ray_preemption_info
        self.local_notice = local_notice or _ray_local_notice
        self.any_rank = any_rank or AnyRank()
        self.notice = None  # the first notice of this attempt; no check after it
        self.checks = 0  # checks this rank made (every rank the same number)
        self._announced = False

    def resumed(self, state, steps_per_epoch: int) -> None:
        """Once per attempt, where training starts again after a checkpoint: one driver line."""
        if self._announced:
            return
        self._announced = True
        if state.step and self.reporter is not None:
            self.reporter.notice(resume_line(state.step, state.epoch, state.step_in_epoch, steps_per_epoch))

    def after_step(self, step: int, step_in_epoch: int, steps_per_epoch: int, save: Callable[[], None]) -> bool:
        """After global ``step`` (the ``step_in_epoch``-th of the epoch): save if a step checkpoint is
        due (``checkpoint_every_n_steps``, or ``checkpoint_every_n_minutes`` on any rank's clock) or a first notice
        came; True if it saved."""
        due = step_checkpoint_due(self.cfg, step, step_in_epoch, steps_per_epoch)
        notice, time_due = self._poll(step)
        # At the epoch's end (or max_steps) the epoch checkpoint is written next: that one is the save.
        mid_epoch = step_in_epoch < steps_per_epoch and (self.cfg.max_steps is None or step < self.cfg.max_steps)
        saved = due or ((notice is not None or time_due) and mid_epoch)
        if saved:
            save()
        if notice is not None and self.reporter is not None:
            self.reporter.notice(notice_line(notice, step))
        return saved

    def _poll(self, step: int) -> tuple:
        """``(the notice, the first time a check sees one, else None; whether a time-based checkpoint is due)``;
        between checks ``(None, False)``."""
        asks = self.enabled and self.notice is None
        if step % self.every or not (asks or self.interval_s is not None):
            return None, False
        self.checks += 1
        local = [asks and self.local_notice() is not None,
                 self.interval_s is not None and self.since_save() >= self.interval_s]
        # Every rank reaches a check at the same global steps: the all-reduce and the barrier meet.
        seen, time_due = self.any_rank(local)
        if not seen:
            return None, time_due
        # None while the notice has reached another rank but not yet rank 0 (Ray broadcasts rank 0's):
        # the next check asks again.
        self.notice = self.get_info()
        return self.notice, time_due


# ----------------------------------------------------------------------------- without Ray Train (the pipeline)


def _draining_nodes() -> dict:
    """Ray's draining nodes, ``{node id: deadline in ms}`` (what Ray Train's watcher polls)."""
    import ray._private.state

    return ray._private.state.state.get_draining_nodes() or {}


class DrainWatcher:
    """Notices where Ray Train's watcher does not run (a pipeline's stage actors): a thread polls Ray's draining
    nodes every ``poll_s`` (Ray Train's interval, 5 s) and keeps this node's drain; :meth:`local_notice` reads it
    (no call), :meth:`agreed` asks Ray once a rank has seen one. ``draining``: the poll (tests pass fakes)."""

    def __init__(self, node_id: str, poll_s: Optional[float] = None, draining: Callable[[], dict] = _draining_nodes):
        import threading

        self.node_id, self.draining = node_id, draining
        self.poll_s = poll_s if poll_s is not None else float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", 5))
        self._seen = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-mgpu-drains", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                drains = self.draining()
            except Exception:  # the next poll asks again
                continue
            if self.node_id in drains:
                self._seen = self._info({self.node_id: drains[self.node_id]})
                return

    @staticmethod
    def _info(drains: dict):
        from ray.train.v2.api.preemption import PreemptionInfo

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
        return self._info(drains) if drains else (self._seen or self._info({self.node_id: 0}))

    def close(self) -> None:
        self._stop.set()


def was_preemption(exc: BaseException, notices: list) -> bool:
    """Whether a failed attempt was lost to a preemption: a notice reached the driver during it (``notices``: its
    lines), or an actor died with its node drained for preemption (Ray marks the error)."""
    if any(line.startswith("preempted") for line in notices):
        return True
    while exc is not None:
        if getattr(exc, "preempted", False):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
