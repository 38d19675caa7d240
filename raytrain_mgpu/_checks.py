"""The shape of every config error (``TrainConfig.<field>=<value>: <rule>. <fix>``) and the number checks
that ``config_checks`` and ``config_code`` share."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["fail", "is_int", "is_number", "check_number"]


def fail(name: str, value: Any, rule: str, fix: str) -> None:
    """Raise the error every config check raises: the field, its value, the rule and the fix."""
    raise ValueError(f"TrainConfig.{name}={value!r}: {rule}. {fix}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(cfg, name: str, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = True, fix: str = "") -> None:
    """A finite int or float (not a bool or string) in the range; the range is in the error."""
    value = getattr(cfg, name)
    upper = "inf)" if high == math.inf else f"{high:g}{')' if high_open else ']'}"
    rule = f"must be a finite number in {'(' if low_open else '['}{low:g}, {upper}"
    if high == math.inf and low == 0:
        rule = "must be a finite positive number" if low_open else "must be a finite number >= 0"
    if not is_number(value):
        fail(name, value, rule, fix)
    if value < low or (low_open and value == low) or value > high or (high_open and value == high):
        fail(name, value, rule, fix)
