"""What a run optimises and measures: the loss and the metrics, by name or your own function.

``TrainConfig.loss`` is a name of :data:`LOSSES` or a ``"package.module:function"`` called
as ``loss(outputs, targets)`` that returns a scalar tensor, the MEAN over the batch: the
strategies weight it by the batch's share of the targets (``dp_balanced`` per device) and
the pipeline scales it per micro-batch, exactly as for the built-in ones.

``TrainConfig.metrics`` lists names of :data:`METRICS` or ``"module:function"`` entries called
as ``metric(outputs, targets)`` that return ``(sum, count)`` for the batch (tensors on the
outputs' device, or Python numbers). The epoch's value is the sum of every batch's sums
over the sum of its counts, over every rank and device, so it is exact whatever the
sharding (a mean of per-rank means is not, when ranks see different counts). A metric is
reported as ``train_<name>`` and ``test_<name>``; a factory's name is its function's.
Without ``metrics`` a classification dataset (``num_classes`` set) gets ``accuracy`` and a
regression one (``num_classes=None``) none.

Regression losses and metrics view the targets in the outputs' shape when both hold as
many values (a 1-unit head with one target per sample), in the outputs' dtype: torch's
``mse_loss`` would otherwise broadcast ``(N, 1)`` against ``(N,)`` to ``(N, N)``.

The built-in losses and metrics take a model zoo's outputs as they come: a tensor, or anything
holding ``logits`` (a Hugging Face ``ModelOutput`` or another object with a ``logits``
attribute, a dict, a named tuple), whose logits they use (:func:`logits_of`; a Hugging Face causal LM's
``(batch, seq, vocab)`` logits with the vocabulary moved to dim 1, so ``cross_entropy`` is the mean token loss
and ``accuracy`` the token accuracy, as for ``transformer_lm``'s ``(batch, vocab, seq)``). Your own loss and
metrics get the outputs untouched.

Factories load through ``_factory.load_factory`` and follow its rules (no standard-library
callables; a config file names one only with ``allow_code`` or a trusted module).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.nn import functional as F

from raytrain_mgpu.config.factories import code_name, function_name, is_factory, load_factory
from raytrain_mgpu.engine.batches import detach

__all__ = ["LOSSES", "METRICS", "Objective", "logits_of", "metric_name", "default_metrics", "Predictions", "move_pairs", "add_pairs"]

Pair = Tuple[object, object]  # (sum, count): tensors on the outputs' device, or Python numbers


def logits_of(outputs):
    """``outputs`` if a tensor, else its ``logits`` (a dict's key, or an attribute: ``ModelOutput``, a
    named tuple, a dataclass); a ValueError naming the type and the fix for anything else.

    Classes at dim 1, as torch's losses want them: a Hugging Face ``ModelOutput``'s per-position logits
    (a causal LM's ``(batch, seq, vocab)``) have them last, so they are moved there (a view, no copy)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.movedim(-1, 1) if logits.dim() > 2 and _is_model_output(outputs) else logits
    raise ValueError(f"the model returned a {type(outputs).__name__} with no 'logits' tensor, which the built-in "
                     f"losses and metrics cannot read. Return a tensor (or an object, dict or named tuple with "
                     f"'logits'), or set TrainConfig.loss and metrics to functions of your outputs "
                     f"('module:function').")


def _is_model_output(outputs) -> bool:
    """Whether ``outputs`` is a ``transformers`` ``ModelOutput`` (read from its classes: no import of transformers)."""
    return any(cls.__name__ == "ModelOutput" and cls.__module__.startswith("transformers")
               for cls in type(outputs).__mro__)


def _as_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``targets`` in the shape and dtype of ``outputs`` when they hold as many values."""
    if targets.shape != outputs.shape and targets.numel() == outputs.numel():
        targets = targets.reshape(outputs.shape)
    return targets.to(outputs.dtype)


def _regression(loss: Callable) -> Callable:
    def regression_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(outputs, _as_outputs(outputs, targets))

    regression_loss.__name__ = loss.__name__
    return regression_loss


LOSSES: Dict[str, Callable] = {
    "cross_entropy": F.cross_entropy,
    "mse": _regression(F.mse_loss),
    "l1": _regression(F.l1_loss),
    "bce_with_logits": _regression(F.binary_cross_entropy_with_logits),
    "smooth_l1": _regression(F.smooth_l1_loss),
}
"""Registry name -> ``loss(outputs, targets)``, each the mean over the batch (torch's default reduction)."""


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> Pair:
    """Correct argmax predictions (class dimension 1: ``(N, C)`` or an LM's ``(N, C, T)``) per target."""
    return (outputs.argmax(dim=1) == targets).sum(), targets.numel()


def _top5(outputs: torch.Tensor, targets: torch.Tensor) -> Pair:
    """Targets among the 5 highest outputs (all of them with fewer than 5 classes)."""
    top = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    return (top == targets.unsqueeze(1)).any(dim=1).sum(), targets.numel()


def _mae(outputs: torch.Tensor, targets: torch.Tensor) -> Pair:
    outputs = outputs.double()
    return (outputs - _as_outputs(outputs, targets)).abs().sum(), outputs.numel()


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> Pair:
    outputs = outputs.double()
    return (outputs - _as_outputs(outputs, targets)).pow(2).sum(), outputs.numel()


METRICS: Dict[str, Callable[..., Pair]] = {"accuracy": _accuracy, "top5": _top5, "mae": _mae, "mse": _mse}
"""Registry name -> ``metric(outputs, targets) -> (sum, count)``; counts are Python ints (known on the host)."""


def metric_name(spec) -> str:
    """The name a metric is reported under: the registry name, or a factory's function name."""
    return function_name(spec)


def default_metrics(metrics: Optional[Sequence[str]], num_classes: Optional[int]) -> Tuple[str, ...]:
    """``metrics`` as configured; unset: accuracy for a classification dataset, none for regression."""
    if metrics is not None:
        return tuple(metrics)
    return ("accuracy",) if num_classes is not None else ()


def _as_is(outputs):
    return outputs


def _reader(spec: str) -> Callable:
    """What a loss or metric named ``spec`` is handed of the outputs: a factory all of them, a built-in the logits."""
    return _as_is if is_factory(spec) else logits_of


def _load(spec: str, registry: dict, field: str) -> Callable:
    return load_factory(spec, field) if is_factory(spec) else registry[spec]


class Objective:
    """A run's loss and metrics, resolved once per process (factories are imported here).

    The default (no arguments) is what the trainer always did: cross-entropy and accuracy.
    """

    def __init__(self, loss: str = "cross_entropy", metrics: Sequence[str] = ("accuracy",)):
        self.loss_spec = loss
        self._loss = _load(loss, LOSSES, "loss")
        self.metric_specs = tuple(metrics)
        self.names: Tuple[str, ...] = tuple(metric_name(m) for m in self.metric_specs)
        self._metrics = [_load(m, METRICS, "metrics") for m in self.metric_specs]
        # A built-in reads a model zoo's logits (logits_of); a user's function gets the outputs as they are.
        self._loss_reads = _reader(loss)
        self._metric_reads = [_reader(m) for m in self.metric_specs]

    @classmethod
    def of(cls, cfg, num_classes: Optional[int]) -> "Objective":
        """``cfg``'s (a ``TrainConfig``) loss and metrics for a dataset with ``num_classes``."""
        return cls(cfg.loss, default_metrics(cfg.metrics, num_classes))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of the batch; a custom loss that returns no scalar tensor is named."""
        value = self._loss(self._loss_reads(outputs), targets)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"TrainConfig.loss={code_name(self.loss_spec)!r} returned {shape}, not a scalar tensor. Return "
                             f"the mean over the batch (e.g. .mean()).")
        return value

    def measure(self, outputs: torch.Tensor, targets: torch.Tensor) -> List[Pair]:
        """Every metric's ``(sum, count)`` for one batch, where ``outputs`` live (no host sync)."""
        outputs = detach(outputs)
        pairs = []
        for spec, metric, reads in zip(self.metric_specs, self._metrics, self._metric_reads):
            pair = metric(reads(outputs), targets)
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"TrainConfig.metrics entry {code_name(spec)!r} returned {type(pair).__name__}, not a "
                                 f"(sum, count) pair. Return e.g. ((outputs - targets).abs().sum(), targets.numel()).")
            pairs.append(pair)
        return pairs

    def __repr__(self) -> str:
        return f"Objective(loss={code_name(self.loss_spec)!r}, metrics={[code_name(m) for m in self.metric_specs]})"


class Predictions:
    """What the meter gets for a batch whose outputs stay on other devices (``dp_balanced``, model parallel).

    Every metric's ``(sum, count)`` is computed where the outputs live and only those scalars
    cross to the loss device (``pairs``), never the outputs. ``argmax(dim)`` (tests, debugging)
    moves the predicted indices on request; the meter never asks.
    """

    def __init__(self, pairs: Sequence[Pair], outputs: Sequence[torch.Tensor], device: torch.device):
        self.pairs = list(pairs)
        self._outputs = [detach(o) for o in outputs]
        self.device = device

    def detach(self) -> "Predictions":
        return self

    def argmax(self, dim: int = 1) -> torch.Tensor:
        return torch.cat([o.argmax(dim=dim).to(self.device) for o in self._outputs])


def move_pairs(pairs: Sequence[Pair], device: torch.device) -> List[Pair]:
    """``pairs`` with their tensors moved to ``device`` (device-to-device copies of scalars)."""
    return [tuple(v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for v in pair)
            for pair in pairs]


def add_pairs(parts: Sequence[Sequence[Pair]]) -> List[Pair]:
    """The element-wise sum of several batches' (or devices') pairs."""
    return [(sum(p[i][0] for p in parts), sum(p[i][1] for p in parts)) for i in range(len(parts[0]))] \
        if parts else []
