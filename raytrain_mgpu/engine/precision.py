"""Mixed precision on one rank, one object for every step runner: ``TrainConfig.precision``'s autocast table,
fp16's grad scaler, the forwards' autocast context (the data-parallel step runner's and the pipeline executor's
alike), and its hand-over to the threads that DataParallel-style replicas run in (autocast is thread-local).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional, Tuple

import torch

__all__ = ["AUTOCAST", "Precision", "capture", "entered"]

AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
"""``TrainConfig.precision`` -> the autocast dtype (``32``: no autocast at all)."""


class Precision:
    """``precision`` (``TrainConfig.precision``) on a rank whose compute device is of ``device_type`` (``cpu``
    under GPU emulation: fp16's scaler runs there too)."""

    def __init__(self, precision: str, device_type: str):
        self.name, self.device_type = precision, device_type
        self.dtype: Optional[torch.dtype] = AUTOCAST.get(precision)

    def autocast(self) -> ContextManager:
        """The context of a forward (and its loss): autocast to :attr:`dtype`; at fp32 no context at all (entering a
        disabled autocast costs ~3.5 us a micro-batch on CPU)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> "torch.amp.GradScaler":
        """fp16's loss scaling (``16-mixed``); a disabled scaler otherwise, whose calls pass through."""
        return torch.amp.GradScaler(self.device_type, enabled=self.name == "16-mixed")


def capture(device_type: str) -> Tuple[str, torch.dtype, bool]:
    """The calling thread's autocast setting for ``device_type``, to hand to another thread."""
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


def entered(state: Tuple[str, torch.dtype, bool]) -> ContextManager:
    """In another thread: the autocast setting :func:`capture` took (a new thread starts without autocast)."""
    device_type, dtype, enabled = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)
