"""FLOPs of a training step, the device's dense peak, and model FLOPs utilisation (MFU).

MFU is the FLOPs a step's arithmetic needs over the time it took, divided by what the devices
could do at their peak: ``flops_per_step * steps / seconds / (peak * devices)``. The numerator
counts the model's FLOPs, not the hardware's (recomputation under activation checkpointing,
padding and the optimizer are not counted), as in PaLM's definition (Chowdhery et al. 2022,
appendix B) and Lightning's ``ThroughputMonitor``.

- :func:`step_flops`: forward and backward of one micro-batch, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` on a copy of the model on the ``meta`` device
  (shapes only, no arithmetic, no device memory); the model, its gradients, buffers and the
  random streams are left as they were.
- :func:`peak_flops_per_s`: the vendor's dense (no 2:4 sparsity) peak for the precision, from
  :data:`PEAKS`, by the device's name; None for a CPU or a GPU not in the table.
- :func:`mfu`: the ratio; None where the peak is unknown.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from raytrain_mgpu.engine.batches import call_model
from raytrain_mgpu.engine import devices

__all__ = ["step_flops", "peak_flops_per_s", "mfu", "Peak", "PEAKS", "PRECISIONS"]

logger = logging.getLogger(__name__)

PRECISIONS = ("32", "16-mixed", "bf16-mixed")


# ----------------------------------------------------------------------------- FLOPs of a step


def step_flops(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> int:
    """FLOPs of one training step's forward and backward on one micro-batch (``inputs``, ``targets``).

    ``loss_fn(outputs, targets)`` returns the scalar loss; ``inputs`` and ``targets`` are tensors or
    tuples, lists or dicts of them (a dict ``inputs`` is passed as keyword arguments,
    ``raytrain_mgpu.engine.batches.call_model``). The count is ``FlopCounterMode``'s: matrix products,
    convolutions and attention (2 FLOPs a multiply-add), in the model's current train/eval mode.
    The backward counts what autograd computes, so the first layer's input gradient, which nothing
    needs, is not in it: a ``Linear(a, b)`` first layer costs ``4 * batch * a * b``, a later one
    ``6 * batch * a * b``. Pass the micro-batch one device computes; a step of ``k`` micro-batches on
    ``n`` replicas is ``k * n`` times it.

    Counted on a ``meta`` copy of the model: no arithmetic, no device memory, a few tens of ms for a
    ResNet-18; the copy shares nothing with ``model``. A model that cannot run on ``meta`` (one that
    reads a tensor's value in ``forward``, e.g. ``.item()``) is counted on its own device instead:
    one forward and backward of the micro-batch, with one more set of gradients and a copy of the
    buffers in memory meanwhile; the parameters' ``.grad``, the buffers (BatchNorm's running
    statistics) and the CPU and CUDA random streams are restored afterwards.

    ``DataParallel``, ``DistributedDataParallel`` and ``torch.compile`` wrappers are unwrapped (the
    count runs no collective and compiles nothing). A sharded model (DTensor parameters, FSDP2's
    ``fully_shard``) raises ``ValueError``: count the model before it is sharded; so does the device
    count of a model with ``SyncBatchNorm`` in a process group (its forward would all-reduce on one rank).
    """
    model = _unwrapped(model)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError("step_flops: the model's parameters are DTensors (sharded, e.g. by fully_shard): counting "
                         "would run its collectives on this rank alone. Count the model before it is sharded, or a "
                         "copy of it built on the meta device.")
    try:
        return _count_on_meta(model, inputs, targets, loss_fn)
    except Exception as exc:  # meta cannot run every forward; an error of the model's own recurs on its device
        logger.info("step_flops: %s does not run on the meta device (%s: %s); counting one forward and backward "
                    "on its own device", type(model).__name__, type(exc).__name__, str(exc).splitlines()[0][:200])
    return _count_on_device(model, inputs, targets, loss_fn)


def _unwrapped(model: nn.Module) -> nn.Module:
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _count(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> int:
    with FlopCounterMode(display=False) as counter:
        loss = loss_fn(call_model(model, inputs), targets)
        loss.backward()
    return int(counter.get_total_flops())


def _on_meta(obj: Any) -> Any:
    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)

    return pytree.tree_map(lambda v: meta(v) if isinstance(v, torch.Tensor) else v, obj)


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with every parameter and buffer replaced by an empty one on ``meta``
    (the memo maps each tensor to its stand-in, so tied weights stay tied and no data is copied)."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _count_on_meta(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> int:
    with torch.random.fork_rng(devices=[]):  # a meta op that draws numbers draws none on a device
        return _count(meta_copy(model), _on_meta(inputs), _on_meta(targets), loss_fn)


def _count_on_device(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable) -> int:
    if (model.training and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
            and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        raise ValueError("step_flops: the model does not run on the meta device, and on its own device its "
                         "SyncBatchNorm layers would all-reduce on this rank alone (the others wait forever). "
                         "Count the model before convert_sync_batchnorm, or in eval mode.")
    params = list(model.parameters())
    buffers = list(model.buffers())
    grads = [p.grad for p in params]
    saved = [b.detach().clone() for b in buffers]  # BatchNorm's running statistics and batch count
    cuda = sorted({t.device.index or 0 for t in (*params, *buffers) if t.is_cuda})
    try:
        for p in params:
            p.grad = None  # the backward writes new tensors; the user's are put back untouched
        with torch.random.fork_rng(devices=cuda):
            return _count(model, inputs, targets, loss_fn)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)


# ----------------------------------------------------------------------------- the devices' peaks


class Peak(NamedTuple):
    """A GPU's dense peaks in FLOP/s (no 2:4 sparsity): plain FP32 (CUDA cores), TF32, and BF16 and
    FP16 on the tensor cores with FP32 accumulation (what autocast's matrix products use). None: the
    GPU has no such unit (TF32 before Ampere: ``allow_tf32`` changes nothing there; BF16 before
    Ampere: autocast emulates it)."""

    fp32: float
    tf32: Optional[float]
    bf16: Optional[float]
    fp16: float


_T = 1e12


def _sparse(tf32: float, half: float, fp32: float) -> Peak:
    """A datasheet that prints tensor figures with sparsity (marked *): the dense ones are half."""
    return Peak(fp32 * _T, tf32 / 2 * _T, half / 2 * _T, half / 2 * _T)


# Name pattern (case-insensitive, searched in ``torch.cuda.get_device_name``) -> peaks, first match wins:
# a variant before its family (``H100 NVL`` before ``H100``). Sources: NVIDIA's datasheets.
PEAKS: Tuple[Tuple[str, Peak], ...] = (
    # Blackwell, HGX B200 and GB200 NVL72 datasheet, per GPU (tensor figures with sparsity).
    (r"\bGB200\b", _sparse(tf32=2500, half=5000, fp32=80)),
    (r"\bB200\b", _sparse(tf32=2200, half=4500, fp32=75)),
    # Hopper: H100 and H200 datasheets (SXM; NVL; H100 PCIe), GH200 datasheet (its GPU is an H100 SXM's).
    (r"\bH100\b.*\bNVL\b", _sparse(tf32=835, half=1671, fp32=60)),
    (r"\bH100\b.*(PCIe|HBM2e)", _sparse(tf32=756, half=1513, fp32=51)),
    (r"\bH100\b", _sparse(tf32=989, half=1979, fp32=67)),  # "NVIDIA H100 80GB HBM3": SXM5
    (r"\bH200\b.*\bNVL\b", _sparse(tf32=835, half=1671, fp32=60)),
    (r"\bH200\b", _sparse(tf32=989, half=1979, fp32=67)),
    (r"\bGH200\b", _sparse(tf32=989, half=1979, fp32=67)),
    (r"\bH20\b", Peak(44 * _T, 74 * _T, 148 * _T, 148 * _T)),  # H20 datasheet: dense figures
    # Ampere: A100 datasheet (SXM4 and PCIe, 40 and 80 GB: the same peaks), A10 datasheet. The A10G (AWS G5)
    # has no NVIDIA datasheet: AWS's figures (as Baseten's "A10 vs A10G" tabulates them), dense.
    (r"\bA100\b", Peak(19.5 * _T, 156 * _T, 312 * _T, 312 * _T)),
    (r"\bA10G\b", Peak(35 * _T, 35 * _T, 70 * _T, 70 * _T)),
    (r"\bA10\b", Peak(31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T)),
    # Ada: L4 and L40S datasheets; GeForce RTX 4090: Ada whitepaper (FP16/BF16 with FP32 accumulate).
    (r"\bL40S\b", Peak(91.6 * _T, 183 * _T, 362.05 * _T, 362.05 * _T)),
    (r"\bL4\b", _sparse(tf32=120, half=242, fp32=30.3)),
    (r"RTX 4090\b", Peak(82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T)),
    # GeForce RTX 3090 (not Ti): Ampere GA102 whitepaper (FP16/BF16 with FP32 accumulate).
    (r"RTX 3090\b(?! Ti)", Peak(35.6 * _T, 35.6 * _T, 71 * _T, 71 * _T)),
    # Volta: V100 datasheet (SXM2, PCIe, V100S PCIe); Turing: T4 datasheet. No TF32, no BF16 units.
    (r"\bV100S\b", Peak(16.4 * _T, None, None, 130 * _T)),
    (r"\bV100\b.*PCIe", Peak(14 * _T, None, None, 112 * _T)),
    (r"\bV100\b", Peak(15.7 * _T, None, None, 125 * _T)),
    (r"\bT4\b", Peak(8.1 * _T, None, None, 65 * _T)),
)


def peak_for_name(name: str) -> Optional[Peak]:
    """The first :data:`PEAKS` entry whose pattern ``name`` matches; None for a GPU not in the table."""
    for pattern, peak in PEAKS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return peak
    return None


def tf32_matmuls() -> bool:
    """Whether FP32 matrix products run on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``, or
    ``torch.set_float32_matmul_precision`` other than ``"highest"``); off by default in torch."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def peak_flops_per_s(device: torch.device, precision: str) -> Optional[float]:
    """The dense peak FLOP/s of ``device`` for ``precision`` (``"32"``, ``"16-mixed"``, ``"bf16-mixed"``).

    ``"bf16-mixed"``/``"16-mixed"``: the BF16/FP16 tensor-core peak. ``"32"``: the TF32 tensor-core peak
    when FP32 matrix products use TF32 (:func:`tf32_matmuls`), else the plain FP32 peak. cuDNN runs
    FP32 convolutions on TF32 by default (``torch.backends.cudnn.allow_tf32``), so a convolutional
    network's FP32 MFU against the FP32 peak can exceed what the CUDA cores alone could do.

    None: a CPU (GPU emulation, ``RAYTRAIN_MGPU_EMULATE_GPUS``, computes on the CPU), a GPU not in
    :data:`PEAKS`, or a precision the GPU has no unit for (BF16 on a V100 or T4).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"peak_flops_per_s: precision={precision!r} is not one of {', '.join(PRECISIONS)} "
                         f"(TrainConfig.precision's choices). Pass the run's precision.")
    device = torch.device(device)
    if device.type != "cuda" or devices.is_emulated() or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_for_name(name)
    if peak is None:
        logger.info("peak_flops_per_s: %r is not in raytrain_mgpu.engine.flops.PEAKS: no MFU", name)
        return None
    if precision == "bf16-mixed":
        return peak.bf16
    if precision == "16-mixed":
        return peak.fp16
    return peak.tf32 if tf32_matmuls() and peak.tf32 is not None else peak.fp32


# ----------------------------------------------------------------------------- utilisation


def mfu(flops_per_step: float, steps: int, seconds: float, peak_per_device: Optional[float],
        num_devices: int) -> Optional[float]:
    """Model FLOPs utilisation: ``flops_per_step * steps / seconds / (peak_per_device * num_devices)``.

    ``flops_per_step``: every device's work in one optimizer step together (:func:`step_flops` of a
    micro-batch times the micro-batches a step times the data-parallel replicas); ``seconds``: the
    time the ``steps`` took; ``num_devices``: the devices that did the work. None when the peak is
    unknown (:func:`peak_flops_per_s`) or no time passed.
    """
    if peak_per_device is None or seconds <= 0 or num_devices < 1:
        return None
    return flops_per_step * steps / seconds / (peak_per_device * num_devices)
