"""Activation checkpointing per block (``TrainConfig.activation_checkpointing``): every k-th block of a
model forgets what its forward saved for backward and computes it again in the backward pass.

A checkpointed block keeps only its input (``torch.utils.checkpoint``, non-reentrant, the random state
of its forward kept: dropout draws the same masks again), so the gradients are exactly those without
it; the cost is one more forward of the block per step. Which blocks: ``blocks_of`` (an
``nn.Sequential``'s children or a ``blocks()`` method: the same blocks the pipeline and ``mp`` split),
the ``k``-th, ``2k``-th, ... (``k=1``: every block; torchtitan's per-layer interval).

How: the block's class is swapped for a subclass whose ``forward`` runs the original under
``checkpoint``. The module, its parameter names and its ``state_dict`` stay what they were (a
wrapper module, as ``torch.distributed``'s ``checkpoint_wrapper``, would insert a level into every
parameter name, which every name-reading path here would have to strip), and ``nn.DataParallel``'s
replicas, FSDP2's per-block hooks and the pipeline's stages see the same blocks as without it.
Both runners call :func:`checkpoint_blocks` on the model right after building it.

The same blocks are what ``compile="blocks"`` compiles in place (:func:`compile_blocks`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain_mgpu.models.partition import blocks_of

__all__ = ["checkpoint_blocks", "checkpointed_indices", "compile_blocks", "compiled"]

_SUBCLASSES: Dict[type, type] = {}


def checkpointed_indices(num_blocks: int, every: int) -> List[int]:
    """0-based indices of the blocks checkpointed at an interval of ``every`` (0: none)."""
    return [i for i in range(num_blocks) if every and (i + 1) % every == 0]


def _checkpointed(cls: type) -> type:
    """``cls`` with its forward run under ``torch.utils.checkpoint`` (one subclass per class)."""
    if cls not in _SUBCLASSES:
        def forward(self, *args, **kwargs):
            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _SUBCLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
    return _SUBCLASSES[cls]


def checkpoint_blocks(model: nn.Module, every: int) -> int:
    """Checkpoint every ``every``-th block of ``model`` in place (0: none); how many blocks were."""
    if not every:
        return 0
    try:
        blocks = blocks_of(model)
    except ValueError as exc:
        raise ValueError(f"TrainConfig.activation_checkpointing={every} checkpoints blocks, and {exc}") from None
    chosen = checkpointed_indices(len(blocks), every)
    for index in chosen:
        block = blocks[index]
        if type(block) not in _SUBCLASSES.values():  # checkpointed once, even if asked twice
            block.__class__ = _checkpointed(type(block))
    return len(chosen)


BLOCKS_COMPILE_FROM = "2.14"
"""The oldest torch whose ``nn.Module.compile`` compiles the module's call: on 2.10-2.13, checked by running a
compiled block, dynamo skips ``nn.Module._call_impl`` (a torch file) and the block runs eagerly, with no error."""


def compile_blocks(model: nn.Module, dry_run: bool = False) -> int:
    """``torch.compile`` each block of ``model`` in place (``nn.Module.compile``: the module, its class and its
    parameter names stay); how many blocks. ``dry_run``: only check that the model has blocks.

    Per block rather than the whole model, as torchtitan compiles each transformer block: the all-reduces
    DDP starts from gradient hooks and FSDP2's per-block all-gathers stay outside the compiled graphs (no
    graph break inside one), and blocks of one class and shapes share one compiled graph.
    """
    try:
        blocks = blocks_of(model)
    except ValueError as exc:
        raise ValueError(f"TrainConfig.compile='blocks' compiles each block, and {exc} Or set compile=True "
                         f"(the whole model).") from None
    if torch.torch_version.TorchVersion(torch.__version__) < BLOCKS_COMPILE_FROM:
        raise ValueError(f"TrainConfig.compile='blocks' compiles each block with nn.Module.compile, which compiles "
                         f"nothing on torch {torch.__version__} (dynamo skips nn.Module's own call before torch "
                         f"{BLOCKS_COMPILE_FROM}: the blocks would run eagerly). Upgrade torch to "
                         f">={BLOCKS_COMPILE_FROM}, or set compile=True (the whole model).")
    if not dry_run:
        # Every block's compiled call is the one code object nn.Module._call_impl, whose compiled versions dynamo
        # caches together: 8 by default, after which it runs the rest eagerly (measured: a 6-block nn.Sequential
        # needs 12, one a block in training and in evaluation). Room for both modes and a second shape a block.
        config = torch._dynamo.config  # imported with torch
        config.recompile_limit = max(config.recompile_limit, 4 * len(blocks))
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * len(blocks))
        for block in blocks:
            block.compile()
    return len(blocks)


def compiled(model: nn.Module, how, blocks_of_model: Optional[nn.Module] = None) -> nn.Module:
    """``model`` as ``TrainConfig.compile`` asks: ``True``, wrapped in ``torch.compile``; ``"blocks"``, the blocks of
    ``blocks_of_model`` (default ``model``: the plain model inside a DDP or FSDP wrapper) compiled in place."""
    if how == "blocks":
        compile_blocks(model if blocks_of_model is None else blocks_of_model)
        return model
    if how:
        return torch.compile(model)
    return model
