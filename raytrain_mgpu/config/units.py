"""Sizes written for people (``memory_budget_bytes="24GiB"``) parsed into bytes. Standard library only."""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes"]

# Sizes like memory_budget_bytes="24GiB": parsed here, below the config, so a bad size costs no torch import.
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text, what: str = "memory budget") -> int:
    """``"24GiB"``, ``"512 MiB"``, ``"8e9"`` or a number -> bytes; ``what`` names the value in errors."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text):  # int(inf) raises OverflowError, not the error below
            raise ValueError(f"{what}={text!r} is not a size. Write e.g. 24GiB, 512MiB or 8e9 (bytes).")
        return int(text)
    found = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not found or found.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}={text!r} is not a size. Write e.g. 24GiB, 512MiB or 8e9 (bytes).")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])
