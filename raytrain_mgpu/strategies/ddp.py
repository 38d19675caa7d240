"""``ddp``: one model replica per Ray Train worker, gradients all-reduced by DDP."""

from __future__ import annotations

from raytrain_mgpu.strategies._memory import replica_on, tensor_parallel_memory, whole_model
from raytrain_mgpu.strategies.base import (AUTO_FIRST, DDP_OPTIONS, TENSOR_PARALLEL_OPTIONS, TENSOR_PARALLEL_REFUSALS,
                                           TensorGroups)


class DDPStrategy(TensorGroups):
    """``DistributedDataParallel`` over the workers (gloo on CPU, NCCL on GPU)."""

    name = "ddp"
    placement, replication = "device", "replicate"
    options_used = DDP_OPTIONS | {"sync_batchnorm"} | TENSOR_PARALLEL_OPTIONS
    refusals = TENSOR_PARALLEL_REFUSALS

    @classmethod
    def auto_rank(cls, info):
        return AUTO_FIRST  # the plain model replicated: the first choice when it fits one device

    @classmethod
    def auto_reason(cls, info) -> str:
        if info.num_devices == 1:
            return f"{cls.name} with one worker (the plain model)"
        return f"{cls.name} over all {info.num_devices} devices"

    @classmethod
    def device_memory(cls, cfg, profile):
        if cfg.tensor_parallel_size > 1:
            return tensor_parallel_memory(profile, cfg, cls.data_parallel_size(cfg), cls.micro_batches_per_step(cfg),
                                          sharded=False)
        return replicated_memory(cls, cfg, profile)


def replicated_memory(cls, cfg, profile) -> list:
    """One whole replica per worker, each seeing one micro-batch of its share of the global batch."""
    replicas = cls.data_parallel_size(cfg)
    share = 1 / (replicas * cls.micro_batches_per_step(cfg))
    return replica_on(profile, whole_model(profile), share, [1.0], share) * replicas
