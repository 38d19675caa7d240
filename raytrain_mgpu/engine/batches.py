"""Batches: inputs and targets that are tensors, or tuples, lists or dicts of tensors.

A dataset yields ``(inputs, targets)`` samples; the ``DataLoader``'s default collate turns
them into batches of the same structure. Every strategy and the pipeline handle a batch
through these functions, so a model that takes two inputs (``{"image": ..., "tabular":
...}``) or a loss that takes several targets trains like a plain one:

- the model is called as ``model(x)`` for a tensor, ``model(*x)`` for a tuple or list and
  ``model(**x)`` for a dict (:func:`call_model`), as ``nn.DataParallel`` scatters them;
- every tensor is moved to the device (:func:`to_device`) and split along dim 0, by the
  data-parallel strategies (torch's ``scatter``) and into the pipeline's micro-batches
  (:func:`split`); all tensors of a batch must have the batch's size in dim 0;
- a loss and every metric get the targets in their structure. A batch's weight (how many
  targets the mean loss is over, the ``samples`` of the history) is ``numel()`` for a
  tensor target (tokens for a language model) and the batch size for a structured one
  (:func:`target_count`).

Outputs may be structured too (a model that returns a dict): the loss and metrics receive
them as the model returned them. Between pipeline stages and model-parallel devices the
activations are one tensor: only the first block may take a structured input.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch.utils import _pytree as pytree

__all__ = ["to_device", "call_model", "first_tensor", "batch_size", "target_count", "split", "detach",
           "flatten", "unflatten"]


def _map(fn, obj: Any) -> Any:
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, obj)


def to_device(obj: Any, device: torch.device, channels_last: bool = False) -> Any:
    """``obj`` with every tensor on ``device`` (asynchronous copies from pinned memory).

    ``channels_last``: 4-d tensors (images) in channels-last memory format.
    """
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=True)
        return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t

    return move(obj) if isinstance(obj, torch.Tensor) else _map(move, obj)


def call_model(model, x: Any):
    """``model(x)``; a tuple or list is passed as positional arguments, a dict as keyword arguments."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def first_tensor(obj: Any) -> torch.Tensor:
    """The first tensor of ``obj`` (in ``flatten`` order); ValueError if it holds none."""
    if isinstance(obj, torch.Tensor):
        return obj
    for leaf in pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ValueError(f"a batch or model output of type {type(obj).__name__} holds no tensor: return tensors, "
                     f"or tuples, lists or dicts of tensors.")


def batch_size(obj: Any) -> int:
    """Rows of the batch: dim 0 of its first tensor."""
    return first_tensor(obj).shape[0]


def target_count(y: Any) -> int:
    """What a mean loss over the batch is over: ``numel()`` of a tensor target, the batch size otherwise."""
    return y.numel() if isinstance(y, torch.Tensor) else batch_size(y)


def split(obj: Any, chunks: int) -> List[Any]:
    """``obj`` cut into ``chunks`` micro-batches along dim 0 (``tensor_split``: sizes differ by at most 1)."""
    if isinstance(obj, torch.Tensor):
        return list(obj.tensor_split(chunks))
    leaves, spec = pytree.tree_flatten(obj)
    parts = [leaf.tensor_split(chunks) if isinstance(leaf, torch.Tensor) else [leaf] * chunks for leaf in leaves]
    return [pytree.tree_unflatten([part[i] for part in parts], spec) for i in range(chunks)]


def head(obj: Any, rows: int) -> Any:
    """The first ``rows`` rows of every tensor of a batch."""
    return obj[:rows] if isinstance(obj, torch.Tensor) else _map(lambda t: t[:rows], obj)


def detach(obj: Any) -> Any:
    return obj.detach() if isinstance(obj, torch.Tensor) else _map(lambda t: t.detach(), obj)


def flatten(obj: Any) -> tuple:
    """``(tensors, spec)``: the tensors of ``obj`` in a fixed order and what rebuilds it (:func:`unflatten`)."""
    leaves, spec = pytree.tree_flatten(obj)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"a batch holds a {type(leaf).__name__} where a tensor was expected: the dataset's "
                             f"samples must hold tensors (or tuples, lists or dicts of them).")
    return leaves, spec


def unflatten(tensors: List[torch.Tensor], spec) -> Any:
    return pytree.tree_unflatten(list(tensors), spec)


def as_shape(shape: Any) -> Any:
    """An input shape as a tuple of ints; for structured inputs a dict of them (one per key) or a tuple of them.

    Also reads the JSON form back (:func:`shape_record`, lists for tuples).
    """
    if isinstance(shape, dict):
        return {key: tuple(int(n) for n in value) for key, value in shape.items()}
    shape = tuple(shape)
    if shape and all(isinstance(part, (tuple, list)) for part in shape):
        return tuple(tuple(int(n) for n in part) for part in shape)
    return tuple(int(n) for n in shape)


def shape_record(shape: Any) -> Any:
    """``shape`` as JSON (``meta.json``, the history): lists for tuples."""
    shape = as_shape(shape)
    if isinstance(shape, dict):
        return {key: list(value) for key, value in shape.items()}
    return [list(part) for part in shape] if shape and isinstance(shape[0], tuple) else list(shape)


def move_batch(x, y, device: torch.device, channels_last: bool = False) -> tuple:
    """Inputs and targets (tensors, or tuples/dicts of them) on ``device``; 4-D inputs channels-last if asked."""
    return to_device(x, device, channels_last), to_device(y, device)
