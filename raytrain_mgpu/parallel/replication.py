"""Step 2 of a strategy on the worker: how the workers' copies of the model stay equal.

- ``none``: one process trains (``dp``, ``dp_balanced``, ``mp``);
- ``replicate``: ``DistributedDataParallel`` over the workers (gloo on CPU, NCCL on GPU), with
  ``device_ids=None`` where the placed model spans several devices (``ddp2``, ``ddp_mp``), as
  torch requires; a single worker trains the plain model (a one-process DDP only adds hooks);
- ``fully_shard``: FSDP2 (``torch.distributed.fsdp.fully_shard``), one shard per worker (``fsdp``).

FSDP. Each block of the model (``models.partition.blocks_of``) and then the root are sharded:
every worker keeps 1/N of the parameters, gradients and optimizer state, all-gathers a block's
parameters just before its forward/backward and reduce-scatters its gradients after. Runs on
CPU with gloo, so the tests exercise the sharding. ``bf16-mixed`` also sets FSDP's
``MixedPrecisionPolicy`` (all-gather and compute in bf16, gradients reduced in fp32). The full
model is never on a device: rank 0 builds it on the CPU (with the run's seed, so its weights
are those of ``ddp`` and of one worker), every other rank on ``meta`` (``build_on_meta``). Every
rank shards the meta model, allocates only its shards (``to_empty``), and rank 0 sends the
weights one tensor at a time (``set_model_state_dict(broadcast_from_rank0=True)``): the device
peak at start-up is the shards plus the largest tensor. Checkpoints are sharded: every rank
writes its own shards of the model and optimizer with ``torch.distributed.checkpoint``
(``save_sharded``), and a resume on any number of workers reads the pieces its shards cover
(``load_sharded``); the calls are collective (``engine/checkpoints.Saver``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING, ContextManager, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from raytrain_mgpu.checkpointing.files import check_sharded_metadata
from raytrain_mgpu.models.partition import blocks_of

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from raytrain_mgpu.parallel.steps import DataParallelSteps

__all__ = ["Replication", "REPLICATIONS", "ddp_kwargs", "ddp_no_sync"]


class Replication:
    """One process trains the placed model as it is."""

    name = "none"

    def build_on_meta(self, ctx) -> bool:
        return False

    def wrap(self, model: nn.Module, worker: "DataParallelSteps") -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    # The plain (unwrapped) model's state and the optimizer's, for checkpoints.
    def state_dict(self, model: nn.Module) -> dict:
        return model.state_dict()

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        model.load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    sharded_checkpoint = False
    """Whether every rank writes its own shards (``save_sharded``) instead of rank 0 the full state."""

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     asynchronous: bool = False, trainable_only: bool = False) -> Optional[Future]:
        raise NotImplementedError(f"replication {self.name!r} saves the full state (sharded_checkpoint=False)")

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     trainable_only: bool = False) -> None:
        raise NotImplementedError(f"replication {self.name!r} loads the full state (sharded_checkpoint=False)")


# ----------------------------------------------------------------------------- DDP


def ddp_kwargs(cfg, device_ids) -> dict:
    """The DDP options a user can pass through TrainConfig."""
    kwargs = dict(device_ids=device_ids,
                  find_unused_parameters=cfg.find_unused_parameters,
                  static_graph=cfg.static_graph,
                  gradient_as_bucket_view=cfg.gradient_as_bucket_view)
    if cfg.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = cfg.bucket_cap_mb
    return kwargs


def ddp_no_sync(model: nn.Module) -> ContextManager:
    """DDP's ``no_sync()`` for ``model``, also when ``torch.compile`` wrapped it.

    ``torch.compile`` returns an ``OptimizedModule`` holding the DDP module as ``_orig_mod``;
    it is no DDP instance, so checking the wrapper would all-reduce every accumulation
    micro-step (one full gradient all-reduce each).
    """
    inner = getattr(model, "_orig_mod", model)
    return inner.no_sync() if isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()


class DDPReplication(Replication):
    """DistributedDataParallel over the workers."""

    name = "replicate"  # as torch.distributed's composable replicate(), which is DDP

    def wrap(self, model: nn.Module, worker: "DataParallelSteps") -> nn.Module:
        if worker.ctx.world_size == 1:
            return model  # one replica: nothing to all-reduce
        one_gpu = not worker.placement.spans_devices and worker.device.type == "cuda"
        # device_ids=None for a module on several devices (DataParallel, a split) or on the CPU.
        return DistributedDataParallel(model, **ddp_kwargs(worker.cfg, [worker.device] if one_gpu else None))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return ddp_no_sync(model)


# ----------------------------------------------------------------------------- FSDP

def _options(**kwargs):
    """Full (unsharded) state dicts (start-up, ``keep_best``'s copy; checkpoints are sharded): saved gathered to
    rank 0's CPU (``cpu_offload``; the other ranks get an empty dict), loaded from every rank's full copy or
    sent from rank 0 (``broadcast_from_rank0``)."""
    return StateDictOptions(full_state_dict=True, **kwargs)


def offload_devices(device: torch.device, cpu_offload: bool) -> tuple:
    """``(where the shards live, where the buffers live)`` for fsdp on ``device``: with ``cpu_offload`` the
    shards on the host and the buffers (which FSDP does not manage or move) on the device, as torchtitan
    initialises an offloaded model; otherwise both on the device."""
    return (torch.device("cpu") if cpu_offload else device), device


def allocate(model: nn.Module, shards_on: torch.device, buffers_on: torch.device) -> torch.device:
    """Allocate the sharded meta ``model``'s (uninitialised) shards on ``shards_on`` and its buffers on
    ``buffers_on`` (FSDP moves parameters only, so an offloaded model's buffers are placed here); returns
    ``buffers_on``."""
    model.to_empty(device=shards_on)
    if buffers_on != shards_on:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(buffers_on)
    return buffers_on


def offload_policy(device: torch.device, cpu_offload: bool):
    """FSDP2's offload policy for shards computed on ``device``: ``CPUOffloadPolicy`` with ``cpu_offload``
    (pinned host memory where the device is a GPU, so the copies overlap compute; plain on a CPU-only host),
    else the no-offload default."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()


def shard_groups_across_nodes(node_ranks: list, shard: int) -> list:
    """The HSDP shard groups (``shard`` consecutive world ranks each) whose ranks are on more than one node,
    as lists of ranks; ``node_ranks[r]``: world rank r's node."""
    groups = [list(range(start, start + shard)) for start in range(0, len(node_ranks), shard)]
    return [group for group in groups if len({node_ranks[r] for r in group}) > 1]


def _shard_units(model: nn.Module) -> list:
    """Blocks with parameters, sharded one by one so only one block is ever gathered."""
    try:
        blocks = blocks_of(model)
    except ValueError:
        return []  # not splittable: the root alone is one unit
    return [block for block in blocks if any(True for _ in block.parameters())]


class FSDPReplication(Replication):
    """Fully sharded data parallel (FSDP2) over the workers."""

    name = "fully_shard"

    def build_on_meta(self, ctx) -> bool:
        return ctx.world_rank != 0

    def wrap(self, model: nn.Module, worker: "DataParallelSteps") -> nn.Module:
        """Shard on meta, allocate the shards on the device, fill them from rank 0's CPU model."""
        rank0 = worker.ctx.world_rank == 0
        full = model.state_dict() if rank0 else {}  # CPU tensors: they outlive the meta swap below
        extra = _non_persistent_buffers(model) if rank0 else {}
        _to_meta(model)
        model = self._shard(model, worker)
        buffers_on = allocate(model, *offload_devices(worker.device, worker.cfg.cpu_offload))
        set_model_state_dict(model, full, options=_options(broadcast_from_rank0=True))
        _broadcast_buffers(model, extra, buffers_on)
        return model

    def _shard(self, model: nn.Module, worker: "DataParallelSteps") -> nn.Module:
        mesh = self._mesh(model, worker)
        if worker.cfg.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        offload = offload_policy(worker.device, worker.cfg.cpu_offload)
        units = _shard_units(model)
        for index, unit in enumerate(units):
            # The last block's parameters are needed again at once by the backward: keep them.
            fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload,
                        reshard_after_forward=index < len(units) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        return model

    def _mesh(self, model: nn.Module, worker: "DataParallelSteps"):
        """The mesh FSDP shards over (collective): every worker's, or HSDP's (replicate x shard); with tensor
        parallel the data dimension of a 2-D mesh, the plan applied (a subclass in ``parallel/tensor_parallel.py``)."""
        world = worker.ctx.world_size
        shard = worker.cfg.shard_group_size or world
        if shard < world:  # HSDP: consecutive ranks (a node's workers) shard, the groups replicate (torchtitan's dp_replicate x dp_shard)
            nodes = [None] * world
            dist.all_gather_object(nodes, worker.ctx.node_rank)  # once, at set-up
            spanning = shard_groups_across_nodes(nodes, shard)
            if spanning and worker.ctx.world_rank == 0:
                logger.warning("shard_group_size=%d: the shard groups %s span nodes %s, so every all-gather of "
                               "theirs crosses the network. Set shard_group_size to the workers of one node (and "
                               "the same number of workers on every node).", shard, spanning,
                               [sorted({nodes[r] for r in group}) for group in spanning])
            return init_device_mesh(worker.device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(worker.device.type, (world,))

    def no_sync(self, model: nn.Module) -> ContextManager:
        return _no_gradient_sync(model)

    def state_dict(self, model: nn.Module) -> dict:
        return get_model_state_dict(model, options=_options(cpu_offload=True))

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        # torch swaps the dict's tensors for shards in place: hand it a copy of the mapping.
        set_model_state_dict(model, dict(state), options=_options())

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state = {**state, "state": {key: dict(value) for key, value in state["state"].items()}}
        set_optimizer_state_dict(model, optimizer, state, options=_options())

    # Checkpoints: each rank its own shards (DCP), never the full state on one rank (checkpointing/files.py).
    sharded_checkpoint = True

    def save_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     asynchronous: bool = False, trainable_only: bool = False) -> Optional[Future]:
        """Write this rank's shards of the model and the optimizer into ``path`` (collective: every rank
        calls it, each with its own folder; rank 0's also gets DCP's ``.metadata``). The state dicts are
        views of the shards (DTensors): nothing is gathered. ``trainable_only`` (``save="trainable"``, LoRA):
        the model's frozen parameters are left out (they come back from the model's builder).
        ``asynchronous``: DCP's ``async_save``, which
        returns once the shards are copied to host memory (the only stall) and writes them in a thread;
        the Future is done once they are written. The host copy goes into buffers kept from this worker's
        first asynchronous save (:meth:`_stager`)."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": _trainable(model, model_state) if trainable_only else model_state,
                 "optimizer": optimizer_state}
        if not asynchronous:
            dcp.save(state, checkpoint_id=path)
            return None
        # The writing thread's collectives (the save plan, the metadata) go over a gloo group of their
        # own: on the default group they could interleave with the training step's.
        return dcp.async_save(state, checkpoint_id=path, process_group=_checkpoint_group(),
                              async_stager=self._stager(model))

    _staging = None

    def _stager(self, model: nn.Module):
        """DCP's stager, kept for every asynchronous save of this worker: its host buffers are made once and
        reused (pinned, with non-blocking copies, where the shards are on a GPU). Without one, ``async_save``
        makes fresh pageable buffers every time: on one H200 its copy took up to 1.8 s of an epoch's 5.3 s
        stall, against 2.7 s for the synchronous save. Reuse is safe: a rank's next save begins after its
        previous write is done (Ray Train's transport waits for its upload, which waits for the write).
        The cost: one host copy of this rank's share, kept for the run."""
        if self._staging is None:
            # late: looked up when the stager is made (a test replaces DefaultStager)
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = any(p.device.type == "cuda" for p in model.parameters())
            self._staging = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=gpu))
            weakref.finalize(self, self._staging.close)  # unpins its buffers
        return self._staging

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                     trainable_only: bool = False) -> None:
        """Fill this rank's shards from the sharded checkpoint at ``path`` (every rank's files in it),
        written by any number of ranks: DCP reads the pieces each shard now covers (collective).
        ``trainable_only``: the checkpoint holds the trainable part; the frozen shards stay as built."""
        check_sharded_metadata(path)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": _trainable(model, model_state) if trainable_only else model_state,
                 "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=not trainable_only))


_CHECKPOINT_GROUPS: Dict[int, object] = {}


def _checkpoint_group():
    """A gloo group over every rank for asynchronous checkpoints, one per default group (made collectively:
    every rank's first asynchronous save, which all ranks make together)."""
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _CHECKPOINT_GROUPS:
        _CHECKPOINT_GROUPS[key] = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUPS[key]


def _trainable(model: nn.Module, model_state: dict) -> dict:
    """``model_state`` without the entries of ``model``'s frozen parameters (``save="trainable"``)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: value for name, value in model_state.items() if name not in frozen}


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


REPLICATIONS = {cls.name: cls() for cls in (Replication, DDPReplication, FSDPReplication)}
