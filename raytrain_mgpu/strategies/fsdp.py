"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one shard per worker; with ``shard_group_size``
HSDP: shards within groups of that many workers, replicas across the groups (a 2-D device mesh).

Each block of the model (see ``raytrain_mgpu.models.partition.blocks_of``) and then the
root are sharded: every worker keeps 1/N of the parameters, gradients and optimizer
state, all-gathers a block's parameters just before its forward/backward and
reduce-scatters its gradients after. It trades that communication for memory: use it
when the model (with its optimizer state) does not fit on one device.

Runs on CPU with gloo (torch >= 2.4 supports it), so the tests exercise the sharding.
``bf16-mixed`` also sets FSDP's ``MixedPrecisionPolicy`` (all-gather and compute in
bf16, gradients reduced in fp32), which halves the all-gather traffic. ``16-mixed`` is
refused: ``GradScaler`` checks for overflow per shard, so workers could disagree on
skipping a step.

The full model is never on a device: rank 0 builds it on the CPU (with the run's seed,
so its weights are those of ``ddp`` and of one worker), every other rank builds it on
``meta`` (``build_on_meta``). Every rank shards the meta model, allocates only its shards
(``to_empty``), and rank 0 sends the weights one tensor at a time
(``set_model_state_dict(broadcast_from_rank0=True)``): the device peak at start-up is the
shards plus the largest tensor. Host memory: rank 0 holds one full copy, the others none.

Checkpoints are sharded: every rank writes its own shards of the model and optimizer state
(``torch.distributed.checkpoint``), no rank gathers the full state; a resume on another number
of workers reshards, and ``TrainResult.load_model()`` consolidates the model on the driver
(``checkpointing/files.py``, ``worker_checkpoint.save_and_report``).
On the worker: placement ``keep`` (where it was built), then replication ``fully_shard``
(``raytrain_mgpu/parallel/replication.py``).
"""

from __future__ import annotations

from raytrain_mgpu.strategies._memory import DeviceMemory, fsdp_state_bytes, tensor_parallel_memory
from raytrain_mgpu.strategies.base import (TENSOR_PARALLEL_OPTIONS, TENSOR_PARALLEL_REFUSALS, Refusal, TensorGroups,
                                           data_parallel_workers)
from raytrain_mgpu.strategies.ddp import replicated_memory


class FSDPStrategy(TensorGroups):
    """Fully sharded data parallel (FSDP2) over the workers."""

    name = "fsdp"
    placement, replication = "keep", "fully_shard"
    options_used = frozenset({"sync_batchnorm", "shard_group_size", "cpu_offload"}) | TENSOR_PARALLEL_OPTIONS
    refusals = (Refusal(lambda cfg: cfg.shard_group_size is not None and cfg.num_workers % cfg.shard_group_size != 0,
                        "TrainConfig.shard_group_size={cfg.shard_group_size}: must divide num_workers={cfg.num_workers} "
                        "(every group of that many workers holds one sharded copy of the model). Set it to the "
                        "workers of one node, or leave it unset to shard over all workers."),
                Refusal(lambda cfg: cfg.precision == "16-mixed",
                        "TrainConfig.precision='16-mixed' with strategy='fsdp': the GradScaler's overflow check sees "
                        "only this worker's shard, so workers could disagree on skipping a step. Use "
                        "precision='bf16-mixed' (same memory saving, no loss scaling needed)."),
                *TENSOR_PARALLEL_REFUSALS)

    @classmethod
    def auto_variants(cls, cfg, info) -> tuple:
        """Tensor groups of 2, 4, 8 devices inside each node: each layer split too, when even its shards (its
        parameters, gradients and optimizer state, with a block gathered and its activations) do not fit."""
        node = min(info.devices_per_node)
        if not node:  # no device to split a layer over
            return ()
        return tuple({"tensor_parallel_size": t, "num_workers": t * data_parallel_workers(cfg, info.num_devices // t)}
                     for t in (2, 4, 8) if node % t == 0)

    @classmethod
    def auto_rank(cls, info):
        return 1 if info.num_nodes == 1 else 2  # across nodes the pipeline goes first

    @classmethod
    def auto_reason(cls, info) -> str:
        return f"{cls.name} shards parameters, gradients and optimizer state over the devices"

    @classmethod
    def device_memory(cls, cfg, profile):
        if cfg.tensor_parallel_size > 1:
            return tensor_parallel_memory(profile, cfg, cls.data_parallel_size(cfg), cls.micro_batches_per_step(cfg),
                                          sharded=True)
        replicas = replicated_memory(cls, cfg, profile)
        if cfg.num_workers == 1:
            return replicas  # one worker: nothing to shard over
        shards = cfg.shard_group_size or cfg.num_workers  # HSDP: the state is split over a group, not all workers
        return [DeviceMemory(fsdp_state_bytes(profile, shards, cfg.cpu_offload), replicas[0].per_sample)] * cfg.num_workers
