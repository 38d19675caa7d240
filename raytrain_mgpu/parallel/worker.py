"""A strategy on the worker: its two steps, applied in one fixed order, behind one interface.

``strategies/`` describes each strategy on the driver (layout, memory, rules; no torch). On a
Ray Train worker the loop (``engine/loop.py``) asks a :class:`WorkerStrategy`, built by
:func:`raytrain_mgpu.parallel.build_worker` from the description's two steps, as torchtitan
applies its parallelisms in order:

1. **placement** (``parallel/placement.py``): where this worker's copy of the model lives: one
   device, DataParallel over the worker's devices (``dp``, ``ddp2``), one device with the loss
   computed on every device (``dp_balanced``), split over the devices (``mp``, ``ddp_mp``), or
   left where it was built for the next step to place (``fsdp``);
2. **replication** (``parallel/replication.py``): how the workers' copies stay equal: ``none``
   (one-process strategies), ``replicate`` (DDP) or ``fully_shard`` (FSDP2).

What the loop asks: where inputs go (``device``), whether to build on ``meta``, the model to
train (``setup_model``), this worker's data shard, the context skipping gradient sync, the
loss, and the plain model's and the optimizer's state for checkpoints.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ContextManager, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from raytrain_mgpu.engine.objectives import Objective

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import ParallelConfig
    from raytrain_mgpu.parallel.placement import Placement
    from raytrain_mgpu.parallel.replication import Replication
    from raytrain_mgpu.strategies import WorkerContext


class ModelWrapper(nn.Module):
    """Marker base of this package's own wrappers (``unwrap`` peels them like DDP)."""

    module: nn.Module


class WorkerStrategy:
    """One strategy on one worker: ``placement`` then ``replication``."""

    def __init__(self, name: str, placement: "Placement", replication: "Replication", cfg: "ParallelConfig",
                 ctx: "WorkerContext", objective: Optional[Objective] = None, tensor_parallel_size: int = 1):
        self.name, self.placement, self.replication = name, placement, replication
        self.tensor_parallel_size = tensor_parallel_size  # workers per tensor group (parallel/tensor_parallel.py)
        self.cfg = cfg
        self.ctx = ctx
        self.objective = objective if objective is not None else Objective()  # default: cross-entropy, accuracy

    def __repr__(self) -> str:
        return f"WorkerStrategy({self.name!r}: {self.placement.name}, then {self.replication.name})"

    @property
    def device(self) -> torch.device:
        """Where inputs, targets and the loss go."""
        return self.placement.input_device(self.ctx, self.cfg)

    def build_on_meta(self) -> bool:
        """Whether this worker builds the model on ``meta`` (no memory, no weights): fsdp's ranks but 0."""
        return self.replication.build_on_meta(self.ctx)

    def setup_model(self, model: nn.Module) -> nn.Module:
        """The two steps, in order; returns the module to train."""
        model = self.placement.place(model, self.ctx, self.cfg)
        return self.replication.wrap(model, self)

    def data_shard(self) -> Tuple[int, int]:
        """``(shard index, number of shards)`` for this worker's DistributedSampler: its tensor group's, whose
        ranks all read the same batch."""
        return self.ctx.world_rank // self.tensor_parallel_size, self.ctx.world_size // self.tensor_parallel_size

    @property
    def counts_samples(self) -> bool:
        """Whether this rank adds its batches to the epoch's sums: the first of its tensor group (or every rank)."""
        return self.ctx.world_rank % self.tensor_parallel_size == 0

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context that skips gradient sync (non-final accumulation micro-steps)."""
        return self.replication.no_sync(model)

    def compute_loss(self, model: nn.Module, x, y) -> Tuple[torch.Tensor, object]:
        """``(mean loss, outputs)`` for one micro-batch (``self.objective``'s loss), on ``self.device``.

        ``x`` and ``y`` are tensors, or tuples/dicts of tensors (:mod:`raytrain_mgpu.engine.batches`:
        a dict ``x`` is passed as keyword arguments). Where the outputs land on another device
        (model parallel) or on every device (``dp_balanced``), only the loss and every metric's
        ``(sum, count)`` come back (as :class:`~raytrain_mgpu.engine.objectives.Predictions`).
        """
        return self.placement.compute_loss(self, model, x, y)

    def run_step(self, model: nn.Module, x, y, step_fn, ctx) -> tuple:
        """A user's own step (``TrainConfig.train_step``) on one micro-batch: ``(mean loss, outputs or None, extra
        scalars)``, where this placement computes a loss (``dp_balanced``: on every device's slice, averaged)."""
        return self.placement.run_step(self, model, x, y, step_fn, ctx)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside ``torch.compile``, DDP, DataParallel and our own wrappers."""
        model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        while isinstance(model, (DistributedDataParallel, DataParallel, ModelWrapper)):
            model = model.module
        return model

    def state_dict(self, model: nn.Module) -> dict:
        """Full state dict of the plain model (collective for sharded strategies)."""
        return self.replication.state_dict(self.unwrap(model))

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        self.replication.load_state_dict(self.unwrap(model), state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state rank 0 saves (collective for sharded strategies: all ranks call)."""
        return self.replication.optimizer_state_dict(self.unwrap(model), optimizer)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what ``optimizer_state_dict`` returned on rank 0 (every rank calls it)."""
        self.replication.load_optimizer_state_dict(self.unwrap(model), optimizer, state)

    @property
    def sharded_checkpoint(self) -> bool:
        """Whether checkpoints are written by every rank, each its own shards (fsdp), not by rank 0 alone."""
        return self.replication.sharded_checkpoint

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     asynchronous: bool = False, trainable_only: bool = False):
        """This rank's shards of the model and optimizer into ``path`` (collective; ``sharded_checkpoint``);
        ``asynchronous``: returns a Future once they are in host memory, done once they are written;
        ``trainable_only``: without the frozen parameters (``save="trainable"``)."""
        return self.replication.save_sharded(self.unwrap(model), optimizer, path, asynchronous, trainable_only)

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     trainable_only: bool = False) -> None:
        """This rank's shards from a sharded checkpoint of any world size (collective)."""
        self.replication.load_sharded(self.unwrap(model), optimizer, path, trainable_only)

    def memory_devices(self) -> List[torch.device]:
        """Devices whose peak memory this worker reports."""
        return list(self.ctx.devices)


_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


def explain_ddp_error(exc: RuntimeError, model: nn.Module) -> Optional[RuntimeError]:
    """DDP's unused-parameter error with the TrainConfig option that fixes it; None for any other error.

    DDP raises it in the forward *after* a step in which some parameters got no gradient;
    torch lists their indices, which we translate into names. (A function the forward's ``except``
    calls, not a context manager around every forward: entering one costs a few us a micro-batch.)
    """
    if _DDP_UNUSED not in str(exc):
        return None
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(exc))
    unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
    which = f" Parameters that got no gradient: {', '.join(unused)}." if unused else ""
    return RuntimeError(
        f"DDP: some parameters were not used in producing the loss, so their gradients were never "
        f"all-reduced.{which} Set TrainConfig.find_unused_parameters=True (costs one autograd-graph "
        f"walk per step), or static_graph=True if the same parameters are unused in every step; "
        f"or make every output of forward() take part in the loss. (torch: {exc})")
