"""Tensor parallel (``TrainConfig.tensor_parallel_size=T``): each layer's weights split over a group of T workers.

The workers form a 2-D device mesh, ``("data", "tensor")``: T consecutive ranks are one tensor group (one node's
workers, when each node holds a multiple of T), and the groups are the data-parallel replicas. A plan maps module
paths to ``torch.distributed.tensor.parallel`` styles, applied with ``parallelize_module`` on the ``tensor`` sub-mesh;
then FSDP2 shards over ``data`` (``fsdp``: :class:`TensorParallelFSDP`), or FSDP2's ``replicate`` all-reduces over it
(``ddp``: :class:`TensorParallelReplicate`), as torchtitan composes them: torch's own collectives, none written
here. The ranks of a tensor group read the same batch (``DataParallelSteps.shard``) and the first of them counts
it in the epoch's sums.

Plans, first found wins: the user's (``tensor_parallel_plan``, style names from ``config_sections``), the
package's ``transformer_lm`` plan (:func:`transformer_lm_plan`), a Hugging Face model's own (its ``_tp_plan``).
A model with none is refused on the driver, before Ray (:func:`check_model_plan`), with what to add.

``transformer_lm``'s plan is Megatron's: ``q``, ``k``, ``v`` and the MLP's first layer split by output features
(column-wise: each rank whole heads), ``proj`` and the MLP's last layer by input features (row-wise), and
sequence parallel between them: the LayerNorms and the residual stream hold a slice of the sequence, all-gathered
before the attention and the MLP and reduce-scattered after. The token embedding is split by vocabulary rows, the
vocabulary projection by columns (its logits gathered: the loss and metrics see plain tensors).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from raytrain_mgpu.models import build_model_shapes
from raytrain_mgpu.models.transformer import TransformerLM
from raytrain_mgpu.parallel.replication import FSDPReplication, shard_groups_across_nodes

if TYPE_CHECKING:
    from raytrain_mgpu.parallel.steps import DataParallelSteps

logger = logging.getLogger(__name__)

__all__ = ["model_plan", "check_model_plan", "tensor_parallel_mesh", "TensorParallelFSDP", "TensorParallelReplicate",
           "TENSOR_PARALLEL_REPLICATIONS", "transformer_lm_plan"]


def style(name: str):
    """The ``ParallelStyle`` a plan's style name means (``config_sections.TensorParallelStyle``)."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    if name not in styles:
        raise ValueError(f"tensor-parallel style {name!r} is not one of {sorted(styles)}. Give the module a "
                         f"TrainConfig.tensor_parallel_plan with those styles.")
    return styles[name]()


def transformer_lm_plan(model: nn.Module) -> dict:
    """``{module path: ParallelStyle}`` for the package's ``TransformerLM`` (the module's docstring)."""
    last = len(model) - 1
    gather = dict(input_layouts=Shard(1), desired_input_layouts=Replicate())  # the sequence, whole again
    plan = {"0.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # the embedding's sum is whole on every rank: each keeps its slice of the sequence (no communication)
            "0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
            f"{last}.norm": SequenceParallel(),
            f"{last}.out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(1, last):
        plan.update({f"{i}.norm1": SequenceParallel(), f"{i}.norm2": SequenceParallel(),
                     f"{i}.attn": PrepareModuleInput(**gather), f"{i}.mlp": PrepareModuleInput(**gather),
                     **{f"{i}.attn.{p}": ColwiseParallel() for p in ("q", "k", "v")},
                     f"{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                     f"{i}.mlp.0": ColwiseParallel(), f"{i}.mlp.2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def model_plan(model: nn.Module, user_plan: Optional[dict]) -> Tuple[str, dict, dict]:
    """``(where the plan comes from, {path: style name or None}, {path: ParallelStyle})`` for ``model``; ValueError
    naming what to add where there is none."""
    if user_plan:
        return "tensor_parallel_plan", dict(user_plan), {path: style(name) for path, name in user_plan.items()}
    if isinstance(model, TransformerLM):
        built = transformer_lm_plan(model)
        return "transformer_lm's plan", {path: None for path in built}, built
    for prefix, module in model.named_modules():  # transformers: the outermost model's own plan, also wrapped
        hf_plan = getattr(module, "_tp_plan", None)
        if isinstance(hf_plan, dict) and hf_plan:
            names = {(f"{prefix}.{path}" if prefix else path): name for path, name in hf_plan.items()}
            return (f"{type(module).__name__}._tp_plan", names, {path: style(name) for path, name in names.items()})
    raise ValueError(
        f"TrainConfig.tensor_parallel_size>1: model {type(model).__name__} has no tensor-parallel plan (neither "
        f"transformer_lm nor a Hugging Face model with a _tp_plan). Add TrainConfig.tensor_parallel_plan, a mapping "
        f"from module path to style, e.g. {{'layers.*.attn.q': 'colwise', 'layers.*.attn.proj': 'rowwise'}} for "
        f"its linear layers (module paths: [name for name, _ in model.named_modules()]), or set "
        f"tensor_parallel_size=1.")


def _matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s path matching: atom by atom, ``*`` within one atom."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(p, a) for a, p in zip(atoms, parts))


def _split_sizes(module: nn.Module, name: Optional[str]) -> Dict[str, int]:
    """The sizes a style ``name`` splits on ``module``: ``{what: size}``."""
    if name in ("colwise", "colwise_gather_output") and isinstance(module, nn.Linear):
        return {"out_features": module.out_features}
    if name == "rowwise" and isinstance(module, nn.Linear):
        return {"in_features": module.in_features}
    if name == "embedding_rowwise" and isinstance(module, nn.Embedding):
        return {"num_embeddings": module.num_embeddings}
    return {}


def check_split(model: nn.Module, names: dict, size: int, source: str) -> None:
    """Every path of the plan names a module, and what it splits (features, and the heads of the attention it
    splits) divides by ``size``."""
    modules = dict(model.named_modules())
    split = []
    for path, name in names.items():
        matched = [n for n in modules if _matches(path, n)]
        if not matched:
            raise ValueError(f"{source}: path {path!r} names no module of {type(model).__name__}. Use paths of "
                             f"model.named_modules(), '*' for one level (e.g. 'layers.*.mlp.up').")
        split += matched
        for n in matched:
            for what, value in _split_sizes(modules[n], name).items():
                if value % size:
                    raise ValueError(f"{source}: {path} has {what}={value}, which tensor_parallel_size={size} does "
                                     f"not divide. Set tensor_parallel_size to a divisor of {value}.")
    for what, value in _split_heads(modules, split).items():
        if value % size:
            raise ValueError(f"{source}: {what}={value} heads do not split over tensor_parallel_size={size} (each "
                             f"rank computes whole heads). Set tensor_parallel_size to a divisor of {value}.")


def _split_heads(modules: dict, split: list) -> Dict[str, int]:
    """The head counts a plan splits: where a split module's path names attention (``attn``, ``self_attn``,
    ``attention``), the ``num_heads`` of the modules above it (this package's blocks) and a Hugging Face model's
    config's. A plan that leaves attention whole (an MLP-only plan) splits no heads."""
    heads = {}
    for name in split:
        atoms = name.split(".")
        if not any("attn" in atom.lower() or "attention" in atom.lower() for atom in atoms):
            continue
        for i in range(len(atoms)):
            owner = modules.get(".".join(atoms[:i]))
            if isinstance(getattr(owner, "num_heads", None), int):
                heads[f"{type(owner).__name__}.num_heads"] = owner.num_heads
        for module in modules.values():
            config = getattr(module, "config", None)
            heads.update({f"config.{k}": getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")
                          if isinstance(getattr(config, k, None), int)})
    return heads


def check_model_plan(cfg, input_shape: tuple, num_classes: int) -> None:
    """On the driver, before Ray: ``cfg``'s model (built on ``meta``) has a plan that splits evenly."""
    model = build_model_shapes(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    source, names, _ = model_plan(model, cfg.tensor_parallel_plan)
    check_split(model, names, cfg.tensor_parallel_size, source)
    if isinstance(model, TransformerLM) and not cfg.tensor_parallel_plan and input_shape[0] % cfg.tensor_parallel_size:
        raise ValueError(f"transformer_lm's plan: the sequence length {input_shape[0]} does not split over "
                         f"tensor_parallel_size={cfg.tensor_parallel_size} (sequence parallel: each rank holds a "
                         f"slice of the sequence between layers). Set input_shape to a multiple of it.")


def tensor_parallel_mesh(model: nn.Module, worker: "DataParallelSteps"):
    """Build the ``("data", "tensor")`` mesh (collective), refuse tensor groups that span nodes, apply the plan on
    ``tensor``; returns the mesh."""
    world, size = worker.ctx.world_size, worker.tensor_parallel_size
    nodes = [None] * world
    dist.all_gather_object(nodes, worker.ctx.node_rank)  # once, at set-up
    spanning = shard_groups_across_nodes(nodes, size)
    if spanning:  # every layer's collectives would cross the network: refused on every rank alike (or warned)
        message = (f"TrainConfig.tensor_parallel_size={size}: the tensor groups {spanning} span nodes "
                   f"{[sorted({nodes[r] for r in g}) for g in spanning]}, so every layer would communicate across "
                   f"the network. Give every node a multiple of {size} workers (e.g. placement='STRICT_PACK' on one "
                   f"node), or lower tensor_parallel_size.")
        if not worker.cfg.tensor_parallel_across_nodes:
            raise ValueError(message)
        if worker.ctx.world_rank == 0:
            logger.warning("%s (tensor_parallel_across_nodes=True: training anyway)", message)
    mesh = init_device_mesh(worker.device.type, (world // size, size), mesh_dim_names=("data", "tensor"))
    source, _, plan = model_plan(model, worker.cfg.tensor_parallel_plan)
    if worker.ctx.world_rank == 0:
        logger.info("tensor parallel: %d groups of %d workers, %s", world // size, size, source)
    parallelize_module(model, mesh["tensor"], plan)
    return mesh


class TensorParallelFSDP(FSDPReplication):
    """``fsdp`` with tensor parallel: the plan on ``tensor``, then FSDP2 shards over ``data``."""

    def _mesh(self, model: nn.Module, worker: "DataParallelSteps"):
        return tensor_parallel_mesh(model, worker)["data"]


class TensorParallelReplicate(FSDPReplication):
    """``ddp`` with tensor parallel: the plan on ``tensor``, then FSDP2's ``replicate`` over
    ``data`` (gradients
    all-reduced over the tensor groups, as DDP's are); state dicts and sharded checkpoints as ``fsdp``'s."""

    name = "replicate"

    def build_on_meta(self, ctx) -> bool:
        return False  # ddp's placement moves the built model to the device first; rank 0's weights still reach all

    def _shard(self, model: nn.Module, worker: "DataParallelSteps") -> nn.Module:
        return replicate(model, mesh=tensor_parallel_mesh(model, worker)["data"])


TENSOR_PARALLEL_REPLICATIONS = {"replicate": TensorParallelReplicate(), "fully_shard": TensorParallelFSDP()}
"""A strategy's replication step, by name, with ``tensor_parallel_size > 1``."""
