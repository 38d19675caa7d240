"""The data-parallel family's step runner: what a :class:`WorkerStrategy` gives the engine (``engine/loop.py``).

One optimizer step is ``accum`` micro-batches, each forward (under the run's autocast), loss, backward
(scaled by fp16's grad scaler, divided by ``accum``); gradients are all-reduced only on the last
micro-batch (the strategy's ``no_sync`` around the others). The whole model's state is rank 0's to
write (``model.pt`` and its optimizer in ``train_state.pt``), or every rank's shards (fsdp).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Union

import torch

from raytrain_mgpu.parallel.worker import WorkerStrategy
from raytrain_mgpu.engine.loop import Steps
from raytrain_mgpu.engine.liveness import POSITION

__all__ = ["DataParallelSteps"]


def total_norm(grads: list) -> torch.Tensor:
    """The gradients' total 2-norm, also where they are DTensors on different meshes (tensor parallel: a planned
    layer's on the ``(data, tensor)`` mesh, a layer the plan left whole on ``data`` alone), which one norm over all
    of them refuses: each mesh's norm, made whole (a collective on that mesh), then combined."""
    from torch.distributed.tensor import DTensor

    meshes = _by_mesh(grads, lambda grad: grad)
    if len(meshes) == 1:  # one mesh (fsdp, ddp) or none: torch's own
        return torch.nn.utils.get_total_norm(grads)
    norms = [torch.nn.utils.get_total_norm(group) for group in meshes.values()]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


def _by_mesh(items: list, tensor_of: Callable) -> dict:
    """``items`` grouped by the device mesh of ``tensor_of(item)`` (None for a plain tensor), in order."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for item in items:
        tensor = tensor_of(item)
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(item)
    return groups


class DataParallelSteps(Steps):
    """``strategy`` on this rank (its placement, then its replication) as the engine's step runner."""

    def __init__(self, strategy: WorkerStrategy, compile_model: Union[bool, str] = False, user_step=None):
        """``user_step``: ``TrainConfig.train_step`` (the function), or None for the config's loss on ``model(x)``."""
        self.strategy, self.compile_model, self.user_step = strategy, compile_model, user_step
        self.ctx, self.objective = strategy.ctx, strategy.objective
        self.device = strategy.device
        self.shard = strategy.data_shard()
        self.counts = strategy.counts_samples  # a tensor group's ranks share a batch: its first counts it
        self.sharded = strategy.sharded_checkpoint
        self.model: Optional[torch.nn.Module] = None

    def accum_at(self, plan, num_shards: int) -> int:
        return plan.micro_batches_at(num_shards)  # ValueError for a count the plan does not have

    def loader_batch(self, plan) -> int:
        return plan.micro_batch

    def build_on_meta(self) -> bool:
        return self.strategy.build_on_meta()

    def setup(self, model: torch.nn.Module, model_state: Optional[dict]) -> None:
        if model_state is not None:
            _load(model, model_state, trainable_only=self.save_trainable)
        model = self.strategy.setup_model(model)
        from raytrain_mgpu.models.checkpointing import compiled

        # the whole model with its DDP/FSDP wrapper, as Lightning's Fabric does; or the plain model's blocks in place
        self.model = compiled(model, self.compile_model, self.strategy.unwrap(model))

    def parameters(self) -> list:
        return list(self.model.parameters())

    def named_model(self) -> torch.nn.Module:
        return self.strategy.unwrap(self.model)

    def owned_tensors(self) -> list:
        model = self.named_model()
        return [*model.parameters(), *model.buffers()]

    def grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return total_norm(grads)

    def load_optimizer(self, optimizer, train_state: dict) -> None:
        self.strategy.load_optimizer_state_dict(self.model, optimizer, train_state["optimizer"])

    def load_sharded(self, optimizer, path: str) -> None:
        self.strategy.load_sharded(self.model, optimizer, path, trainable_only=self.save_trainable)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def train_step(self, next_batch: Callable[[], tuple], meter, window, scaler, accum: int) -> None:
        model, strategy = self.model, self.strategy
        for micro in range(accum):
            x, y = next_batch()
            # Gradients are all-reduced only on the last micro-step of a step.
            sync = contextlib.nullcontext() if micro == accum - 1 else strategy.no_sync(model)
            extras = None
            with sync:
                with self.autocast():
                    if self.user_step is None:
                        loss, outputs = strategy.compute_loss(model, x, y)
                    else:  # the user's step: its loss, outputs (for the metrics) and extra scalars
                        loss, outputs, extras = strategy.run_step(model, x, y, self.user_step, self.step_context)
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
        from raytrain_mgpu.engine.batches import move_batch

        for x, y in loader:
            POSITION.mark("evaluating")
            x, y = move_batch(x, y, self.device, self.channels_last)
            extras = None
            with self.autocast():
                if self.user_step is None:
                    loss, outputs = self.strategy.compute_loss(self.model, x, y)
                else:  # your own step's loss (and outputs, extras) is what evaluation measures too
                    loss, outputs, extras = self.strategy.run_step(self.model, x, y, self.user_step, self.step_context)
            counted = meter.samples
            if self.counts:
                meter.add(loss.float(), outputs, y)
            if extras and self.counts:
                meter.add_extras(extras, meter.samples - counted)

    def memory_devices(self) -> List[torch.device]:
        return self.strategy.memory_devices()

    def checkpoint_files(self, optimizer) -> dict:
        if self.ctx.world_rank != 0:
            return {}
        state = self.strategy.state_dict(self.model)
        if self.save_trainable:  # save="trainable": the frozen weights come back from init_from or the builder
            from raytrain_mgpu.engine.weights import trainable_state

            state = trainable_state(state, self.named_model())
        return {"model.pt": state,
                "train_state.pt": {"optimizer": self.strategy.optimizer_state_dict(self.model, optimizer)}}

    def write_sharded(self, optimizer, path: str, asynchronous: bool):
        return self.strategy.save_sharded(self.model, optimizer, path, asynchronous=asynchronous,
                                          trainable_only=self.save_trainable)

    def model_state(self) -> dict:
        state = self.strategy.state_dict(self.model)
        if self.save_trainable:  # keep_best's gathered copy holds what the checkpoints hold
            from raytrain_mgpu.engine.weights import trainable_state

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
