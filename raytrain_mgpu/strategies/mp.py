"""``mp``: naive model parallel in one worker (seed 000's ``sub_net1`` on gpu0, ``sub_net2`` on gpu1).

The model's blocks (the children of an ``nn.Sequential``, or what its ``blocks()``
returns: see ``raytrain_mgpu.models.partition``) are split into contiguous groups, one
per device, balanced by parameter count or by ``balance=[n0, n1, ...]`` blocks per device.
Activations hop from device to device; only one device works at a time (that idle time
is what the pipeline strategies remove), but a model too big for one device fits.

A model that places itself is accepted too: if it has a ``place(devices)`` method, ``mp``
calls it with the worker's devices (a list of ``torch.device``) instead of splitting it,
and the model moves its layers and, in ``forward``, its activations:

    class Net(nn.Module):
        def place(self, devices):
            self.devices = devices
            self.sub_net1.to(devices[0]); self.sub_net2.to(devices[-1])
        def forward(self, x):
            return self.sub_net2(self.sub_net1(x.to(self.devices[0])).to(self.devices[-1]))

The loss and the metrics are computed where the output lands; only the scalar loss and each
metric's ``(sum, count)`` move back to the first device (``Strategy.compute_loss``). On CPU every "device" is the
CPU (GPU emulation and tests), so the split and the hops run (the hops as no-ops) and
``SplitModel.block_device_indices`` says which of the worker's devices holds each block.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from raytrain_mgpu.batches import to_device
from raytrain_mgpu.models.partition import blocks_of, plan_partition
from raytrain_mgpu.strategies._memory import replica_on, split_parts
from raytrain_mgpu.strategies.base import ModelWrapper, Strategy, num_blocks, require_one_worker
from raytrain_mgpu.strategies.dp import demo_node_layout


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


def validate_split(cfg) -> None:
    """Pure checks of the split options (the model-dependent ones are in ``check_split``)."""
    if cfg.balance == "time":
        raise ValueError(
            f"TrainConfig.balance='time' with strategy={cfg.strategy!r}: timing the blocks needs a sample "
            f"micro-batch, which only the pipeline runner profiles. Use balance='params' or a list of "
            f"block counts per device, e.g. [3, 2].")
    if isinstance(cfg.balance, tuple) and len(cfg.balance) != cfg.gpus_per_worker:
        raise ValueError(
            f"TrainConfig.balance={list(cfg.balance)} lists {len(cfg.balance)} block counts, but "
            f"gpus_per_worker={cfg.gpus_per_worker} devices hold the model. Give one count per device, "
            f"or set gpus_per_worker={len(cfg.balance)}.")


def check_split(cfg, input_shape: tuple, num_classes: int) -> None:
    """Build the model on the ``meta`` device (no memory) and check that the split works."""
    from raytrain_mgpu.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    if not places_itself(model):
        plan_partition(blocks_of(model), cfg.gpus_per_worker, cfg.balance, what="gpus_per_worker")


def split_memory(cls, cfg, profile) -> list:
    """Each replica's model split over its worker's ``gpus_per_worker`` devices, one micro-batch in flight."""
    replicas = cls.data_parallel_size(cfg)
    parts = split_parts(profile, cfg.gpus_per_worker, cfg.balance)
    share = 1 / (replicas * cls.micro_batches_per_step(cfg))
    return replica_on(profile, parts, share, [1.0] * len(parts), share) * replicas


class MPStrategy(Strategy):
    """One worker, the model split over its ``gpus_per_worker`` devices."""

    name = "mp"
    options_used = frozenset({"gpus_per_worker", "balance"})

    @classmethod
    def validate(cls, cfg) -> None:
        require_one_worker(cfg, cls.name, "use strategy='ddp_mp' (DDP over workers, each holding "
                                          "the split model)")
        validate_split(cfg)
        super().validate(cfg)

    @classmethod
    def check_model(cls, cfg, input_shape: tuple, num_classes: int) -> None:
        check_split(cfg, input_shape, num_classes)

    @classmethod
    def devices_per_worker(cls, cfg) -> int:
        return cfg.gpus_per_worker

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        # At most one device per block of the model.
        return {"num_workers": 1, "gpus_per_worker": min(max(info.devices_per_node), num_blocks(cfg))}

    @classmethod
    def device_memory(cls, cfg, profile):
        return split_memory(cls, cfg, profile)

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        return demo_node_layout(num_gpus)

    def setup_model(self, model: nn.Module) -> nn.Module:
        return place_model(model, self.ctx.devices, self.cfg.balance)
