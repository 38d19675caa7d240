"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one shard per worker.

Each block of the model (see ``raytrain_mgpu.pipeline.partition.blocks_of``) and then the
root are sharded: every worker keeps 1/N of the parameters, gradients and optimizer
state, all-gathers a block's parameters just before its forward/backward and
reduce-scatters its gradients after. It trades that communication for memory: use it
when the model (with its optimizer state) does not fit on one device.

Runs on CPU with gloo (torch >= 2.4 supports it), so the tests exercise the sharding.
``bf16-mixed`` also sets FSDP's ``MixedPrecisionPolicy`` (all-gather and compute in
bf16, gradients reduced in fp32), which halves the all-gather traffic. ``16-mixed`` is
refused: ``GradScaler`` checks for overflow per shard, so workers could disagree on
skipping a step.

Checkpoints hold the full, unsharded state (model and optimizer), gathered to rank 0:
the calls are collective, so every rank makes them (``loop._save_and_report`` does).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raytrain_mgpu.pipeline.partition import blocks_of
from raytrain_mgpu.strategies.base import Strategy

# Full (unsharded) state gathered into CPU memory on rank 0; other ranks get an empty dict.
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True)


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
    options_used = frozenset({"sync_batchnorm"})

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.precision == "16-mixed":
            raise ValueError(
                "TrainConfig.precision='16-mixed' with strategy='fsdp': the GradScaler's overflow check "
                "sees only this worker's shard, so workers could disagree on skipping a step. Use "
                "precision='bf16-mixed' (same memory saving, no loss scaling needed).")
        super().validate(cfg)

    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
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


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally; the next synced backward reduce-scatters them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
