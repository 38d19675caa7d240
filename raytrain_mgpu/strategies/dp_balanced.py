"""``dp_balanced``: DataParallel whose outputs never leave their devices.

Our take on seed 001's "custom DataParallel" (PyTorch-Encoding's DataParallelModel +
DataParallelCriterion): inputs *and targets* are scattered, each device computes its slice's
outputs, the run's loss (``TrainConfig.loss``) and every metric's ``(sum, count)``, and only
those scalars cross to the first device. With ``nn.DataParallel`` all outputs are gathered on
one GPU first, which for large outputs (many classes, per-token vocabularies) is what fills it
up. The mean loss is the plain model's mean over the batch, for any loss that is a mean over
the targets; one that needs the whole batch at once (in-batch negatives) is ``ddp2``'s (or
``dp``'s) to compute. On the worker: placement ``balanced`` (``raytrain_mgpu/parallel/placement.py``).
"""

from __future__ import annotations

from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, NodeDevices
from raytrain_mgpu.strategies.dp import data_parallel_memory


class DPBalancedStrategy(NodeDevices):
    """Scatter inputs and targets, loss per device, only scalars and indices gathered."""

    name = "dp_balanced"
    placement, replication = "balanced", "none"
    options_used = frozenset({"gpus_per_worker"})
    one_worker_instead = "use strategy='ddp' (one worker per GPU: no device gathers anything, and it spans nodes)"

    @classmethod
    def auto_rank(cls, info):
        return AUTO_MEASURE_ONLY + 1  # device 0 holds the whole state: only a measurement can prefer it

    @classmethod
    def device_memory(cls, cfg, profile):
        return data_parallel_memory(cls, cfg, profile, 1, balanced=True)
