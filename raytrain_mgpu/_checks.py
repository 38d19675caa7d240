"""The shape of every config error (``TrainConfig.<field>=<value>: <rule>. <fix>``) and the number checks
that ``config_checks`` and ``config_code`` share."""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

__all__ = ["fail", "is_int", "is_number", "check_number", "did_you_mean"]


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


def did_you_mean(name: Any, valid: Iterable[str], hints: Any = None) -> str:
    """``" Did you mean 'batch_size'?"`` for the valid name closest to ``name`` (difflib's ratio, case and
    ``-``/``_`` ignored), or ``""`` when none is close. ``hints``: ``{wrong: right}`` for names no spelling
    distance finds (``"fp16"`` -> ``"16-mixed"``)."""
    if not isinstance(name, (str, int, float)) or isinstance(name, bool):
        return ""
    text = str(name)
    if hints and text in hints:
        return f" Did you mean {hints[text]!r}?"
    valid = [str(v) for v in valid]
    folded = {v.lower().replace("-", "_"): v for v in valid}
    close = difflib.get_close_matches(text.lower().replace("-", "_"), list(folded), n=1, cutoff=0.6)
    return f" Did you mean {folded[close[0]]!r}?" if close else ""
