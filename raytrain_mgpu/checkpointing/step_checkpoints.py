"""Checkpoints inside an epoch (``TrainConfig.checkpoint_every_n_steps``) and the resume that continues there.

A reclaimed spot node costs the steps since the last checkpoint. With per-epoch checkpoints
that is up to an epoch; with ``checkpoint_every_n_steps=K`` at most K steps. A step checkpoint
holds what an epoch checkpoint holds (weights, optimizer, LR schedule, scaler, every rank's
random generators) plus where the epoch stands:

- ``meta.json``'s ``step_in_epoch``: the optimizer steps of the unfinished epoch already trained
  (``epoch`` counts finished epochs, as always);
- every rank's partial epoch sums (``EpochMeter.partial``: loss and metric sums and counts,
  data-wait and elapsed time), so the resumed epoch's history row is the uninterrupted one's.

The resume continues the epoch's own sample order where it stopped: step ``s`` of an epoch
always trains positions ``[s*B, (s+1)*B)`` of the epoch's seeded permutation, whatever the
number of replicas (``engine/loop.py``), so :class:`ResumableSampler` leaves out the first
``step_in_epoch * B / replicas`` positions of each replica's share of that one epoch. With the
generators restored too, the run ends with the uninterrupted run's weights
(``tests/test_step_checkpoints.py``).

Step checkpoints count in ``num_checkpoints_to_keep`` like epoch ones (the newest N are kept).
"""

from __future__ import annotations

from typing import Optional

from torch.utils.data import DistributedSampler

from raytrain_mgpu.engine.run_state import at_max_steps

__all__ = ["ResumableSampler", "step_checkpoint_due", "STEP_IN_EPOCH"]

STEP_IN_EPOCH = "step_in_epoch"
"""``meta.json`` key (absent or 0 at an epoch boundary)."""


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch ``resume_epoch`` starts ``skip`` positions into this replica's share."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_epoch: Optional[int] = None
        self.skip = 0

    def resume_at(self, epoch: int, skip: int) -> None:
        self.resume_epoch, self.skip = epoch, skip

    def __iter__(self):
        indices = super().__iter__()
        if self.epoch != self.resume_epoch or not self.skip:
            return indices
        return iter(list(indices)[self.skip:])


def step_checkpoint_due(cfg, step: int, step_in_epoch: int, steps_per_epoch: int) -> bool:
    """Whether a step checkpoint is written after global ``step`` (the ``step_in_epoch``-th of the epoch).

    Not at the epoch's end or at ``max_steps``: the epoch checkpoint follows there anyway.
    """
    every = getattr(cfg, "checkpoint_every_n_steps", None)
    return (every is not None and step % every == 0 and step_in_epoch < steps_per_epoch
            and not at_max_steps(cfg, step))
