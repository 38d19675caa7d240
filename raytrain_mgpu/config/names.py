"""The shape of every config error (``TrainConfig.<field>=<value>: <rule>. <fix>``) and the number checks
that ``config_checks`` and ``config_code`` share."""

from __future__ import annotations

import difflib
import functools
import math
from typing import Any, Iterable

from raytrain_mgpu.errors import UnknownFieldError

__all__ = ["fail", "is_int", "is_number", "check_number", "did_you_mean", "SPELLED_OTHERWISE", "OTHER_FIELD_NAMES",
           "unknown_fields", "names_unknown_fields"]


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
    key = text.lower().replace("-", "_")
    close = difflib.get_close_matches(key, list(folded), n=1, cutoff=0.6)
    if not close and len(key) >= 3:  # an abbreviation of exactly one name: "acc" -> "accuracy"
        close = [v for v in folded if v.startswith(key)][:2]
        close = close if len(close) == 1 else []
    return f" Did you mean {folded[close[0]]!r}?" if close else ""


# Names other tools give a choice, which no spelling distance finds (Lightning's older precision flags, Apex's opt
# levels' words): named in the error, not accepted, so one setting has one spelling.
SPELLED_OTHERWISE = {"precision": {"16": "16-mixed", "fp16": "16-mixed", "half": "16-mixed", "16-true": "16-mixed",
                                    "bf16": "bf16-mixed", "bfloat16": "bf16-mixed", "bf16-true": "bf16-mixed",
                                    "fp32": "32", "32-true": "32", "float32": "32", "64": "32"}}

# What Lightning, Accelerate and torch call a field, which no spelling distance finds.
OTHER_FIELD_NAMES = {"learning_rate": "lr", "max_epochs": "epochs", "num_epochs": "epochs", "workers": "num_workers",
                "devices": "num_workers", "num_devices": "num_workers", "gpus": "use_gpu", "accelerator": "use_gpu",
                "accumulate_grad_batches": "grad_accum_steps", "gradient_accumulation_steps": "grad_accum_steps",
                "gradient_clip_val": "grad_clip_norm", "max_grad_norm": "grad_clip_norm", "mixed_precision": "precision",
                "default_root_dir": "storage_path", "output_dir": "storage_path", "ckpt_path": "init_from",
                "num_workers_per_loader": "loader_workers", "dataloader_num_workers": "loader_workers"}


def unknown_fields(unknown: list, valid: Iterable[str], source: str, what: str = "field"):
    """The error for names that are not ``TrainConfig`` fields (``valid``): each with the closest field, if one is."""
    valid = list(valid)
    named = "; ".join(f"{name!r}.{did_you_mean(name, valid, OTHER_FIELD_NAMES) or ' No field is close.'}"
                      for name in unknown)
    return UnknownFieldError(f"{source}: unknown {what}{'s' if len(unknown) > 1 else ''} {named} Every field, by "
                             f"section: `raytrain-mgpu train --help` (or TrainConfig.field_names()).")


def names_unknown_fields(cls):
    """Class decorator over a dataclass: its ``__init__`` names an unknown keyword with the closest field
    (:func:`unknown_fields`) where Python's own error only says "unexpected keyword argument"."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in cls.__dataclass_fields__]
        if unknown:
            raise unknown_fields(unknown, cls.__dataclass_fields__, f"{cls.__name__}()")
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
