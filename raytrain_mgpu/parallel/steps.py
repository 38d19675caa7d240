"""A data-parallel strategy on one rank, as the engine's step runner (``engine/loop.py``): :class:`DataParallelSteps`
composes the strategy's two steps, in torchtitan's fixed order, and calls them itself (no layer between):

1. **placement** (``parallel/placement.py``): where this rank's copy of the model lives (one device,
   DataParallel over the worker's devices, split over them, or left where it was built) and where the loss is
   computed;
2. **replication** (``parallel/replication.py``): how the ranks' copies stay equal (``none``, ``replicate``: DDP,
   ``fully_shard``: FSDP2), the context that skips gradient sync, and the states a checkpoint holds.

One optimizer step is ``accum`` micro-batches, each forward (under the run's autocast), loss, backward
(scaled by fp16's grad scaler, divided by ``accum``); gradients are all-reduced only on the last
micro-batch (the replication's ``no_sync`` around the others). The whole model's state is rank 0's to
write (``model.pt`` and its optimizer in ``train_state.pt``), or every rank's shards (fsdp).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, List, Optional

import torch
from torch.distributed.tensor import DTensor

from raytrain_mgpu.engine.batches import move_batch
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.precision import Precision
from raytrain_mgpu.engine.step import StepContext, Steps
from raytrain_mgpu.engine.weights import trainable_state
from raytrain_mgpu.models.checkpointing import compiled
from raytrain_mgpu.parallel.worker import unwrap

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import ParallelConfig
    from raytrain_mgpu.parallel.placement import Placement
    from raytrain_mgpu.parallel.replication import Replication
    from raytrain_mgpu.strategies import WorkerContext

__all__ = ["DataParallelSteps"]


def total_norm(grads: list) -> torch.Tensor:
    """The gradients' total 2-norm, also where they are DTensors on different meshes (tensor parallel: a planned
    layer's on the ``(data, tensor)`` mesh, a layer the plan left whole on ``data`` alone), which one norm over all
    of them refuses: each mesh's norm, made whole (a collective on that mesh), then combined."""
    meshes = _by_mesh(grads, lambda grad: grad)
    if len(meshes) == 1:  # one mesh (fsdp, ddp) or none: torch's own
        return torch.nn.utils.get_total_norm(grads)
    norms = [torch.nn.utils.get_total_norm(group) for group in meshes.values()]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


def _by_mesh(items: list, tensor_of: Callable) -> dict:
    """``items`` grouped by the device mesh of ``tensor_of(item)`` (None for a plain tensor), in order."""
    groups: dict = {}
    for item in items:
        tensor = tensor_of(item)
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(item)
    return groups


class DataParallelSteps(Steps):
    """Strategy ``name`` on the rank ``ctx`` describes: ``placement``, then ``replication``, over ``cfg`` (the run's
    ``ParallelConfig``: precision, compile, channels_last and the steps' options), the loss and metrics of
    ``objective``; ``tensor_parallel_size``: ranks per tensor group (``parallel/tensor_parallel.py``).
    ``user_step``: ``TrainConfig.train_step`` (the function), or None for the config's loss on ``model(x)``;
    ``save_trainable``: ``save="trainable"``, a checkpoint's model part holds the trainable parameters only."""

    def __init__(self, name: str, placement: "Placement", replication: "Replication", cfg: "ParallelConfig",
                 ctx: "WorkerContext", objective: Optional[Objective] = None, tensor_parallel_size: int = 1,
                 user_step: Optional[Callable] = None, save_trainable: bool = False):
        self.name, self.placement, self.replication, self.cfg, self.ctx = name, placement, replication, cfg, ctx
        self.objective = objective if objective is not None else Objective()  # default: cross-entropy, accuracy
        self.tensor_parallel_size = tensor_parallel_size
        self.user_step, self.save_trainable = user_step, save_trainable
        self.device = torch.device(placement.input_device(ctx, cfg))  # where inputs, targets and the loss go
        # the run's precision on this rank's compute device ("cpu" under GPU emulation): its forwards' autocast
        self.precision = Precision(cfg.precision, self.device.type)
        self.autocast = self.precision.autocast
        self.compile_model, self.channels_last = cfg.compile, cfg.channels_last
        # a tensor group's ranks read the same batch: its shard is the group's, and its first rank counts it
        # a replica group's shard is the group's (engine/replica_groups.py)
        self.shard = ctx.replica_group or (ctx.world_rank // tensor_parallel_size,
                                           ctx.world_size // tensor_parallel_size)
        self.counts = ctx.world_rank % tensor_parallel_size == 0
        self.sharded = replication.sharded_checkpoint
        self.step_context = StepContext(ctx.world_rank, ctx.world_size, self.device, cfg.precision,
                                        self.objective.loss, list(self.objective.names))
        self.model: Optional[torch.nn.Module] = None

    def __repr__(self) -> str:
        return f"DataParallelSteps({self.name!r}: {self.placement.name}, then {self.replication.name})"

    def accum_at(self, plan, num_shards: int) -> int:
        return plan.micro_batches_at(num_shards)  # ValueError for a count the plan does not have

    def loader_batch(self, plan) -> int:
        return plan.micro_batch

    def build_on_meta(self) -> bool:
        return self.replication.build_on_meta(self.ctx)

    def setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The strategy's two steps on ``model``, in order: the module to train (not kept: :meth:`setup` keeps it)."""
        return self.replication.wrap(self.placement.place(model, self.ctx, self.cfg), self)

    def setup(self, model: torch.nn.Module, model_state: Optional[dict]) -> None:
        if model_state is not None:
            _load(model, model_state, trainable_only=self.save_trainable)
        model = self.setup_model(model)
        # the whole model with its DDP/FSDP wrapper, as Lightning's Fabric does; or the plain model's blocks in place
        self.model = compiled(model, self.compile_model, unwrap(model))

    unwrap = staticmethod(unwrap)  # the user's model inside torch.compile, DDP, DataParallel and our wrappers

    def parameters(self) -> list:
        return list(self.model.parameters())

    def named_model(self) -> torch.nn.Module:
        return unwrap(self.model)

    def owned_tensors(self) -> list:
        model = self.named_model()
        return [*model.parameters(), *model.buffers()]

    def grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return total_norm(grads)

    def load_optimizer(self, optimizer, train_state: dict) -> None:
        self.replication.load_optimizer_state_dict(unwrap(self.model), optimizer, train_state["optimizer"])

    def load_sharded(self, optimizer, path: str) -> None:
        self.replication.load_sharded(unwrap(self.model), optimizer, path, trainable_only=self.save_trainable)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def train_step(self, next_batch: Callable[[], tuple], meter, window, scaler, accum: int) -> None:
        model, placement = self.model, self.placement
        for micro in range(accum):
            x, y = next_batch()
            # Gradients are all-reduced only on the last micro-step of a step.
            sync = contextlib.nullcontext() if micro == accum - 1 else self.replication.no_sync(model)
            extras = None
            with sync:
                with self.autocast():
                    if self.user_step is None:
                        loss, outputs = placement.compute_loss(self, model, x, y)
                    else:  # the user's step: its loss, outputs (for the metrics) and extra scalars
                        loss, outputs, extras = placement.run_step(self, model, x, y, self.user_step,
                                                                   self.step_context)
                POSITION.mark("backward")  # where DDP's all-reduce waits for the other ranks
                scaler.scale(loss / accum if accum > 1 else loss).backward()
            counted = meter.samples
            if self.counts:
                meter.add(loss, outputs, y)  # metrics on the outputs, or the sums computed where they live
            del outputs  # not held through the next forward: one micro-batch of outputs less per device
            if extras and self.counts:
                meter.add_extras(extras, meter.samples - counted)
            if window is not None:
                window.add_loss(loss, meter.samples - counted)  # the samples (targets) the meter counted

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip this worker's model's gradients to ``max_norm``; their total norm (on the device, unread)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = total_norm([p.grad for p in params])
        for group in _by_mesh(params, lambda p: p.grad).values():  # one mesh at a time (a foreach op spans one)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def evaluate(self, loader, meter) -> None:
        for x, y in loader:
            POSITION.mark("evaluating")
            x, y = move_batch(x, y, self.device, self.channels_last)
            extras = None
            with self.autocast():
                if self.user_step is None:
                    loss, outputs = self.placement.compute_loss(self, self.model, x, y)
                else:  # your own step's loss (and outputs, extras) is what evaluation measures too
                    loss, outputs, extras = self.placement.run_step(self, self.model, x, y, self.user_step,
                                                                    self.step_context)
            counted = meter.samples
            if self.counts:
                meter.add(loss.float(), outputs, y)
            if extras and self.counts:
                meter.add_extras(extras, meter.samples - counted)

    def memory_devices(self) -> List[torch.device]:
        return list(self.ctx.devices)

    def checkpoint_files(self, optimizer) -> dict:
        if self.ctx.world_rank != 0:
            return {}
        state = self.replication.state_dict(unwrap(self.model))
        if self.save_trainable:  # save="trainable": the frozen weights come back from init_from or the builder
            state = trainable_state(state, self.named_model())
        return {"model.pt": state,
                "train_state.pt": {"optimizer": self.replication.optimizer_state_dict(unwrap(self.model), optimizer)}}

    def write_sharded(self, optimizer, path: str, asynchronous: bool):
        return self.replication.save_sharded(unwrap(self.model), optimizer, path, asynchronous=asynchronous,
                                             trainable_only=self.save_trainable)

    def model_state(self) -> dict:
        state = self.replication.state_dict(unwrap(self.model))
        if self.save_trainable:  # keep_best's gathered copy holds what the checkpoints hold
            state = trainable_state(state, self.named_model())
        return state


def _load(model: torch.nn.Module, state: dict, trainable_only: bool) -> None:
    """A checkpoint's weights into the model as built; a ``save="trainable"`` one holds only the trainable part."""
    if not trainable_only:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if unexpected or set(missing) - frozen:
        raise ValueError(f"the checkpoint (save='trainable') does not fit this model: missing trainable "
                         f"{sorted(set(missing) - frozen)[:5]}, unexpected {sorted(unexpected)[:5]}. Resume with the "
                         f"model (and frozen parameters) it was trained with, or use another `name`.")
