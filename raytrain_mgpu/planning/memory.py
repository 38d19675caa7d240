"""Per-device memory estimates for each strategy, and the largest batch a budget allows.

The estimate is what a device must hold at the peak of a step, as a straight line in the
global batch ``b``:

    bytes(device) = fixed + per_sample * b

``fixed`` is the device's share of the model state: parameters, gradients and optimizer
state (AdamW keeps two tensors per parameter, SGD with momentum one). ``per_sample`` is
the activation memory autograd keeps for the backward, measured once with
``torch.autograd.graph.saved_tensors_hooks`` over a forward (and the loss) of a small
batch, per block of the model, times the share of the batch a device sees. The forward
runs on the ``meta`` device when the model allows it: shapes only, no memory and no
time, so a model larger than the driver's memory is still estimated.

With ``activation_checkpointing`` a checkpointed block keeps only its input (counted in its place),
and the largest of a device's checkpointed blocks is recomputed whole in the backward (counted once,
on top): ``ModelProfile.activations``.

It is an upper bound of the steady state in fp32 (gradients and the saved activations
are counted as if alive together; in the backward, activations are freed as gradients
appear) and leaves out the framework's own memory (the CUDA context, about 0.5 GiB, and
allocator fragmentation): keep a margin, or let ``compare`` find the batch by trying.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from raytrain_mgpu.data import check_data
from raytrain_mgpu.engine.objectives import logits_of
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.checkpointing import checkpointed_indices
from raytrain_mgpu.models.partition import blocks_of
from raytrain_mgpu.strategies import STRATEGIES, Strategy, get_strategy
from raytrain_mgpu.strategies._memory import DeviceMemory
from raytrain_mgpu.strategies.plan import build_plan

logger = logging.getLogger(__name__)

__all__ = ["ModelProfile", "DeviceMemory", "profile_model", "profile_config", "device_memory",
           "batch_granularity", "largest_batch", "max_batch_within_budget", "format_bytes"]

def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}" if unit != "MiB" else f"{n / size:,.0f} {unit}"
    return f"{n:,.0f} B"


# ----------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class ModelProfile:
    """What the estimates need from a model, measured once on the driver."""

    block_param_bytes: Tuple[int, ...]
    """Parameter bytes of each block (the whole model is one block if it cannot be split)."""
    block_activation_bytes: Tuple[float, ...]
    """Bytes autograd saves per sample in each block's forward."""
    output_bytes: float
    """Per sample: the logits and what the loss saves (log-probabilities, targets)."""
    input_bytes: float
    """Per sample: the input batch as it arrives on the first device."""
    optimizer_state_factor: float
    """Optimizer state bytes per parameter byte: 2 for AdamW, 1 for SGD with momentum, else 0."""
    splittable: bool
    """Whether the model splits into blocks (``mp``, ``pipeline``); otherwise one block."""
    block_recompute_bytes: Tuple[float, ...] = ()
    """Per sample, for each block ``activation_checkpointing`` recomputes: what its forward saves when it
    runs again in the backward (0 for the others; empty without checkpointing)."""
    param_bytes: int = field(init=False)
    """The whole model's parameter bytes (every block's)."""
    activation_bytes: float = field(init=False)
    """Bytes autograd saves per sample in the whole forward."""

    def __post_init__(self):
        object.__setattr__(self, "param_bytes", sum(self.block_param_bytes))  # frozen: set once, here
        object.__setattr__(self, "activation_bytes", sum(self.block_activation_bytes))

    def activations(self, blocks: Optional[Sequence[int]] = None) -> float:
        """Per sample, the activation bytes ``blocks`` (default: all) hold at the peak of a backward: what
        each saves, plus the largest checkpointed block's recomputed forward (one at a time)."""
        blocks = range(len(self.block_activation_bytes)) if blocks is None else blocks
        recomputed = [self.block_recompute_bytes[i] for i in blocks] if self.block_recompute_bytes else []
        return sum(self.block_activation_bytes[i] for i in blocks) + max(recomputed, default=0.0)

    def state_bytes(self, blocks: Optional[Sequence[int]] = None) -> float:
        """Parameters + gradients + optimizer state of ``blocks`` (default: all)."""
        params = self.param_bytes if blocks is None else sum(self.block_param_bytes[i] for i in blocks)
        return params * (2 + self.optimizer_state_factor)


def _optimizer_state_factor(optimizer: str, momentum: float) -> float:
    if optimizer == "adamw":
        return 2.0  # exp_avg and exp_avg_sq
    return 1.0 if momentum else 0.0  # the momentum buffer


def _targets_for(out: torch.Tensor) -> torch.Tensor:
    # (B, C) logits -> (B,) targets; (B, V, T) logits (language models) -> (B, T)
    return torch.zeros((out.shape[0], *out.shape[2:]), dtype=torch.long, device=out.device)


def _saved_bytes(blocks: Sequence[nn.Module], x: torch.Tensor, params: set) -> Tuple[List[int], int, int]:
    """Bytes saved for backward per block, by the loss, the logits' bytes and each block's input bytes, for
    batch ``x``.

    Each storage is counted once, by the first block that saves it (a ReLU's output saved
    again by the next Linear is one tensor), and parameters (and views of them) not at all.
    """
    seen, per_block, current = set(), [0] * (len(blocks) + 1), [0]
    inputs = []  # each block's input bytes (what a checkpointed block keeps); the batch itself is input_bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in seen and id(base) not in params and base is not x:
            seen.add(id(base))
            per_block[current[0]] += base.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for index, block in enumerate(blocks):
            current[0] = index
            inputs.append(0 if h is x else h.untyped_storage().nbytes())
            h = block(h)
        current[0] = len(blocks)
        h = logits_of(h)  # a model zoo's output (a Hugging Face ModelOutput): its logits, classes at dim 1
        # Cross-entropy whatever TrainConfig.loss is: this estimates memory, and what a loss saves
        # for backward is small next to the blocks' activations (a user loss is not imported here).
        loss = F.cross_entropy(h, _targets_for(h))
    del loss  # the graph (and the saved tensors the ids refer to) lived until here
    return per_block[:-1], per_block[-1], h.untyped_storage().nbytes(), inputs


def _forward_bytes(blocks: Sequence[nn.Module], input_shape: tuple, batch: int, device: str) -> tuple:
    """``(saved per block, saved by the loss, logits, input batch, input per block)`` in bytes, for ``batch``."""
    params = {id(p) for block in blocks for p in block.parameters()}
    errors = []
    for dtype in (torch.float32, torch.long):  # images, then token ids
        x = torch.zeros((batch, *input_shape), dtype=dtype, device=device)
        try:
            per_block, loss, logits, inputs = _saved_bytes(blocks, x, params)
            return per_block, loss, logits, x.untyped_storage().nbytes(), inputs
        except (RuntimeError, TypeError, IndexError) as exc:
            errors.append(exc)
    raise errors[0]


def profile_model(model: nn.Module, input_shape: tuple, optimizer: str = "adamw", momentum: float = 0.9,
                  batches: Tuple[int, int] = (2, 4), checkpoint_every: int = 0) -> ModelProfile:
    """Measure ``model`` (on the device its parameters are on: ``meta`` or CPU).

    Two batch sizes separate what grows with the batch from what does not (the scalar
    loss, position indices); only the growing part is kept, per sample. ``checkpoint_every``:
    ``activation_checkpointing``'s interval (the model measured as built, the blocks it names
    counted as checkpointed).
    """
    try:
        blocks, splittable = blocks_of(model), True
    except ValueError:
        blocks, splittable = [model], False
    device = next(model.parameters(), torch.empty(0)).device.type
    model.train()
    if isinstance(input_shape, dict) or any(isinstance(n, (tuple, list)) for n in input_shape):
        raise ValueError(f"the memory estimate feeds the model one input tensor, but the dataset's inputs are "
                         f"structured (input_shape={input_shape}). Choose strategy and layout yourself (not "
                         f"strategy='auto'), or measure with `raytrain-mgpu compare`.")
    small, large = (_forward_bytes(blocks, tuple(input_shape), b, device) for b in batches)
    span = batches[1] - batches[0]
    per_sample = [max(0.0, (l - s) / span) for s, l in zip(small[0], large[0])]
    recompute = ()
    if checkpoint_every and splittable:
        recompute = [0.0] * len(blocks)
        for i in checkpointed_indices(len(blocks), checkpoint_every):
            recompute[i], per_sample[i] = per_sample[i], max(0.0, (large[4][i] - small[4][i]) / span)
        recompute = tuple(recompute)
    return ModelProfile(
        block_param_bytes=tuple(sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks),
        block_activation_bytes=tuple(per_sample),
        block_recompute_bytes=recompute,
        output_bytes=max(0.0, (large[1] - small[1]) / span) + (large[2] - small[2]) / span,
        input_bytes=(large[3] - small[3]) / span,
        optimizer_state_factor=_optimizer_state_factor(optimizer, momentum),
        splittable=splittable)


def profile_config(cfg) -> ModelProfile:
    """The profile of ``cfg``'s model and data shapes, built on ``meta`` (CPU if that fails)."""
    input_shape, num_classes = check_data(cfg.data)
    for device in ("meta", "cpu"):
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = build_model(cfg.model, input_shape, num_classes, cfg.model_kwargs)
        try:
            return profile_model(model, input_shape, cfg.optimizer, cfg.momentum,
                                 checkpoint_every=cfg.activation_checkpointing)
        except (RuntimeError, NotImplementedError) as exc:
            if device == "cpu":
                raise
            logger.debug("profiling on meta failed (%s); profiling on CPU", exc)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- per strategy


def device_memory(strategy: str, cfg, profile: ModelProfile) -> List[DeviceMemory]:
    """The estimate for every device the run of ``cfg`` with ``strategy`` uses (the strategy class's model).

    Each strategy builds it from the pieces in :mod:`raytrain_mgpu.strategies._memory`; a
    registered strategy without a memory model raises ``ValueError``.
    """
    def has_model(cls) -> bool:  # overrides the default, which has none
        return cls.device_memory.__func__ is not Strategy.device_memory.__func__

    if isinstance(cfg.num_workers, tuple):  # an elastic range: the per-device memory differs by count (fsdp)
        raise ValueError(f"TrainConfig.num_workers={cfg.num_workers}: the memory estimate is for one worker count. "
                         f"Estimate with num_workers={cfg.num_workers[0]} (the fewest, the most per device).")
    cls = get_strategy(strategy)
    if not has_model(cls):
        names = [name for name, other in STRATEGIES.items() if has_model(other)]
        listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
        raise ValueError(f"no memory model for strategy {strategy!r}; estimates exist for {listed or 'none'}.")
    return cls.device_memory(cfg, profile)


def batch_granularity(strategy: str, cfg) -> int:
    """The global batch must be a multiple of this (replicas x micro-batches or accumulation steps).

    ``strategy`` is ``cfg.strategy`` (kept for the callers' symmetry with :func:`device_memory`).
    """
    return build_plan(cfg).batch_granularity


# ----------------------------------------------------------------------------- batch search


def largest_batch(fits: Callable[[int], bool], granularity: int, limit: Optional[int] = None,
                  start: Optional[int] = None, resolution: float = 0.0) -> int:
    """The largest multiple of ``granularity`` (at most ``limit``) for which ``fits`` holds; 0 if none.

    ``fits`` must be monotone (a batch that fits means every smaller one does). Doubling
    from ``start`` (default: ``granularity``) brackets the boundary, then bisection: about
    2 log2(answer / start) calls, which matters when each call is a trial run on a GPU:
    ``resolution`` (e.g. 1/8) stops the bisection once the bracket is that close, relative
    to the answer, and returns the lower end.
    """
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    top = (limit if limit is not None else 2**40) // granularity  # in units of granularity
    if top < 1:
        return 0
    k = min(max(1, (start or granularity) // granularity), top)
    if fits(k * granularity):
        lo, hi = k, None
        while hi is None:
            if lo == top:
                return lo * granularity
            nxt = min(2 * lo, top)
            if fits(nxt * granularity):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, k
        while hi > 1:
            nxt = hi // 2
            if fits(nxt * granularity):
                lo = nxt
                break
            hi = nxt
        if lo == 0:
            return 0
    while hi - lo > max(1, int(lo * resolution)):
        mid = (lo + hi) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid
    return lo * granularity


def max_batch_within_budget(strategy: str, cfg, profile: ModelProfile, budget_bytes: int,
                            limit: Optional[int] = None) -> int:
    """Largest global batch whose busiest device stays within ``budget_bytes`` (estimate).

    Raises ``ValueError`` naming the budget and the smallest need when not even the
    smallest batch (one sample per micro-batch) fits.
    """
    devices = device_memory(strategy, cfg, profile)
    granularity = batch_granularity(strategy, cfg)

    def need(batch: int) -> int:
        return max(d.at(batch) for d in devices)

    best = largest_batch(lambda b: need(b) <= budget_bytes, granularity, limit)
    if best == 0:
        smallest = need(granularity)
        state = max(d.fixed for d in devices)
        raise ValueError(
            f"memory_budget_bytes={budget_bytes} ({format_bytes(budget_bytes)} per device) is too small for "
            f"strategy={strategy!r} at its smallest global batch {granularity}: the busiest device needs "
            f"{smallest} bytes ({format_bytes(smallest)}; model state {format_bytes(state)}). Raise the budget "
            f"to at least {format_bytes(smallest)}, or use a strategy that splits the model (fsdp, pipeline).")
    return best
