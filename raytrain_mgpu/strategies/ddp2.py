"""``ddp2``: one worker per node, DataParallel over the node's GPUs, DDP across nodes.

Lightning's ``ddp2`` (removed in Lightning 1.7), rebuilt on torch: each worker wraps the
model in DataParallel over its ``gpus_per_worker`` devices, and DDP (``device_ids=None``)
all-reduces the gathered gradients between workers. The outputs of the node's devices are
gathered on ``output_device`` and the run's loss (``TrainConfig.loss``) is computed there,
once, on the node's whole batch: that is what ``ddp2`` is for. A loss that needs the whole
batch at once, e.g. InfoNCE, whose negatives for a sample are the other samples of the
batch, sees every sample of the node (``ddp`` would give it one GPU's slice, ``dp_balanced``
one device's). For a loss that is a mean over samples, ``ddp`` with one worker per GPU
computes the same and is faster.

With GPUs, more than one worker must use ``placement='STRICT_SPREAD'`` so that Ray puts
each on its own node. On CPU the workers stand in for nodes on one machine, so any
placement is accepted and the tests run the whole logic there; with several CPU "devices"
(GPU emulation) the DataParallel part runs ``dp``'s scatter/replicate/parallel_apply/gather
on CPU stand-ins, under DDP. On the worker: placement ``data_parallel``, then replication ``replicate`` (DDP).
"""

from __future__ import annotations

from raytrain_mgpu.strategies.base import DDP_OPTIONS, NodeDevices, Refusal
from raytrain_mgpu.strategies.dp import check_output_device, data_parallel_memory


class DDP2Strategy(NodeDevices):
    """DataParallel inside each worker (node), DDP between workers."""

    name = "ddp2"
    placement, replication = "data_parallel", "replicate"
    # Not elastic: a worker count change regroups the samples of each node's micro-batch, which a
    # loss over the whole batch (what ddp2 is for, e.g. InfoNCE) sees; the mean of a per-sample loss would not.
    elastic = False
    options_used = DDP_OPTIONS | {"gpus_per_worker", "output_device"}
    refusals = (
        Refusal(lambda cfg: cfg.use_gpu and cfg.num_workers > 1 and cfg.placement != "STRICT_SPREAD",
                "TrainConfig.placement={cfg.placement!r} with strategy='ddp2' and num_workers={cfg.num_workers}: "
                "ddp2 runs one worker per node, holding that node's GPUs. Set placement='STRICT_SPREAD' (and "
                "gpus_per_worker to the GPUs of a node), or use strategy='ddp' for several workers on one node."),
        Refusal(lambda cfg: cfg.sync_batchnorm,
                "TrainConfig.sync_batchnorm=True with strategy='ddp2': each DataParallel replica would start "
                "SyncBatchNorm's collectives from its own thread, which deadlocks or mixes them up. Use "
                "strategy='ddp' (one worker per GPU) for SyncBatchNorm, or set sync_batchnorm=False."),
    )

    @classmethod
    def validate(cls, cfg) -> None:
        check_output_device(cfg)
        super().validate(cfg)

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        n = info.num_devices
        if info.num_nodes > 1:
            return {"num_workers": info.num_nodes, "gpus_per_worker": min(info.devices_per_node),
                    "placement": "STRICT_SPREAD"}
        if info.use_gpu or n < 2:
            raise ValueError(f"{cls.name} runs one worker per node and needs at least 2 nodes; on one node it is dp")
        return {"num_workers": 2, "gpus_per_worker": n // 2}  # CPU workers stand in for nodes

    @classmethod
    def device_memory(cls, cfg, profile):
        return data_parallel_memory(cls, cfg, profile, cfg.num_workers, balanced=False)
