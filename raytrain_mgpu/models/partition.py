"""Splitting a model into contiguous groups of blocks, one group per stage or device.

Used by the pipeline (one group per stage) and by model parallelism (one per device).
A model can be split if it is a sequence of blocks whose composition is its forward:

- an ``nn.Sequential`` (its children are the blocks), or
- a model with a ``blocks()`` method returning its blocks in call order.

Every parameter must sit in exactly one block: a parameter outside the blocks would be
lost by the split, and a tied one (shared by two blocks) would be updated twice.

Balancing: contiguous groups minimising the largest group's cost, where the cost of a
block is its parameter count (``balance="params"``), its measured forward+backward time
on a sample micro-batch (``balance="time"``), or an explicit list of block counts.
Stage checkpoints keep the *unsplit* model's parameter names (:class:`StageModule`), so a
split checkpoint loads into the whole model and back.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from raytrain_mgpu.engine.batches import call_model, detach, to_device

logger = logging.getLogger(__name__)

__all__ = ["blocks_of", "block_names", "param_costs", "profile_costs", "balanced_split", "Partition",
           "plan_partition", "StageModule", "build_stage_modules"]


def blocks_of(model: nn.Module) -> List[nn.Module]:
    """The blocks of ``model`` in call order; ``ValueError`` saying why it cannot be split."""
    name = type(model).__name__
    if callable(getattr(model, "blocks", None)):
        blocks = list(model.blocks())
        source = f"{name}.blocks()"
    elif isinstance(model, nn.Sequential):
        blocks = list(model.children())
        source = f"the children of nn.Sequential {name}"
    else:
        raise ValueError(
            f"model {name} cannot be split into stages: it is not an nn.Sequential and has no blocks() "
            f"method, so there is no order of blocks whose composition is its forward. Build it as an "
            f"nn.Sequential of blocks, or add blocks() returning its submodules in call order.")
    if not blocks:
        raise ValueError(f"model {name} cannot be split into stages: {source} is empty. "
                         f"Give it at least one block per stage.")
    owner = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            if id(param) in owner and owner[id(param)] != index:
                raise ValueError(
                    f"model {name} cannot be split into stages: blocks {owner[id(param)]} and {index} share "
                    f"a parameter (tied weights, e.g. input and output embeddings), which two stages would "
                    f"update separately. Untie the weights (give each block its own copy).")
            owner[id(param)] = index
    outside = [n for n, p in model.named_parameters() if id(p) not in owner]
    if outside:
        raise ValueError(
            f"model {name} cannot be split into stages: parameters {outside[:4]} belong to no block of "
            f"{source}, so no stage would hold them. Move them into a block (e.g. wrap them in a module "
            f"that is one of the blocks).")
    return blocks


def block_names(model: nn.Module, blocks: Sequence[nn.Module]) -> List[str]:
    """Qualified name of each block inside ``model`` (the prefix of its state-dict keys)."""
    names = {id(module): qualified for qualified, module in model.named_modules() if qualified}
    missing = [i for i, b in enumerate(blocks) if id(b) not in names]
    if missing:
        raise ValueError(f"blocks {missing} of {type(model).__name__} are not submodules of the model, so their "
                         f"weights have no name in its state dict. Return registered submodules from blocks().")
    return [names[id(b)] for b in blocks]


# ----------------------------------------------------------------------------- costs


def param_costs(blocks: Sequence[nn.Module]) -> List[float]:
    """Parameter count of each block (works on the ``meta`` device: no memory needed)."""
    return [float(sum(p.numel() for p in block.parameters())) for block in blocks]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # timing must wait for the queued kernels


def profile_costs(blocks: Sequence[nn.Module], sample, device: torch.device,
                  repeats: int = 3) -> List[float]:
    """Forward+backward seconds of each block on ``sample`` (one micro-batch; a tuple or dict batch too).

    Blocks run one at a time, each moved to ``device`` and back, so a model that does not
    fit on one device can still be profiled. The minimum over ``repeats`` runs (after one
    warm-up) is kept: other processes only ever add time.
    """
    x = to_device(sample, device)
    costs = []
    for index, block in enumerate(blocks):
        was_on = next(block.parameters(), torch.empty(0)).device
        block.to(device)
        best = math.inf
        for run in range(repeats + 1):
            inputs = detach(x)
            if isinstance(inputs, torch.Tensor):
                inputs.requires_grad_(inputs.is_floating_point())
            start = time.perf_counter()
            out = call_model(block, inputs) if index == 0 else block(inputs)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            _sync(device)
            if run:
                best = min(best, time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
        block.to(was_on)
        costs.append(best)
        x = out.detach()
    return costs


# ----------------------------------------------------------------------------- split


def balanced_split(costs: Sequence[float], num_parts: int) -> List[int]:
    """Block counts of the contiguous split of ``costs`` into ``num_parts`` non-empty parts
    with the smallest maximum part cost (dynamic programme, O(parts x blocks^2))."""
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot split {n} blocks into {num_parts} non-empty parts")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: smallest max cost splitting the first i blocks into k parts; cut[k][i]: start of the last part
    best = [[math.inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    counts, end = [], n
    for k in range(num_parts, 0, -1):
        start = cut[k][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


class Partition(NamedTuple):
    """The chosen split and what each part costs."""

    counts: Tuple[int, ...]        # blocks per part, in order
    costs: Tuple[float, ...]       # per part, in the unit of ``balance``
    params: Tuple[int, ...]        # parameters per part
    balance: str                   # "params", "time" or "explicit"

    def bounds(self) -> List[Tuple[int, int]]:
        """``(first block, end block)`` of each part."""
        bounds, start = [], 0
        for count in self.counts:
            bounds.append((start, start + count))
            start += count
        return bounds

    def describe(self) -> str:
        total_cost, total_params = sum(self.costs) or 1.0, sum(self.params) or 1
        what = {"time": "time", "params": "parameters"}.get(self.balance)
        lines = []
        for i, ((start, end), cost, params) in enumerate(zip(self.bounds(), self.costs, self.params)):
            share = f"{100 * cost / total_cost:.1f}% of {what}, " if what and what != "parameters" else ""
            count = end - start
            blocks = f"block {start} (1 block" if count == 1 else f"blocks {start}-{end - 1} ({count} blocks"
            lines.append(f"stage {i}: {blocks}, {share}"
                         f"{100 * params / total_params:.1f}% of parameters)")
        return "; ".join(lines)


def plan_partition(blocks: Sequence[nn.Module], num_parts: int, balance: Union[str, Sequence[int]],
                   time_costs: Optional[Callable[[], List[float]]] = None, what: str = "num_stages",
                   log: bool = True) -> Partition:
    """Choose the split. ``time_costs`` is called only for ``balance="time"``."""
    n = len(blocks)
    if num_parts > n:
        raise ValueError(
            f"TrainConfig.{what}={num_parts} is more than the {n} blocks the model can be split into: every "
            f"part needs at least one block. Set {what} to at most {n}, or use a model with more blocks "
            f"(e.g. more layers).")
    params = param_costs(blocks)
    if isinstance(balance, str) and balance == "params":
        counts, costs = balanced_split(params, num_parts), params
    elif isinstance(balance, str) and balance == "time":
        if time_costs is None:
            raise ValueError("balance='time' needs a profiling function (time_costs)")
        costs = time_costs()
        counts = balanced_split(costs, num_parts)
    elif isinstance(balance, str):
        raise ValueError(f"TrainConfig.balance={balance!r} must be 'params', 'time' or a list of block counts. "
                         f"Use balance='params'.")
    else:
        counts, costs = [int(c) for c in balance], params
        if len(counts) != num_parts or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"TrainConfig.balance={list(counts)} must list {num_parts} positive block counts (one per "
                f"part) summing to the model's {n} blocks; it has {len(counts)} entries summing to "
                f"{sum(counts)}. E.g. balance={balanced_split(params, num_parts)}.")
    kind = balance if isinstance(balance, str) else "explicit"
    partition = Partition(tuple(counts), _sum_parts(costs, counts), tuple(int(p) for p in _sum_parts(params, counts)),
                          kind)
    if log:
        logger.info("partition %s (balance=%s): %s", list(partition.counts), kind, partition.describe())
    return partition


def _sum_parts(values: Sequence[float], counts: Sequence[int]) -> Tuple[float, ...]:
    sums, start = [], 0
    for count in counts:
        sums.append(float(sum(values[start:start + count])))
        start += count
    return tuple(sums)


# ----------------------------------------------------------------------------- stage modules


class StageModule(nn.Sequential):
    """A contiguous run of blocks, with state-dict keys in the unsplit model's namespace."""

    def __init__(self, blocks: Sequence[nn.Module], names: Sequence[str]):
        super().__init__(*blocks)
        self.block_names = list(names)

    def forward(self, x):
        """The blocks in order; the first takes a tuple or dict batch as the whole model does (``call_model``)."""
        for index, block in enumerate(self):
            x = call_model(block, x) if index == 0 else block(x)
        return x

    def model_state_dict(self) -> dict:
        """This stage's weights under the unsplit model's keys (e.g. ``"3.qkv.weight"``)."""
        state = {}
        for index, block in enumerate(self):
            for key, value in block.state_dict().items():
                state[f"{self.block_names[index]}.{key}"] = value
        return state


def build_stage_modules(model: nn.Module, partition: Partition) -> List[StageModule]:
    """One :class:`StageModule` per part, sharing the blocks (and weights) of ``model``."""
    blocks = blocks_of(model)
    names = block_names(model, blocks)
    return [StageModule(blocks[start:end], names[start:end]) for start, end in partition.bounds()]
