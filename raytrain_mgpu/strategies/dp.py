"""``dp``: ``nn.DataParallel`` over the devices of one worker (the seeds' "one line").

Every step scatters the batch from the first device, replicates the model onto every
device, runs the replicas in threads and gathers all outputs onto ``output_device``,
where the loss is computed. That gather is why the first GPU fills up first (seed 001);
``output_device`` moves it elsewhere, ``dp_balanced`` avoids it, and ``ddp`` (one process
per GPU) is faster still. On the worker: placement ``data_parallel``
(``raytrain_mgpu/parallel/placement.py``: torch's DataParallel on CUDA with the caller's
autocast dtype, CPU stand-ins under GPU emulation), no replication.
"""

from __future__ import annotations

from raytrain_mgpu.strategies._memory import data_parallel_node
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, NodeDevices


def check_output_device(cfg) -> None:
    if cfg.output_device is not None and not 0 <= cfg.output_device < cfg.gpus_per_worker:
        raise ValueError(
            f"TrainConfig.output_device={cfg.output_device}: must be the local index of one of the "
            f"worker's gpus_per_worker={cfg.gpus_per_worker} devices (0 to {cfg.gpus_per_worker - 1}). "
            f"Leave it unset to gather on the first device.")


def data_parallel_memory(cls, cfg, profile, replicas: int, balanced: bool) -> list:
    """``replicas`` workers, each running DataParallel (or ``dp_balanced``) over its devices."""
    share = 1 / (replicas * cls.micro_batches_per_step(cfg))
    return data_parallel_node(profile, cfg.gpus_per_worker, share, balanced, cfg.output_device or 0) * replicas


class DPStrategy(NodeDevices):
    """``nn.DataParallel`` in one worker holding ``gpus_per_worker`` devices."""

    name = "dp"
    placement, replication = "data_parallel", "none"
    options_used = frozenset({"gpus_per_worker", "output_device"})
    one_worker_instead = ("use strategy='ddp2' (DataParallel per node, DDP across nodes) or 'ddp' (one worker "
                          "per GPU, usually faster)")

    @classmethod
    def validate(cls, cfg) -> None:
        check_output_device(cfg)
        super().validate(cfg)

    @classmethod
    def auto_rank(cls, info):
        return AUTO_MEASURE_ONLY + 2  # the estimate never prefers it: device 0 holds the whole state

    @classmethod
    def device_memory(cls, cfg, profile):
        return data_parallel_memory(cls, cfg, profile, 1, balanced=False)
