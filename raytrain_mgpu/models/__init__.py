"""Models: plain ``nn.Module``s with no distributed code, built by registry name.

A user's own model is ``"package.module:function"``; the function is called with the
keyword arguments it accepts among ``input_shape``, ``num_classes`` and ``model_kwargs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict

from raytrain_mgpu._factory import call_with_accepted, is_factory, load_factory

if TYPE_CHECKING:  # the registry and TrainConfig's name check need no torch; each builder imports its model
    from torch import nn


def _lenet(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.lenet import LeNet

    return LeNet(in_channels=input_shape[0], num_classes=num_classes, input_size=input_shape[-1], **kwargs)


def _resnet18(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.resnet import ResNet18

    return ResNet18(in_channels=input_shape[0], num_classes=num_classes, **kwargs)


def _mlp(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.mlp import MLP

    return MLP(input_shape=input_shape, num_classes=num_classes, **kwargs)


def _transformer_lm(input_shape, num_classes, **kwargs) -> nn.Module:
    from raytrain_mgpu.models.transformer import TransformerLM

    return TransformerLM(seq_len=input_shape[0], vocab_size=num_classes, **kwargs)


MODELS: Dict[str, Callable[..., "nn.Module"]] = {
    "lenet": _lenet,
    "resnet18": _resnet18,
    "mlp": _mlp,
    "transformer_lm": _transformer_lm,
}


def model_names() -> list:
    return sorted(MODELS)


def check_model_name(name: str) -> None:
    if not is_factory(name) and name not in MODELS:
        raise ValueError(f"TrainConfig.model={name!r} is not a known model. Valid names: "
                         f"{', '.join(model_names())}; or 'package.module:function' for your own.")


def build_model(name: str, input_shape: tuple, num_classes: int, model_kwargs: dict) -> nn.Module:
    """Build a model on CPU. Callers seed torch first so every worker gets the same weights."""
    check_model_name(name)
    if is_factory(name):
        factory = load_factory(name, "model")
        return call_with_accepted(factory, input_shape=tuple(input_shape), num_classes=num_classes, **model_kwargs)
    try:
        return MODELS[name](tuple(input_shape), num_classes, **model_kwargs)
    except TypeError as exc:
        raise ValueError(f"TrainConfig.model_kwargs={model_kwargs!r} do not fit model {name!r}: {exc}. "
                         f"Remove or rename the offending keys.") from None
