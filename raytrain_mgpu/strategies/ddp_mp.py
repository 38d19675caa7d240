"""``ddp_mp``: DDP over workers, each holding the model split over its devices.

Seed 000's "distributed model and data parallel": every worker is one data-parallel
replica whose model spans ``gpus_per_worker`` devices (split as in ``mp``). DDP is built
with ``device_ids=None``, as torch requires for a module on several devices; its buckets
are then per device and each device's gradients are all-reduced with the other workers'.
Under GPU emulation every device is the CPU: the split, the hops and DDP over the split
model run as on GPUs, with gloo. On the worker: placement ``split``, then replication ``replicate`` (DDP).
"""

from __future__ import annotations

from raytrain_mgpu.strategies.base import DDP_OPTIONS, num_blocks
from raytrain_mgpu.strategies.mp import SplitBlocks


class DDPMPStrategy(SplitBlocks):
    """Data parallel over workers, model parallel inside each."""

    name = "ddp_mp"
    replication = "replicate"
    elastic = True  # one replica per worker: num_workers=(min, max) resizes it
    options_used = DDP_OPTIONS | {"gpus_per_worker", "balance", "sync_batchnorm"}

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        n, nodes = info.num_devices, info.num_nodes
        # Across nodes: one worker per node over its devices (at most one per block); on one node: pairs.
        workers = nodes if nodes > 1 else n // 2
        devices = min(min(info.devices_per_node), num_blocks(cfg)) if nodes > 1 else 2
        if workers < 2 or devices < 2:
            raise ValueError(f"{cls.name} needs at least 2 workers x 2 devices; with {n} device(s) it is mp or ddp")
        return {"num_workers": workers, "gpus_per_worker": devices}

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        if num_gpus < 2:
            raise ValueError("needs 2 GPUs")
        return {"num_workers": max(1, min(2, num_gpus // 2)), "gpus_per_worker": 2}
