"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one shard per worker.

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

Checkpoints hold the full, unsharded state (model and optimizer), gathered to rank 0:
the calls are collective, so every rank makes them (``loop._save_and_report`` does).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict, Iterator

import torch.distributed as dist

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raytrain_mgpu.models.partition import blocks_of
from raytrain_mgpu.strategies._memory import DeviceMemory, fsdp_state_bytes
from raytrain_mgpu.strategies.base import Strategy, data_parallel_workers
from raytrain_mgpu.strategies.ddp import replicated_memory

# Full (unsharded) state gathered into CPU memory on rank 0; other ranks get an empty dict.
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True)
# Rank 0's full state reaches every rank's shards, one tensor at a time (start-up).
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _shard_units(model: nn.Module) -> list:
    """Blocks with parameters, sharded one by one so only one block is ever gathered."""
    try:
        blocks = blocks_of(model)
    except ValueError:
        return []  # not splittable: the root alone is one unit
    return [block for block in blocks if any(True for _ in block.parameters())]


class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2) over the workers."""

    name = "fsdp"
    elastic = True  # one replica per worker: num_workers=(min, max) resizes it
    options_used = frozenset({"sync_batchnorm"})

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.precision == "16-mixed":
            raise ValueError(
                "TrainConfig.precision='16-mixed' with strategy='fsdp': the GradScaler's overflow check "
                "sees only this worker's shard, so workers could disagree on skipping a step. Use "
                "precision='bf16-mixed' (same memory saving, no loss scaling needed).")
        super().validate(cfg)

    @classmethod
    def auto_layout(cls, cfg, info) -> dict:
        return {"num_workers": data_parallel_workers(cfg, info.num_devices)}

    @classmethod
    def auto_rank(cls, info):
        return 1 if info.num_nodes == 1 else 2  # across nodes the pipeline goes first

    @classmethod
    def auto_reason(cls, info) -> str:
        return f"{cls.name} shards parameters, gradients and optimizer state over the devices"

    @classmethod
    def device_memory(cls, cfg, profile):
        replicas = replicated_memory(cls, cfg, profile)
        if cfg.num_workers == 1:
            return replicas  # one worker: nothing to shard over
        return [DeviceMemory(fsdp_state_bytes(profile, cfg.num_workers), replicas[0].per_sample)] * cfg.num_workers

    def build_on_meta(self) -> bool:
        return self.ctx.world_rank != 0

    def setup_model(self, model: nn.Module) -> nn.Module:
        """Shard on meta, allocate the shards on the device, fill them from rank 0's CPU model."""
        rank0 = self.ctx.world_rank == 0
        full = model.state_dict() if rank0 else {}  # CPU tensors: they outlive the meta swap below
        extra = _non_persistent_buffers(model) if rank0 else {}
        _to_meta(model)
        model = self._shard(model)
        model.to_empty(device=self.device)
        set_model_state_dict(model, full, options=_FROM_RANK0)
        _broadcast_buffers(model, extra, self.device)
        return model

    def _shard(self, model: nn.Module) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.ctx.world_size,))
        if self.cfg.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        units = _shard_units(model)
        for index, unit in enumerate(units):
            # The last block's parameters are needed again at once by the backward: keep them.
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(units) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    def no_sync(self, model: nn.Module) -> ContextManager:
        return _no_gradient_sync(model)

    def state_dict(self, model: nn.Module) -> dict:
        return get_model_state_dict(self.unwrap(model), options=_SAVE)

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        # torch swaps the dict's tensors for shards in place: hand it a copy of the mapping.
        set_model_state_dict(self.unwrap(model), dict(state), options=_LOAD)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return get_optimizer_state_dict(self.unwrap(model), optimizer, options=_SAVE)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state = {**state, "state": {key: dict(value) for key, value in state["state"].items()}}
        set_optimizer_state_dict(self.unwrap(model), optimizer, state, options=_LOAD)


def _to_meta(model: nn.Module) -> None:
    """Swap every parameter and buffer for a meta one, in place; tied tensors stay tied."""
    swapped: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in swapped:
                    meta = torch.empty_like(tensor, device="meta")
                    swapped[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(
                        tensor, nn.Parameter) else meta
                table[name] = swapped[id(tensor)]


def _non_persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers ``state_dict`` leaves out (e.g. cached position tables): sent separately."""
    saved = model.state_dict().keys()
    return {name: buf for name, buf in model.named_buffers() if name not in saved}


def _broadcast_buffers(model: nn.Module, rank0_values: Dict[str, torch.Tensor], device: torch.device) -> None:
    """Fill the non-persistent buffers (garbage after ``to_empty``) with rank 0's values."""
    persistent = model.state_dict().keys()
    for name, buf in model.named_buffers():
        if name in persistent:
            continue
        if name in rank0_values:
            buf.copy_(rank0_values[name].to(device))
        dist.broadcast(buf, src=0)


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the next synced backward reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
