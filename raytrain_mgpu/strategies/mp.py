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
metric's ``(sum, count)`` move back to the first device. On the worker: placement ``split``
(``raytrain_mgpu/parallel/placement.py``: ``SplitModel``, ``place_model``), no replication.
"""

from __future__ import annotations

from raytrain_mgpu.models import build_model_shapes
from raytrain_mgpu.strategies._memory import replica_on, split_parts
from raytrain_mgpu.strategies.base import NodeDevices, num_blocks


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
    from raytrain_mgpu.models.partition import blocks_of, plan_partition  # late: loads torch; the rules here need none

    model = build_model_shapes(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    if not callable(getattr(model, "place", None)):  # a model that places itself is not split
        plan_partition(blocks_of(model), cfg.gpus_per_worker, cfg.balance, what="gpus_per_worker")


def split_memory(cls, cfg, profile) -> list:
    """Each replica's model split over its worker's ``gpus_per_worker`` devices, one micro-batch in flight."""
    replicas = cls.data_parallel_size(cfg)
    parts = split_parts(profile, cfg.gpus_per_worker, cfg.balance)
    share = 1 / (replicas * cls.micro_batches_per_step(cfg))
    return replica_on(profile, parts, share, [1.0] * len(parts), share) * replicas


class SplitBlocks(NodeDevices):
    """Base of ``mp`` and ``ddp_mp``: each worker's model split over its ``gpus_per_worker`` devices."""

    placement = "split"

    @classmethod
    def validate(cls, cfg) -> None:
        validate_split(cfg)
        super().validate(cfg)

    @classmethod
    def check_model(cls, cfg, input_shape: tuple, num_classes: int) -> None:
        check_split(cfg, input_shape, num_classes)

    @classmethod
    def device_memory(cls, cfg, profile):
        return split_memory(cls, cfg, profile)


class MPStrategy(SplitBlocks):
    """One worker, the model split over its ``gpus_per_worker`` devices."""

    name = "mp"
    replication = "none"
    options_used = frozenset({"gpus_per_worker", "balance"})
    one_worker_instead = "use strategy='ddp_mp' (DDP over workers, each holding the split model)"

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        # At most one device per block of the model.
        return {"num_workers": 1, "gpus_per_worker": min(max(info.devices_per_node), num_blocks(cfg))}

    @classmethod
    def auto_num_workers(cls, cfg, info) -> int:
        return 1  # auto_layout's, without the model its device count needs
