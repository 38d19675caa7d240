"""Replica groups (``TrainConfig.fault_tolerance="replica_groups"``): the engine's side of torchft, one group a Ray
Train worker.

With Ray Train's ``TorchftConfig`` every worker is a replica group of its own: its process group holds itself
alone (the engine's collectives are the group's), and the groups meet through torchft's ``Manager`` instead:

- each step begins with a quorum (:meth:`ReplicaGroups.begin_step`, synchronous: ``use_async_quorum=False``); a
  group that joins late (a replacement Ray Train started after a worker was lost) is healed there from a live
  peer: the peer's model, optimizer, LR schedule, grad scaler and the run's position
  (:meth:`Engine.replica_state <raytrain_mgpu.engine.loop.Engine>`) arrive over torchft's ``PGTransport``, and the
  engine goes on from that position (``HealedFromPeer``);
- after the backward pass the gradients are averaged over the groups in the quorum (one flat all-reduce) and
  the groups agree whether the step counts (:meth:`ReplicaGroups.commit`: torchft's ``should_commit``). A step
  that does not count (a peer was lost inside it) drops its gradients, as torchft does;
- an epoch's row sums every group's losses, samples and times (:meth:`ReplicaGroups.sum_over_groups`), as a
  data-parallel run's row sums its ranks';
- a step averaged over fewer groups than the run has (a group lost, or not yet back) is counted: the epoch's
  ``short_steps`` in the history, the run's in the goodput ledger. It is where a recovered run differs from an
  uninterrupted one.

torchft numbers steps as committed steps; the engine's ``RunState.step`` counts the same (an uncommitted step
is not a step), and a group's manager starts at the step it resumed from, so a replacement that loaded an older
checkpoint heals from the live group. The lighthouse (torchft's quorum server) is Ray Train's: its address
arrives in ``TORCHFT_LIGHTHOUSE``. Tested in-process with two local groups and a replacement
(tests/test_replica_groups.py) and through Ray Train (tests/test_replica_groups_ray.py).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Callable

import torch
from torch.distributed import ReduceOp

logger = logging.getLogger(__name__)

__all__ = ["ReplicaGroups", "HealedFromPeer", "RunOver", "TORCHFT_HINT"]

TORCHFT_HINT = "pip install 'raytrain-mgpu[ft]' (torchft-nightly, the release tested with this torch)"


class HealedFromPeer(Exception):
    """This group's state was replaced by a live peer's at the start of a step: the engine goes on from there."""


class RunOver(Exception):
    """A replacement group found itself alone after the run's other groups had finished: nothing is left to train."""


class ReplicaGroups:
    """torchft's ``Manager`` for replica group ``index`` of ``count`` (see the module docstring). ``over()``: whether
    the run's groups finished already (asked when a group first finds itself alone); ``timeout_s``: torchft's
    bound on its collectives and its quorum (a lost peer costs the others at most this once)."""

    def __init__(self, index: int, count: int, device: torch.device, run_id: str,
                 over: Callable[[], bool] = lambda: False, timeout_s: float = 30.0):
        # torchft logs every quorum and commit at INFO (its Rust side reads RUST_LOG when first loaded): a line a
        # step in every worker's log. Its warnings stay; RUST_LOG or the "torchft" logger set by the user win.
        os.environ.setdefault("RUST_LOG", "warn")
        if logging.getLogger("torchft").level == logging.NOTSET:
            logging.getLogger("torchft").setLevel(logging.WARNING)
        # late: optional dependency (the [ft] extra), loaded by runs that ask for replica groups only
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.index, self.count, self.over = index, count, over
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=2 * timeout, rank=0, world_size=1, replica_id=f"{run_id}-group{index}",
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
            init_sync=False)  # every group builds the same weights from the run's seed
        self.healed = False
        self._quorum_open = False  # the quorum that healed this group is the next step's
        self._first = True
        self.short_steps = 0  # this epoch's steps averaged over fewer groups than the run has
        self.dropped_steps = 0  # this epoch's steps the groups did not commit

    def attach(self, state: Callable[[], dict], load: Callable[[dict], None], step: int) -> None:
        """What a peer heals from (``state()``) and how this group takes it (``load``); ``step``: the committed steps
        this group starts at (the resume point's)."""
        def take(sd: dict) -> None:
            load(sd)
            self.healed = True

        self.manager.register_state_dict_fn("run", take, state)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> None:
        """This step's quorum; raises :class:`HealedFromPeer` when it replaced this group's state (the engine moves to
        the peer's position and comes back here: that quorum is the step's), :class:`RunOver` when a first quorum
        finds this group alone after the run ended."""
        if self._quorum_open:
            self._quorum_open = False
            return
        self.healed = False
        self.manager.start_quorum()
        first, self._first = self._first, False
        if self.healed:
            logger.info("replica group %d healed from a peer at step %d", self.index, self.manager.current_step())
            self._quorum_open = True
            raise HealedFromPeer()
        if first and self.count > 1 and self.manager.num_participants() == 1 and self.over():
            raise RunOver()

    def commit(self, parameters: list) -> bool:
        """Average this step's gradients over the groups in the quorum (one flat all-reduce; a parameter without a
        gradient counts as zeros, so every group sends the same shape) and agree whether the step counts."""
        grads = []
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            self.manager.allreduce(flat).wait()
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
        if self.manager.num_participants() < self.count:
            self.short_steps += 1
        committed = self.manager.should_commit()
        if not committed:
            self.dropped_steps += 1
        return committed

    def sum_over_groups(self, sums: torch.Tensor) -> tuple:
        """``(sums over the groups of the current quorum, how many)``: an epoch's row counts every group's samples
        (torchft's all-reduce, between a step's commit and the next quorum, where the quorum's groups all are). A
        group lost inside it leaves this group's own sums."""
        groups = self.manager.num_participants()
        if groups <= 1:
            return sums, 1
        own = sums.clone()
        self.manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return own, 1
        return sums, groups

    def leads(self) -> bool:
        """Whether this group writes the run's checkpoints: the first group of the current quorum."""
        return self.manager.participating_rank() == 0

    def epoch_columns(self) -> dict:
        """The epoch's ``short_steps`` and ``dropped_steps``, and a new epoch."""
        columns = {"short_steps": self.short_steps, "dropped_steps": self.dropped_steps}
        self.short_steps = self.dropped_steps = 0
        return columns

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # the run is over either way
            logger.debug("torchft manager shutdown", exc_info=True)

