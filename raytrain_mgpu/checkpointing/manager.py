"""The checkpoint manager: one object per rank that owns a run's checkpoints, whatever transport carries them.

- **When**: at each epoch's end; inside an epoch every ``checkpoint_every_n_steps``, every
  ``checkpoint_every_n_minutes`` (any rank's clock) and at the first preemption notice
  (:class:`~raytrain_mgpu.checkpointing.preemption.PreemptionCheck`, :func:`~raytrain_mgpu.checkpointing.step_checkpoints.step_checkpoint_due`);
- **what**, and the write: model, optimizer, LR schedule, grad scaler, every rank's random generators and an
  unfinished epoch's sums (:class:`~raytrain_mgpu.checkpointing.contents.Saver`), ``meta.json`` last
  (:func:`~raytrain_mgpu.checkpointing.contents.seal`);
- **publishing, the best copy, pruning** (``RunFolder.publish``, ``save_best``, ``prune``: each defined once, in
  ``checkpointing/run_folder.py``), done where the transport has the checkpoint whole;
- **which checkpoint a run resumes from** (:meth:`CheckpointManager.source`: ``RunFolder.newest_checkpoint``, the one
  choice between the run folder's checkpoints and the one the transport's own system registered).

A transport hands it a storage target and nothing else: a folder for this rank's part (``Transport.begin``), the
checkpoint made whole there (``Transport.commit``: Ray Train's report, or published in the run folder), and the
checkpoint its own system registered last (``Transport.registered``: Ray Train's; none for the run folder alone).
"""

from __future__ import annotations

import time
from typing import Callable, ContextManager, NamedTuple, Optional

from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.engine.metrics import barrier_s
from raytrain_mgpu.checkpointing.contents import Saver
from raytrain_mgpu.checkpointing.preemption import PreemptionCheck
from raytrain_mgpu.checkpointing.run_folder import RunFolder

__all__ = ["CheckpointManager", "CheckpointSource"]


class CheckpointSource(NamedTuple):
    """A checkpoint to resume from: its path or URI (``RunState.checkpoint``) and a local copy to read."""

    path: str
    open: Callable[[], ContextManager[str]]


class CheckpointManager:
    """A rank's checkpoints (see the module docstring): ``source()`` before the model is restored, ``start()`` once the
    run is set up, then ``resumed``, ``after_step`` and ``save_epoch`` from the loop."""

    def __init__(self, engine):
        self.engine = engine
        self.saver = None
        self.triggers: Optional[PreemptionCheck] = None

    def source(self) -> Optional[CheckpointSource]:
        """The checkpoint this run resumes from (None: a new run): the run folder's newest complete one, or the one
        the transport's system registered (Ray Train's latest) where that is the newest."""
        registered = self.engine.transport.registered()
        folder = RunFolder.of(self.engine.cfg)
        point = folder.newest_checkpoint(ray_latest=registered.path if registered is not None else None)
        if point is None:
            return None
        if registered is not None and point.name == registered.path.rstrip("/").rsplit("/", 1)[-1]:
            return registered  # read through the transport's own storage access
        return CheckpointSource(point.uri, lambda: folder.readable(point.path))

    def start(self) -> None:
        """The writer and the triggers, once the optimizer, schedule and scaler exist."""
        e = self.engine
        self.saver = Saver(e)
        self.triggers = PreemptionCheck(e.cfg, e.reporter, since_save=self.saver.since_save,
                                        **e.transport.preemption())

    def resumed(self, steps_per_epoch: int) -> None:
        """Where training starts again after a checkpoint: the driver's one line, once an attempt."""
        self.triggers.resumed(self.engine.state, steps_per_epoch)

    def after_step(self, steps_per_epoch: int, meter) -> bool:
        """After each optimizer step: a step checkpoint when one is due (every N steps or minutes, a first preemption
        notice); True if one was written."""
        state = self.engine.state
        return self.triggers.after_step(state.step, state.step_in_epoch, steps_per_epoch,
                                        lambda: self.save_step(meter))

    def save_step(self, meter) -> None:
        """A step checkpoint; its time is the epoch's ``checkpoint_s``, not training (``training_s``)."""
        state = self.engine.state
        start = time.perf_counter()
        POSITION.mark("checkpoint")
        self.saver.save({"epoch": state.epoch, "step": state.step, "step_in_epoch": state.step_in_epoch},
                        partial=meter.partial())
        barrier_s()  # the other ranks' wait for their report to be taken (Ray Train) is checkpoint time too
        meter.checkpoint_s += time.perf_counter() - start

    def save_epoch(self, row: dict) -> None:
        """The epoch's checkpoint, its row sent to the driver with it."""
        POSITION.mark("checkpoint")
        self.saver.save(row, send_row=True)
