"""DataParallel's four steps (scatter, replicate, parallel_apply, gather) for CUDA and CPU devices.

On CUDA devices these are torch's own ``torch.nn.parallel`` functions. On CPU "devices"
(GPU emulation, ``RAYTRAIN_MGPU_EMULATE_GPUS``, and the unit tests) torch has no
implementation (its scatter and parallel_apply need an accelerator), so CPU stand-ins run
the same code path. They exist for emulation and tests only; on a real GPU they never run:

- ``scatter``: the same split as torch's (``chunk`` along ``dim``: a batch of 10 on 3
  devices gives 4, 4, 2; a batch smaller than the device count gives fewer slices);
  non-tensors are repeated, tuples, lists and dicts are split element by element.
- ``replicate``: replica 0 is the module itself; the others share its ``Parameter``
  objects, so every replica's gradient accumulates in the same ``.grad``, which equals
  torch's replicate followed by the reduction of the replicas' gradients. Buffers are
  cloned for replicas 1.., so in-place buffer updates (BatchNorm's running statistics)
  land only on the module itself, as torch documents for device 0's replica.
- ``parallel_apply``: one thread per replica with the caller's grad mode and autocast
  state (dtype included), as torch does; an exception names the replica. The threads run
  one after the other: CPU replicas would only compete for the same cores, and they share
  the CPU random generator, so concurrent dropout would make runs irreproducible.
- ``gather``: concatenation on the output device.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import parallel as torch_parallel

from raytrain_mgpu.engine.precision import capture, entered

__all__ = ["scatter", "scatter_kwargs", "replicate", "parallel_apply", "gather", "on_cuda"]


def on_cuda(devices: Sequence[torch.device]) -> bool:
    return torch.device(devices[0]).type == "cuda"


def scatter(obj: Any, devices: Sequence[torch.device], dim: int = 0) -> list:
    """``obj`` split into at most ``len(devices)`` slices, one per device."""
    if on_cuda(devices):
        return torch_parallel.scatter(obj, list(devices), dim)
    return _cpu_scatter(obj, len(devices), dim)


def _cpu_scatter(obj: Any, parts: int, dim: int) -> list:
    # Mirrors torch.nn.parallel.scatter_gather.scatter_map: zip cuts every structure to its
    # shortest member, so a batch smaller than ``parts`` gives fewer slices.
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(parts, dim))
    if isinstance(obj, tuple) and len(obj) > 0:
        return list(zip(*(_cpu_scatter(o, parts, dim) for o in obj)))
    if isinstance(obj, list) and len(obj) > 0:
        return [list(s) for s in zip(*(_cpu_scatter(o, parts, dim) for o in obj))]
    if isinstance(obj, dict) and len(obj) > 0:
        return [type(obj)(s) for s in zip(*(_cpu_scatter(item, parts, dim) for item in obj.items()))]
    return [obj] * parts


def scatter_kwargs(inputs: tuple, kwargs: Optional[dict], devices: Sequence[torch.device],
                   dim: int = 0) -> Tuple[tuple, tuple]:
    """Positional and keyword inputs per device, padded to the same count (torch's rule)."""
    if on_cuda(devices):
        return torch_parallel.scatter_gather.scatter_kwargs(inputs, kwargs, list(devices), dim)
    scattered = _cpu_scatter(inputs, len(devices), dim) if inputs else []
    scattered_kwargs = _cpu_scatter(kwargs, len(devices), dim) if kwargs else []
    if len(scattered) < len(scattered_kwargs):
        scattered.extend(() for _ in range(len(scattered_kwargs) - len(scattered)))
    elif len(scattered_kwargs) < len(scattered):
        scattered_kwargs.extend({} for _ in range(len(scattered) - len(scattered_kwargs)))
    return tuple(scattered), tuple(scattered_kwargs)


def replicate(module: nn.Module, devices: Sequence[torch.device], detach: bool = False) -> List[nn.Module]:
    """One replica of ``module`` per device (see the module docstring for the CPU stand-in)."""
    if on_cuda(devices):
        return torch_parallel.replicate(module, list(devices), detach=detach)
    if not devices:
        return []
    return [module] + [_cpu_replica(module, {}) for _ in devices[1:]]


def _cpu_replica(module: nn.Module, memo: Dict[nn.Module, nn.Module]) -> nn.Module:
    if module in memo:  # a submodule used twice stays shared within the replica
        return memo[module]
    replica = module._replicate_for_data_parallel()  # the shallow copy torch's replicate starts from
    memo[module] = replica
    replica._parameters = dict(module._parameters)  # the same Parameters: one .grad for all replicas
    # One clone of every buffer per extra replica and step (BatchNorm: 2 x channels floats).
    replica._buffers = {k: None if b is None else b.clone() for k, b in module._buffers.items()}
    replica._modules = {k: None if c is None else _cpu_replica(c, memo) for k, c in module._modules.items()}
    return replica


def parallel_apply(modules: Sequence, inputs: Sequence, kwargs_tup: Optional[Sequence[dict]] = None,
                   devices: Optional[Sequence[torch.device]] = None) -> list:
    """``modules[i](*inputs[i], **kwargs_tup[i])`` for every i, each in its own thread."""
    if devices is not None and len(devices) and on_cuda(devices):
        return torch_parallel.parallel_apply(modules, inputs, kwargs_tup, list(devices))
    kwargs_tup = kwargs_tup if kwargs_tup is not None else ({},) * len(modules)
    grad_enabled = torch.is_grad_enabled()
    autocast = capture("cpu")
    results: Dict[int, Any] = {}

    def worker(i: int) -> None:
        # Grad mode and autocast are thread-local: a new thread starts with the defaults.
        torch.set_grad_enabled(grad_enabled)
        args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
        try:
            with entered(autocast):
                results[i] = modules[i](*args, **kwargs_tup[i])
        except Exception as exc:  # re-raised in the caller, naming the replica
            results[i] = exc

    for i in range(len(modules)):  # one after the other (see the module docstring)
        thread = threading.Thread(target=worker, args=(i,), name=f"dp-replica-{i}")
        thread.start()
        thread.join()
    for i in range(len(modules)):
        if isinstance(results[i], Exception):
            raise RuntimeError(f"DataParallel replica {i} (CPU stand-in device) failed: "
                               f"{type(results[i]).__name__}: {results[i]}") from results[i]
    return [results[i] for i in range(len(modules))]


def gather(outputs: Sequence, target_device: torch.device, dim: int = 0) -> Any:
    """The replicas' outputs joined on ``target_device`` (tensors concatenated along ``dim``)."""
    if torch.device(target_device).type == "cuda":
        return torch_parallel.gather(outputs, target_device, dim)
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        # 0-dim outputs (a replica's scalar loss) become one entry per replica, as in torch
        parts = [o.unsqueeze(0) if o.dim() == 0 else o for o in outputs]
        return torch.cat([p.to(target_device) for p in parts], 0 if first.dim() == 0 else dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], target_device, dim)) for k in first)
    if isinstance(first, (list, tuple)):
        joined = [gather(parts, target_device, dim) for parts in zip(*outputs)]
        return type(first)(joined) if isinstance(first, list) else tuple(joined)
    raise TypeError(f"DataParallel cannot gather outputs of type {type(first).__name__}: return tensors, "
                    f"or tuples/lists/dicts of tensors, from forward().")
