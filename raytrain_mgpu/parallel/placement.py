"""Step 1 of a strategy on the worker: where this worker's copy of the model lives.

- ``device``: the first (only) device of the worker (``ddp``);
- ``keep``: where it was built, for the next step to place (``fsdp`` shards it from there);
- ``data_parallel``: ``nn.DataParallel`` over the worker's devices (``dp``, ``ddp2``), the
  outputs gathered on ``output_device``, where the loss is computed;
- ``balanced``: one device, replicated onto every device each step with the loss and metric
  sums computed where each slice's outputs are (``dp_balanced``);
- ``split``: the model's blocks spread over the worker's devices (``mp``, ``ddp_mp``).

DataParallel. Every step scatters the batch from the first device, replicates the model onto
every device, runs the replicas in threads and gathers all outputs onto ``output_device``.
That gather is why the first GPU fills up first; ``output_device`` moves it elsewhere,
``balanced`` avoids it. Autocast state is thread-local and ``parallel_apply`` restores only
"enabled", not the dtype, so plain ``nn.DataParallel`` runs bf16-mixed replicas in fp16 on
CUDA: :class:`AutocastDataParallel` hands each replica the caller's autocast dtype. On CPU
"devices" (GPU emulation and tests) ``nn.DataParallel`` would call the module once on the
whole batch (torch does no scatter without CUDA), so more than one CPU device gets
:class:`StandInDataParallel`: the same scatter -> replicate -> parallel_apply -> gather on the
CPU stand-ins of ``_dp_ops``. One CPU device trains the plain model.

Balanced (PyTorch-Encoding's DataParallelModel + DataParallelCriterion, on torch's own
scatter/replicate/parallel_apply): inputs *and targets* are scattered, each device computes
its slice's loss and metric ``(sum, count)``, and only those scalars cross to the first
device. The mean loss is the plain model's mean over the batch: each device's mean is weighted
by its share of the targets, so uneven slices (10 on 3 devices: 4, 4, 2) give the gradients of
the unsplit model. That holds for a loss that is a mean over the targets; one that needs the
whole batch at once (in-batch negatives) is ``data_parallel``'s to compute.

Split (naive model parallel): the blocks (``models.partition.blocks_of``) are split into
contiguous groups, one per device, by parameter count or ``balance=[n0, n1, ...]``.
Activations hop from device to device. A model with a ``place(devices)`` method places
itself instead (it moves its layers, and in ``forward`` its activations). On CPU every
"device" is the CPU, so the split and the hops run (the hops as no-ops) and
``SplitModel.block_device_indices`` says which of the worker's devices holds each block.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parallel import parallel_apply

from raytrain_mgpu.engine.batches import call_model, detach, first_tensor, target_count, to_device
from raytrain_mgpu.models.partition import blocks_of, plan_partition
from raytrain_mgpu.engine.objectives import Objective, Predictions, add_pairs, move_pairs
from raytrain_mgpu.engine.precision import capture, entered
from raytrain_mgpu.parallel import _dp_ops
from raytrain_mgpu.parallel.worker import ModelWrapper, explain_ddp_error, unwrap

if TYPE_CHECKING:
    from raytrain_mgpu.parallel.steps import DataParallelSteps

__all__ = ["Placement", "PLACEMENTS", "SplitModel", "StandInDataParallel", "AutocastDataParallel",
           "call_with_autocast", "place_model", "wrap_data_parallel"]


class Placement:
    """The first device, the model moved there; the loss where the outputs land."""

    name = "device"
    spans_devices = False  # whether the placed model may span several devices (DDP then takes device_ids=None)

    def input_device(self, ctx, cfg) -> torch.device:
        return ctx.devices[0]

    def place(self, model: nn.Module, ctx, cfg) -> nn.Module:
        return model.to(self.input_device(ctx, cfg))

    def compute_loss(self, worker: "DataParallelSteps", model: nn.Module, x, y) -> Tuple[torch.Tensor, object]:
        try:
            outputs = call_model(model, x)
        except RuntimeError as exc:
            explained = explain_ddp_error(exc, unwrap(model))
            if explained is None:
                raise
            raise explained from exc
        where = first_tensor(outputs).device
        if not (isinstance(y, torch.Tensor) and y.device == where):  # even a no-op .to() is a dispatched op a step
            y = to_device(y, where)
        loss = worker.objective.loss(outputs, y)
        if where == worker.device:
            return loss, outputs
        pairs = move_pairs(worker.objective.measure(outputs, y), worker.device)
        return loss.to(worker.device), Predictions(pairs, [outputs], worker.device)


    def run_step(self, worker: "DataParallelSteps", model: nn.Module, x, y, step_fn, ctx) -> tuple:
        """A user's step on the whole micro-batch: ``(loss, outputs or None, extras)`` (``split_step_output``)."""
        return split_step_output(step_fn(model, (x, y), ctx), worker.device)


def split_step_output(out, device: torch.device) -> tuple:
    """``(loss, outputs or None, {name: scalar})`` of a user step's answer: the loss itself, or a dict with
    ``loss``, optionally ``outputs`` (the config's metrics are measured on them) and extra scalars."""
    if isinstance(out, torch.Tensor):
        return out, None, {}
    if not isinstance(out, dict) or not isinstance(out.get("loss"), torch.Tensor):
        raise ValueError(f"TrainConfig.train_step returned {type(out).__name__}: it must return the loss (a scalar "
                         f"tensor) or a dict with 'loss' (and, optionally, 'outputs' and extra scalars).")
    extras = {name: value for name, value in out.items() if name not in ("loss", "outputs")}
    for name, value in extras.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"TrainConfig.train_step's extra {name!r} has shape {tuple(value.shape)}: extras are "
                             f"scalars (a 0-d tensor or a number), averaged over the epoch like the loss.")
    loss = out["loss"]
    return (loss if loss.device == device else loss.to(device)), out.get("outputs"), extras


class Keep(Placement):
    """Left where it was built (rank 0's CPU, or ``meta``): the replication step places it."""

    name = "keep"

    def place(self, model: nn.Module, ctx, cfg) -> nn.Module:
        return model


# ----------------------------------------------------------------------------- DataParallel


def call_with_autocast(module, state: Tuple[str, torch.dtype, bool], *args, **kwargs):
    """Call ``module`` under the autocast ``state`` captured in another thread (``engine/precision.capture``)."""
    with entered(state):
        return module(*args, **kwargs)


class AutocastDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose replica threads use the caller's autocast dtype."""

    def parallel_apply(self, replicas, inputs, kwargs) -> List:
        state = capture(self.src_device_obj.type)
        calls = [functools.partial(call_with_autocast, replica, state) for replica in replicas]
        return parallel_apply(calls, inputs, kwargs, self.device_ids[: len(replicas)])  # torch's, CUDA


class StandInDataParallel(ModelWrapper):
    """``nn.DataParallel``'s forward on CPU stand-in devices (emulation and tests only): split the
    batch as torch's scatter does, one replica per device in its own thread, outputs concatenated on
    ``output_device``."""

    def __init__(self, module: nn.Module, devices, output_device: int):
        super().__init__()
        self.module = module
        self.devices = list(devices)
        self.output_device = self.devices[output_device]

    def forward(self, *inputs, **kwargs):
        inputs, module_kwargs = _dp_ops.scatter_kwargs(inputs, kwargs, self.devices)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        used = self.devices[: len(inputs)]
        replicas = _dp_ops.replicate(self.module, used, detach=not torch.is_grad_enabled())
        outputs = _dp_ops.parallel_apply(replicas, inputs, module_kwargs, used)
        return _dp_ops.gather(outputs, self.output_device)


def wrap_data_parallel(model: nn.Module, devices, output_device) -> nn.Module:
    """``model`` on ``devices[0]``, wrapped to run on all ``devices``: torch's ``nn.DataParallel``
    (with the autocast fix) on CUDA, :class:`StandInDataParallel` on several CPU devices (and not
    ``nn.DataParallel``, which on a CUDA machine training on CPU would claim every GPU), the plain
    model on one CPU device, as ``nn.DataParallel`` does with one device."""
    model = model.to(devices[0])
    if devices[0].type == "cuda":
        return AutocastDataParallel(model, device_ids=list(devices), output_device=devices[output_device])
    if len(devices) == 1:
        return model
    return StandInDataParallel(model, devices, output_device)


class DataParallelPlacement(Placement):
    """DataParallel over the worker's devices; inputs, targets and the loss on ``output_device``."""

    name = "data_parallel"
    spans_devices = True

    def input_device(self, ctx, cfg) -> torch.device:
        return ctx.devices[cfg.output_device or 0]  # DP scatters from there and gathers there

    def place(self, model: nn.Module, ctx, cfg) -> nn.Module:
        return wrap_data_parallel(model, ctx.devices, cfg.output_device or 0)


def _slice_loss(objective: Objective, model: nn.Module, x, y) -> Tuple[torch.Tensor, list, int, object]:
    """One device's ``(mean loss, metric pairs, number of targets, outputs)``, all on that device."""
    outputs = call_model(model, x)
    return objective.loss(outputs, y), objective.measure(outputs, y), target_count(y), detach(outputs)


class BalancedPlacement(Placement):
    """The model on the first device, replicated every step; loss and metric sums per device."""

    name = "balanced"
    spans_devices = True

    def compute_loss(self, worker: "DataParallelSteps", model: nn.Module, x, y):
        parts = self._slice_losses(worker, model, x, y)
        total = sum(n for _, _, n, _ in parts)
        # Scalars only cross devices here: per device one float for the loss, two per metric.
        loss = sum(part_loss.to(worker.device) * (n / total) for part_loss, _, n, _ in parts)
        pairs = add_pairs([move_pairs(part_pairs, worker.device) for _, part_pairs, _, _ in parts])
        return loss, Predictions(pairs, [outputs for *_, outputs in parts], worker.device)

    def run_step(self, worker: "DataParallelSteps", model: nn.Module, x, y, step_fn, ctx) -> tuple:
        """A user's step on every device's slice (the loss where each slice's outputs are), averaged by targets."""
        devices = list(worker.ctx.devices)
        state = capture(worker.device.type)

        def one(replica, xs, ys):
            loss, _, extras = split_step_output(step_fn(replica, (xs, ys), ctx), xs.device if isinstance(
                xs, torch.Tensor) else first_tensor(xs).device)
            return loss, extras, target_count(ys)

        if len(devices) == 1:
            parts = [call_with_autocast(one, state, model, x, y)]
        else:
            xs, ys = _dp_ops.scatter(x, devices), _dp_ops.scatter(y, devices)
            used = devices[: len(xs)]
            replicas = _dp_ops.replicate(model, used, detach=not torch.is_grad_enabled())
            calls = [functools.partial(call_with_autocast, one, state, r) for r in replicas]
            parts = _dp_ops.parallel_apply(calls, list(zip(xs, ys)), devices=used)
        total = sum(n for *_, n in parts)
        loss = sum(part_loss.to(worker.device) * (n / total) for part_loss, _, n in parts)
        extras = {name: sum(torch.as_tensor(e[name]).to(worker.device) * (n / total) for _, e, n in parts)
                  for name in parts[0][1]}
        return loss, None, extras

    @staticmethod
    def _slice_losses(worker: "DataParallelSteps", model: nn.Module, x, y) -> List[tuple]:
        devices = list(worker.ctx.devices)
        state = capture(worker.device.type)
        if len(devices) == 1:
            return [call_with_autocast(_slice_loss, state, worker.objective, model, x, y)]
        # CUDA: torch's ops; CPU devices: their stand-ins (same split, one thread per device).
        xs, ys = _dp_ops.scatter(x, devices), _dp_ops.scatter(y, devices)  # a small batch: fewer slices
        used = devices[: len(xs)]
        replicas = _dp_ops.replicate(model, used, detach=not torch.is_grad_enabled())
        calls = [functools.partial(call_with_autocast, _slice_loss, state, worker.objective, r) for r in replicas]
        return _dp_ops.parallel_apply(calls, list(zip(xs, ys)), devices=used)


# ----------------------------------------------------------------------------- split over devices


class SplitModel(ModelWrapper):
    """The user's model with its blocks spread over devices; ``forward`` moves activations."""

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module], devices: Sequence[torch.device],
                 device_indices: Sequence[int] = ()):
        super().__init__()
        self.module = module
        # Kept in a plain list: the blocks are already registered (and named) inside ``module``.
        self._stages = list(zip(blocks, devices))
        self.block_devices = list(devices)
        # Per block, the index of its device among the worker's (on CPU stand-ins the devices
        # are all equal, so this is what shows the split).
        self.block_device_indices = list(device_indices)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        (first, device), rest = self._stages[0], self._stages[1:]
        # The first block takes the model's inputs (a tuple or dict batch too); then one tensor per hop.
        x = first(*to_device(args, device), **to_device(kwargs, device))
        for block, device in rest:
            x = block(x.to(device, non_blocking=True))  # a device-to-device copy per hop
        return x


def places_itself(model: nn.Module) -> bool:
    return callable(getattr(model, "place", None))


def place_model(model: nn.Module, devices: Sequence[torch.device], balance) -> nn.Module:
    """``model`` spread over ``devices``: by its own ``place``, or split at its blocks."""
    if places_itself(model):
        model.place(list(devices))
        return model
    blocks = blocks_of(model)
    partition = plan_partition(blocks, len(devices), balance, what="gpus_per_worker")
    block_devices: List[torch.device] = []
    indices: List[int] = []
    for index, ((start, end), device) in enumerate(zip(partition.bounds(), devices)):
        for block in blocks[start:end]:
            block.to(device)
        block_devices += [device] * (end - start)
        indices += [index] * (end - start)
    return SplitModel(model, blocks, block_devices, indices)


class SplitPlacement(Placement):
    """The blocks over the worker's devices; the loss where the last block's outputs land."""

    name = "split"
    spans_devices = True

    def place(self, model: nn.Module, ctx, cfg) -> nn.Module:
        return place_model(model, ctx.devices, cfg.balance)


PLACEMENTS = {cls.name: cls() for cls in (Placement, Keep, DataParallelPlacement, BalancedPlacement, SplitPlacement)}
