"""LoRA adapters with ``peft``: ``TrainConfig.lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"],
"dropout": 0.0}``.

Applied on every worker right after the model is built and before the strategy wraps it:
``peft.get_peft_model(model, peft.LoraConfig(r=..., lora_alpha=..., target_modules=..., lora_dropout=...))``
freezes the base weights and adds trainable low-rank ``lora_A``/``lora_B`` matrices beside the target modules
(``lora_B`` starts at zero, so the model starts as the base). ``lora_A`` is drawn from the run's seed right after the
build, so every rank that builds the model draws the same; ``fsdp``'s ranks that build on ``meta`` get rank 0's.

A run with ``lora`` saves ``save="trainable"`` checkpoints: the adapters (and the optimizer state of the trainable
parameters) only; a resume rebuilds the base from its folder and loads the adapters over it. The checks here run
with the config (no torch, no peft imported); :func:`check_targets` on the model built on ``meta``, before Ray.
"""

from __future__ import annotations

import importlib.util
from typing import List

from raytrain_mgpu.config.names import fail, is_int, is_number
from raytrain_mgpu.models.huggingface import is_hf

__all__ = ["LORA_KEYS", "check_lora", "lora_config", "apply_lora", "check_targets", "linear_names"]

LORA_KEYS = {"r": "the rank of the adapters (default 8)",
             "alpha": "the scale's numerator: the update is scaled by alpha / r (default 8)",
             "target_modules": "the modules that get adapters: names (a module whose name is one, or ends in "
                               "'.<name>'), or 'all-linear' (default: peft's for the model's type)",
             "dropout": "dropout on the adapters' input, in [0, 1) (default 0.0)"}
_EXAMPLE = '{"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}'


def check_lora(cfg) -> None:
    """``cfg.lora``: None, or a mapping of :data:`LORA_KEYS` with valid values, on an ``hf:`` model, with peft
    installed. Sets ``cfg.save = "trainable"``: the checkpoints hold the adapters."""
    lora = cfg.lora
    if lora is None:
        return
    if not isinstance(lora, dict) or not all(isinstance(k, str) for k in lora):
        fail("lora", lora, "must be a mapping of LoRA settings", f"Write e.g. lora={_EXAMPLE}, or leave it unset.")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        fail("lora", lora, f"has unknown keys {unknown}",
             "Use " + "; ".join(f"{key!r}: {what}" for key, what in LORA_KEYS.items()) + ".")
    if "r" in lora and (not is_int(lora["r"]) or lora["r"] < 1):
        fail("lora", lora, f"r={lora['r']!r} must be a positive integer", "Set r to e.g. 8 (the adapters' rank).")
    if "alpha" in lora and (not is_number(lora["alpha"]) or lora["alpha"] <= 0):
        fail("lora", lora, f"alpha={lora['alpha']!r} must be a positive number",
             "Set alpha to e.g. 16 (twice r is common; the update is scaled by alpha / r).")
    if "dropout" in lora and (not is_number(lora["dropout"]) or not 0 <= lora["dropout"] < 1):
        fail("lora", lora, f"dropout={lora['dropout']!r} must be a number in [0, 1)", "Set dropout to e.g. 0.05, or 0.")
    targets = lora.get("target_modules")
    if targets is not None and targets != "all-linear" and not (
            isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t.strip() for t in targets)):
        fail("lora", lora, f"target_modules={targets!r} must be a list of module names or 'all-linear'",
             'Write e.g. "target_modules": ["q_proj", "v_proj"].')
    if not is_hf(cfg.model):
        fail("lora", lora, f"adapts a Hugging Face model, and model={cfg.model!r} is not one",
             "Set model='hf:<folder>' (config.json and weights), or leave lora unset.")
    if importlib.util.find_spec("peft") is None:
        fail("lora", lora, "needs peft, which is not installed", "pip install raytrain-mgpu[lm]")
    cfg.save = "trainable"


def lora_config(lora: dict):
    """``peft.LoraConfig`` of the ``lora`` mapping (peft's defaults for the keys it leaves out)."""
    import peft  # late: optional dependency

    given = {"r": "r", "alpha": "lora_alpha", "target_modules": "target_modules", "dropout": "lora_dropout"}
    values = {given[key]: (list(value) if isinstance(value, tuple) else value) for key, value in lora.items()}
    return peft.LoraConfig(**values)


def apply_lora(model, lora: dict):
    """``model`` with adapters (a ``peft.PeftModel``), on the device it is built on (``meta`` included)."""
    import peft  # late: optional dependency

    return peft.get_peft_model(model, lora_config(lora))


def linear_names(model) -> List[str]:
    """The last part of the name of every ``nn.Linear`` in ``model``, sorted (what ``target_modules`` lists)."""
    from torch import nn  # late: loads torch; the config checks import this module

    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and isinstance(module, nn.Linear)})


def check_targets(model, lora: dict, source: str):
    """Every entry of ``target_modules`` names a module of ``model`` (built on ``meta``) as peft matches it; then the
    adapters applied (on ``meta``): peft's own refusals raise here, on the driver. The adapted model."""
    targets = lora.get("target_modules")
    if isinstance(targets, (list, tuple)):
        names = [name for name, _ in model.named_modules() if name]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            fail("lora", lora, f"target_modules {missing} match no module of {source}",
                 f"Name its linear layers, e.g. of {linear_names(model)}, or 'all-linear'.")
    try:
        return apply_lora(model, lora)
    except (ValueError, TypeError) as exc:
        fail("lora", lora, f"peft cannot adapt {source}: {exc}",
             f"Name modules peft supports (nn.Linear, nn.Embedding, Conv layers), e.g. of {linear_names(model)}.")
