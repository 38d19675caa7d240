"""Models: plain ``nn.Module``s with no distributed code, built by registry name.

A user's own model is ``"package.module:function"`` (or a class), or from Python the class or function itself. Of ``input_shape``,
``num_classes`` and ``model_kwargs`` it receives the keyword arguments it names; a
``**kwargs`` catch-all gets ``model_kwargs`` and ``num_classes`` but never ``input_shape``,
because model-zoo builders hand their ``**kwargs`` to the model class, which raises on a
name it does not know (torchvision: ``resnet18(num_classes=10)`` works,
``resnet18(input_shape=...)`` does not).

A Hugging Face model is ``"hf:<folder, URI or hub id>"`` (``models/huggingface.py``); LoRA adapters on it are
``TrainConfig.lora`` (``models/lora.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Dict

from raytrain_mgpu.config.names import did_you_mean
from raytrain_mgpu.config.factories import (HF_MODEL_PREFIX, code_name, function_name, is_factory, keyword_parameters,
                                    load_factory)
from raytrain_mgpu.models.huggingface import build as build_hf
from raytrain_mgpu.models.huggingface import check_name, is_hf

if TYPE_CHECKING:  # the registry and TrainConfig's name check need no torch; each builder imports its model
    from torch import nn

logger = logging.getLogger(__name__)


def _lenet(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.lenet import LeNet  # late: loads torch; the name check needs none

    return LeNet(in_channels=input_shape[0], num_classes=num_classes, input_size=input_shape[-1], **kwargs)


def _resnet18(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.resnet import ResNet18  # late: loads torch

    return ResNet18(in_channels=input_shape[0], num_classes=num_classes, **kwargs)


def _mlp(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.mlp import MLP  # late: loads torch

    return MLP(input_shape=input_shape, num_classes=num_classes, **kwargs)


def _transformer_lm(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.transformer import TransformerLM  # late: loads torch

    return TransformerLM(seq_len=input_shape[0], vocab_size=num_classes, **kwargs)


MODELS: Dict[str, Callable[..., "nn.Module"]] = {
    "lenet": _lenet,
    "resnet18": _resnet18,
    "mlp": _mlp,
    "transformer_lm": _transformer_lm,
}


def model_names() -> list:
    return sorted(MODELS)


def check_model_name(name) -> None:
    if is_hf(name):  # a Hugging Face folder, URI or hub id: its files are checked before Ray (check_source)
        return check_name(name)
    if not is_factory(name) and name not in MODELS:
        raise ValueError(f"TrainConfig.model={name!r} is not a known model.{did_you_mean(name, MODELS)} Valid names: "
                         f"{', '.join(model_names())}; 'hf:<folder>' for a Hugging Face model; or "
                         f"'package.module:function' for your own.")


def build_model(name, input_shape: tuple, num_classes: int, model_kwargs: dict, pretrained: bool = False) -> nn.Module:
    """Build a model on CPU (or the caller's device context, e.g. ``meta``).

    Callers seed torch first so every worker gets the same weights. ``pretrained``: an ``hf:`` model's weights
    from its folder (the workers, ``load_model``, ``export``); without it an ``hf:`` model is built from its
    ``config.json`` alone, so the driver's checks never read a weight (``models/huggingface.py``).
    """
    check_model_name(name)
    if isinstance(name, str) and name.startswith(HF_MODEL_PREFIX):
        return build_hf(name, model_kwargs, pretrained=pretrained, num_classes=num_classes)
    if is_factory(name):
        return _build_from_factory(name, input_shape, num_classes, model_kwargs)
    try:
        return MODELS[name](tuple(input_shape), num_classes, **model_kwargs)
    except TypeError as exc:
        raise ValueError(f"TrainConfig.model_kwargs={model_kwargs!r} do not fit model {name!r}: {exc}. "
                         f"Remove or rename the offending keys.") from None


def build_model_shapes(name, input_shape: tuple, num_classes, model_kwargs: dict) -> nn.Module:
    """The model for its structure and shapes only (the driver's checks and plans): built on the ``meta``
    device, no memory, or on CPU where the builder reads values while building (timm:
    ``torch.linspace(...).item()``; a user's ``int(torch.tensor(shape).prod())``), which a meta tensor cannot
    give. A broken factory raises its own error from the CPU build. The caller's random stream is kept."""
    import torch  # late: loads torch; the name check needs none

    try:
        with torch.device("meta"):
            return build_model(name, input_shape, num_classes, model_kwargs)
    except ValueError as meta_error:
        with torch.random.fork_rng(devices=[]):
            model = build_model(name, input_shape, num_classes, model_kwargs)
        logger.info("model %r does not build on the meta device (%s); it builds on CPU", code_name(name), meta_error)
        return model


def factory_arguments(factory: Callable, spec: str, input_shape: tuple, num_classes, model_kwargs: dict) -> dict:
    """The keyword arguments model factory ``spec`` is called with (see the module's docstring)."""
    from raytrain_mgpu.engine.batches import as_shape  # late: loads torch; the name check needs none

    from_data = {"input_shape": as_shape(input_shape), "num_classes": num_classes}
    given = sorted(k for k in model_kwargs if k == "input_shape" or (k == "num_classes" and num_classes is not None))
    if given:
        raise ValueError(f"TrainConfig.model_kwargs={model_kwargs!r} sets {given}, which the dataset gives "
                         f"{spec} ({', '.join(f'{k}={from_data[k]!r}' for k in given)}). Remove them from "
                         f"model_kwargs (a synthetic dataset takes input_shape and num_classes itself).")
    named, catch_all = keyword_parameters(factory)
    arguments = {k: v for k, v in from_data.items() if k in named}
    if catch_all and "num_classes" not in arguments and num_classes is not None:
        arguments["num_classes"] = num_classes
    unknown = [] if catch_all else sorted(set(model_kwargs) - named)
    if unknown:
        raise ValueError(f"TrainConfig.model_kwargs={model_kwargs!r}: {spec} takes no argument {unknown} "
                         f"(it takes {sorted(named)}). Remove or rename them.")
    return {**arguments, **model_kwargs}


def _build_from_factory(factory_spec, input_shape: tuple, num_classes, model_kwargs: dict) -> nn.Module:
    from torch import nn  # late: loads torch; the name check needs none

    factory, spec = load_factory(factory_spec, "model"), code_name(factory_spec)
    arguments = factory_arguments(factory, spec, input_shape, num_classes, model_kwargs)
    call = f"{function_name(factory_spec)}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
    try:
        model = factory(**arguments)
    except Exception as exc:  # the user's code: name it and what it was given
        raise ValueError(
            f"TrainConfig.model={spec!r} failed: {call} raised {type(exc).__name__}: {exc}. Fix the factory or "
            f"TrainConfig.model_kwargs. A factory gets, of input_shape, num_classes and model_kwargs, the "
            f"keyword arguments it names; a **kwargs catch-all gets model_kwargs and num_classes.") from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"TrainConfig.model={spec!r}: {call} returned a {type(model).__name__}, not a "
                         f"torch.nn.Module. Return the model itself.")
    return model
