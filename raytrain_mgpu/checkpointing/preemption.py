"""The checkpoint triggers (:class:`PreemptionCheck`: every N steps, every N minutes, a preemption notice) and the
notices on the workers: a step checkpoint saved right away, then training goes on.

In Ray a preemption notice is a node drain with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
deadline (``raytrain-mgpu spot-watch`` issues it on a spot node: ``driver/spot_watch.py``).
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

The Ray side (the notice's source, the watcher where no notice can come, a pipeline's drains) is
``transports/preemption.py``, handed to :class:`PreemptionCheck` by the transport: nothing here imports Ray.
"""


from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from raytrain_mgpu.data.ingest import resumes_mid_epoch
from raytrain_mgpu.engine.run_state import at_max_steps
from raytrain_mgpu.checkpointing.step_checkpoints import step_checkpoint_due

__all__ = ["PreemptionCheck", "CHECK_EVERY_N_STEPS", "notice_line", "resume_line", "AnyRank", "SaveClock",
           "young_daly_s", "AUTO_FIRST_INTERVAL_S"]

CHECK_EVERY_N_STEPS = 10
"""Global optimizer steps between two ``get_preemption_info`` barriers."""


AUTO_FIRST_INTERVAL_S = 600.0
"""``checkpoint_every_n_minutes="auto"`` before this attempt's first save is measured: a step checkpoint after 10
minutes (or the first epoch's end, which always saves, if that comes first)."""


def young_daly_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young and Daly's checkpoint interval, ``sqrt(2 C M)``: the one that wastes least (to first order) when a save
    stalls training ``C`` seconds and failures come every ``M`` seconds on average."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


class SaveClock:
    """A rank's clock of its checkpoints in one attempt: ``clock()`` is the seconds since the last one, ``stalls_s``
    what each save held the training thread (:meth:`saved`, where the save happens), and
    :meth:`interval_s` the ``"auto"`` interval from them."""

    def __init__(self, num_devices: int = 1):
        self.num_devices = max(1, num_devices)  # the run's GPUs (workers on CPU): the MTBF is the whole run's
        self.last = time.monotonic()
        self.stalls_s: list = []

    def __call__(self) -> float:
        return time.monotonic() - self.last

    def saved(self, stall_s: float) -> None:
        self.stalls_s.append(stall_s)
        self.last = time.monotonic()

    def interval_s(self, reclaims_per_gpu_hour: float) -> float:
        """Young-Daly's interval from this attempt's mean stall per save and the run's MTBF, ``3600 / (N R)`` for
        ``N`` devices; :data:`AUTO_FIRST_INTERVAL_S` until a save is measured."""
        if not self.stalls_s:
            return AUTO_FIRST_INTERVAL_S
        mtbf_s = 3600.0 / (self.num_devices * reclaims_per_gpu_hour)
        return young_daly_s(sum(self.stalls_s) / len(self.stalls_s), mtbf_s)


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
    """The checkpoint triggers of one run attempt (a restart builds a new one): when a step checkpoint is due, every
    ``checkpoint_every_n_steps``, every ``checkpoint_every_n_minutes`` (any rank's clock) or at the first preemption
    notice; the epoch's end always saves (``CheckpointManager.save_epoch``).

    ``local_notice``: this worker's notice, without a barrier; ``any_rank``: whether any rank saw one
    (:class:`AnyRank`); ``get_info``: the ranks' agreed notice (``ray.train.get_preemption_info`` on Ray Train,
    from the transport: ``transports/preemption.py``; tests pass fakes). Without both, no notice is asked for.
    """

    def __init__(self, cfg, reporter=None, every: int = CHECK_EVERY_N_STEPS, get_info: Optional[Callable] = None,
                 local_notice: Optional[Callable] = None, any_rank: Optional[Callable[[bool], bool]] = None,
                 enabled: bool = True, since_save: Optional[Callable[[], float]] = None):
        self.cfg, self.reporter, self.every = cfg, reporter, every
        # checkpoint_every_n_minutes: the seconds since the last checkpoint, on this rank's clock; the ranks agree at
        # the same check whether any clock says a checkpoint is due (the checks' all-reduce carries it too). "auto":
        # Young-Daly's interval, asked of the clock (a SaveClock) at each check, as the saves' stalls come in.
        minutes = getattr(cfg, "checkpoint_every_n_minutes", None)
        self.minutes = None if since_save is None else minutes
        self.since_save = since_save
        # A user's own Ray Dataset that is not materialized streams in Ray Data's order and restarts its epoch on
        # resume: a step checkpoint could not continue mid-epoch, so such a run does not ask
        # (data/ingest.resumes_mid_epoch). Nor does a transport where no notice can come (``enabled=False``: the
        # in-process runner).
        self.enabled = (enabled and resumes_mid_epoch(cfg) and get_info is not None and local_notice is not None)
        self.get_info, self.local_notice = get_info, local_notice
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
        mid_epoch = step_in_epoch < steps_per_epoch and not at_max_steps(self.cfg, step)
        saved = due or ((notice is not None or time_due) and mid_epoch)
        if saved:
            save()
        if notice is not None and self.reporter is not None:
            self.reporter.notice(notice_line(notice, step))
        return saved

    def interval_s(self) -> float:
        """The seconds between time-based checkpoints: ``checkpoint_every_n_minutes``, or for ``"auto"`` the clock's
        Young-Daly interval (:meth:`SaveClock.interval_s`) at ``expected_reclaims_per_gpu_hour``."""
        if self.minutes == "auto":
            return self.since_save.interval_s(self.cfg.expected_reclaims_per_gpu_hour)
        return self.minutes * 60.0

    def _poll(self, step: int) -> tuple:
        """``(the notice, the first time a check sees one, else None; whether a time-based checkpoint is due)``;
        between checks ``(None, False)``."""
        asks = self.enabled and self.notice is None
        if step % self.every or not (asks or self.minutes is not None):
            return None, False
        self.checks += 1
        local = [asks and self.local_notice() is not None,
                 self.minutes is not None and self.since_save() >= self.interval_s()]
        # Every rank reaches a check at the same global steps: the all-reduce and the barrier meet.
        seen, time_due = self.any_rank(local)
        if not seen:
            return None, time_due
        # None while the notice has reached another rank but not yet rank 0 (Ray broadcasts rank 0's):
        # the next check asks again.
        self.notice = self.get_info()
        return self.notice, time_due
