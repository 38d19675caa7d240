"""The checkpoint manager: one object per rank that owns a run's checkpoints, whatever transport carries them.

- **When**: at each epoch's end; inside an epoch every ``checkpoint_every_n_steps``, every
  ``checkpoint_every_n_minutes`` (any rank's clock) and at the first preemption notice: its triggers,
  :class:`~raytrain_mgpu.checkpointing.preemption.PreemptionCheck`;
- **what**, and the write: model, optimizer, LR schedule, grad scaler, every rank's random generators and an
  unfinished epoch's sums (:class:`~raytrain_mgpu.checkpointing.contents.Saver`);
- **where**, sealing, publishing, the best copy, pruning and the checkpoint a run resumes from: its store
  (:class:`~raytrain_mgpu.checkpointing.store.CheckpointStore`), which the transport hands it with what only the
  transport knows (``Transport.checkpoint_store``).

It is handed what it saves, not the engine: the config, the step runner (the model), the store, rank 0's reporter and
the data's shape; then, once they exist (:meth:`CheckpointManager.start`), the run state, optimizer, LR schedule,
grad scaler and the transport's preemption notices.
"""

from __future__ import annotations

import time
from typing import Optional

from raytrain_mgpu.engine.batches import shape_record
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.engine.metrics import barrier_s
from raytrain_mgpu.checkpointing.contents import Saver
from raytrain_mgpu.checkpointing.preemption import PreemptionCheck
from raytrain_mgpu.checkpointing.store import CheckpointSource, CheckpointStore

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """A rank's checkpoints (see the module docstring): ``source()`` before the model is restored, ``start(...)`` once
    the run is set up, then ``resumed``, ``after_step`` and ``save_epoch`` from the loop."""

    def __init__(self, cfg, steps, store: CheckpointStore, reporter, data):
        self.cfg, self.steps, self.store, self.reporter = cfg, steps, store, reporter
        self.shape_info = {"input_shape": shape_record(data.input_shape), "num_classes": data.num_classes}
        self.saver: Optional[Saver] = None
        self.triggers: Optional[PreemptionCheck] = None

    def source(self) -> Optional[CheckpointSource]:
        """The checkpoint this run resumes from (None: a new run): the store's newest."""
        return self.store.newest()

    def start(self, state, optimizer, scheduler, scaler, notices: dict) -> None:
        """The writer and the triggers, once the optimizer, schedule and scaler exist; ``notices``: how the transport
        hears of a preemption (``PreemptionCheck``'s keyword arguments)."""
        self.saver = Saver(self.cfg, self.steps, self.store, self.reporter, self.shape_info, state, optimizer,
                           scheduler, scaler)
        self.triggers = PreemptionCheck(self.cfg, self.reporter, since_save=self.saver.since_save, **notices)

    def resumed(self, steps_per_epoch: int) -> None:
        """Where training starts again after a checkpoint: the driver's one line, once an attempt."""
        self.triggers.resumed(self.saver.state, steps_per_epoch)

    def after_step(self, steps_per_epoch: int, meter) -> bool:
        """After each optimizer step: a step checkpoint when one is due (every N steps or minutes, a first preemption
        notice); True if one was written."""
        state = self.saver.state
        return self.triggers.after_step(state.step, state.step_in_epoch, steps_per_epoch,
                                        lambda: self.save_step(meter))

    def save_step(self, meter) -> None:
        """A step checkpoint; its time is the epoch's ``checkpoint_s``, not training (``training_s``)."""
        state = self.saver.state
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
