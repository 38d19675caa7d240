"""The ``TrainConfig`` fields that name code, checked without importing it (part of
``config_checks.check_fields``): ``model``, ``dataset``, ``optimizer``, ``lr_schedule``, ``loss``, ``metrics`` and
``callbacks`` take a registry name, a ``package.module:function`` (its form here, the standard-library
rule in ``config/factories.py``), or from Python the class or function itself. Two exceptions import it: a user's
scheduler (``lr_schedule``), a loss and metric functions, whose signatures are checked, and a metric asked which way
is better."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from typing import Any, Dict, Literal

from raytrain_mgpu.config.names import check_number, did_you_mean, fail, is_int
from raytrain_mgpu.config.factories import (check_factory_spec, code_name, function_name, is_factory, is_object,
                                           load_factory)
from raytrain_mgpu.config.sections import Metric  # objectives.METRICS' names, without torch
from raytrain_mgpu.data.ray_datasets import is_ray_datasets

__all__ = ["FACTORY_RE", "factory_choices", "is_code", "check_code_choices", "check_lr_schedule", "check_metrics",
           "check_model_and_dataset", "check_callbacks", "check_signature", "check_objective_signatures"]

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HOOKS = ("on_train_start", "on_step", "on_epoch_end", "on_checkpoint", "on_train_end")  # driver/callbacks.py


def factory_choices(cls) -> Dict[str, tuple]:
    """``{field: its names}`` for every field typed ``Union[Literal[...], str]``: a name or a ``module:function``."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        literals = [a for a in args if typing.get_origin(a) is Literal]
        if typing.get_origin(hints[f.name]) is typing.Union and str in args and literals:
            found[f.name] = typing.get_args(literals[0])
    return found


def is_code(name: str, value: Any, listed: Any = None, fix: str = "") -> bool:
    """Whether ``value`` is the user's code: a class or function from Python, or a ``package.module:function``
    (its form and the standard-library rule checked here). ``listed``: the whole list, for a list's entry."""
    if is_object(value):
        return True
    if not (isinstance(value, str) and is_factory(value)):
        return False
    if not FACTORY_RE.match(value):
        fail(name, value if listed is None else listed, f"{'' if listed is None else f'entry {value!r} '}is not of "
             f"the form 'package.module:function'", fix or "Write e.g. 'my_code:build' for build() in my_code.py.")
    check_factory_spec(value, name)
    return True


def check_code_choices(cfg) -> None:
    """A field that takes a name, a ``module:function`` or the function (``optimizer``, ``loss``), and its kwargs."""
    for name, valid in factory_choices(type(cfg)).items():
        value = getattr(cfg, name)
        if not is_code(name, value) and (not isinstance(value, str) or value not in valid):
            fail(name, value, f"is not one of {list(valid)} or a 'package.module:function'",
                 f"{did_you_mean(value, valid).lstrip()} Set {name} to one of them, name your own function, or (from "
                 f"Python) pass the function itself.".lstrip())
    kwargs = cfg.optimizer_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        fail("optimizer_kwargs", kwargs, "must be a mapping with string keys", "Write it as {key: value}.")
    # What the trainer passes itself: the parameters, the (scaled, scheduled) lr, and the
    # built-in optimizers' own fields.
    own = ("params", "lr") if is_code("optimizer", cfg.optimizer) else ("params", "lr", "momentum", "weight_decay")
    clash = sorted(set(kwargs) & set(own))
    if clash:
        fail("optimizer_kwargs", kwargs, f"must not set {clash}: the trainer passes them to the optimizer",
             "Remove them, and set TrainConfig.lr (for sgd/adamw also momentum, weight_decay) instead.")


def check_lr_schedule(cfg) -> None:
    """``warmup_steps``, ``min_lr``, ``decay_fraction``, and ``lr_schedule`` as the user's scheduler (after
    :func:`check_code_choices`): a function that cannot be called as ``fn(optimizer, total_steps)``, or one beside
    the fields that shape the built-in schedules' LR (the user's scheduler owns it), is refused here, before Ray."""
    steps = cfg.warmup_steps
    if steps is not None and (not is_int(steps) or steps < 0):
        fail("warmup_steps", steps, "must be a whole number of optimizer steps >= 0, or None",
             "Set it to e.g. 100, or leave it unset.")
    if steps is not None and cfg.warmup_epochs != 0:
        fail("warmup_steps", steps, f"and warmup_epochs={cfg.warmup_epochs!r} both set the warm-up",
             "Set one of them: warmup_steps (optimizer steps), or warmup_epochs with warmup_steps left unset.")
    check_number(cfg, "min_lr", 0, fix="Set min_lr to 0 (decay to zero) or a small LR, e.g. lr / 10.")
    check_number(cfg, "decay_fraction", 0, 1, low_open=True, high_open=False,
                 fix="Set decay_fraction to e.g. 0.1: wsd decays over the last tenth of the steps.")
    schedule = cfg.lr_schedule
    if is_code("lr_schedule", schedule):
        shaping = [f"{name}={getattr(cfg, name)!r}" for name, unset in (("warmup_steps", None), ("warmup_epochs", 0),
                                                                         ("min_lr", 0)) if getattr(cfg, name) != unset]
        if shaping:
            fail("lr_schedule", code_name(schedule), f"is your own scheduler, which owns the LR, and "
                 f"{', '.join(shaping)} would shape it too", "Build the warm-up and the floor into your scheduler "
                 "(e.g. torch.optim.lr_scheduler.SequentialLR of a LinearLR warm-up and your decay), and leave "
                 "warmup_steps, warmup_epochs and min_lr unset.")
        _check_scheduler_signature(schedule)
        return
    peak = cfg.optim.scaled_lr()  # lr after lr_scaling: what the schedule decays from
    if cfg.min_lr >= peak:
        scaled = "" if peak == cfg.lr else f" ({peak:g} after lr_scaling={cfg.lr_scaling!r})"
        fail("min_lr", cfg.min_lr, f"must be below the peak LR, lr={cfg.lr!r}{scaled}",
             "Set min_lr below it, e.g. lr / 10, or 0.")


def _check_scheduler_signature(schedule) -> None:
    """The user's scheduler takes ``(optimizer, total_steps)`` as the engine passes them."""
    check_signature("lr_schedule", schedule, "(optimizer, total_steps)", 2,
                    "Write it as def my_schedule(optimizer, total_steps): return torch.optim.lr_scheduler.OneCycleLR("
                    "optimizer, max_lr=..., total_steps=total_steps); give any further parameters defaults.")


def check_signature(field: str, spec: Any, shape: str, count: int, fix: str, listed: Any = None) -> None:
    """The user's function named by ``field`` can be called with ``count`` positional arguments, ``shape``, as the
    engine calls it (importing a ``module:function``: the import's error names the fix). A signature Python cannot
    read passes. ``listed``: the whole list, for a list's entry."""
    import inspect

    function = load_factory(spec, field)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*[None] * count)
    except TypeError as exc:
        entry = "" if listed is None else f"entry {code_name(spec)!r} "
        fail(field, code_name(spec) if listed is None else listed, f"{entry}must take {shape}, as the engine calls "
             f"it, but its signature is {function_name(spec)}{signature} ({exc})", fix)


def check_objective_signatures(cfg) -> None:
    """A user's loss and metric functions take ``(outputs, targets)``: one that cannot is refused before Ray, not
    at the first step on every worker."""
    fix = ("Write it as def my_{0}(outputs, targets): return ... (a {1}); give any further parameters defaults, "
           "or bind them with functools.partial.")
    if is_code("loss", cfg.loss):
        check_signature("loss", cfg.loss, "(outputs, targets)", 2, fix.format("loss", "scalar tensor"))
    for entry in cfg.metrics or ():
        if is_code("metrics", entry, cfg.metrics):
            check_signature("metrics", entry, "(outputs, targets)", 2, fix.format("metric", "number or tensor"),
                            listed=cfg.metrics)


def check_metrics(cfg) -> None:
    """``metrics``: None or a list of names, ``module:function`` entries or functions, reported under distinct names."""
    metrics = cfg.metrics
    valid = typing.get_args(Metric)
    fix = f"Write a list, e.g. metrics=['mae'] or ['my_metrics:within_tenth'], of {list(valid)} or your functions."
    if metrics is None:
        return
    if not isinstance(metrics, list):
        fail("metrics", metrics, "must be a list of metric names or 'package.module:function's", fix)
    seen = set()
    for entry in metrics:
        if not is_code("metrics", entry, metrics, fix) and (not isinstance(entry, str) or entry not in valid):
            fail("metrics", metrics, f"entry {entry!r} is not one of {list(valid)} or a 'package.module:function'",
                 f"{did_you_mean(entry, valid).lstrip()} {fix}".lstrip())
        name = function_name(entry)
        if name == "loss":
            fail("metrics", metrics, f"entry {entry!r} would be reported as train_loss/test_loss, the loss's "
                                     f"own keys", "Rename the function, e.g. to my_loss_metric.")
        if name in seen:
            fail("metrics", metrics, f"two entries would both be reported as train_{name}/test_{name}",
                 "List each metric once, and give each metric function its own name.")
        seen.add(name)


def check_model_and_dataset(cfg) -> None:
    """``model`` and ``dataset``: a registry name, a ``package.module:function``, or (from Python) the class
    or function itself; the registries' names are checked by ``models.check_model_name`` and ``data``."""
    torch = sys.modules.get("torch")  # a model object means torch is loaded: no import for a config of names
    if torch is not None and isinstance(cfg.model, torch.nn.Module):
        fail("model", f"<{type(cfg.model).__name__} instance>", "is a built model, but every worker builds its own "
             "copy (seeded alike, so all ranks start from the same weights) and each strategy places it itself",
             f"Pass the class, model={type(cfg.model).__name__} (its arguments in model_kwargs), or a function "
             f"that builds and returns the model; to start from this one's weights, save them "
             f"(torch.save(model.state_dict(), 'w.pt')) and set init_from='w.pt'.")
    for name, example in (("model", "'lenet'"), ("dataset", "'digits'")):
        value = getattr(cfg, name)
        if name == "dataset" and is_ray_datasets(value):  # {"train": ds, ...}: data/ray_datasets.check_fields
            continue
        if not is_code(name, value) and (not isinstance(value, str) or not value.strip()):
            fail(name, value, "must be a registry name, a 'package.module:function' or (from Python) a class or "
                              "function", f"Set {name} to e.g. {example}, 'my_code:build' for build() in "
                                          f"my_code.py, pass build itself, or (from Python) a dict of Ray Datasets.")
    if cfg.collate is not None and not is_code("collate", cfg.collate):
        fail("collate", cfg.collate, "must be a function of a batch or a 'package.module:function'",
             "Pass the function itself, e.g. collate=to_tensors, or name it as 'my_code:to_tensors'.")


def check_callbacks(callbacks: Any) -> None:
    """``callbacks``: ``package.module:Class`` entries, or (from Python) objects with at least one hook."""
    fix = "Write a list of 'package.module:Class' entries, e.g. callbacks=['my_hooks:Notify']."
    if not isinstance(callbacks, list):
        fail("callbacks", callbacks, "must be a list", fix)
    for entry in callbacks:
        if isinstance(entry, str):
            if not FACTORY_RE.match(entry):
                fail("callbacks", callbacks, f"entry {entry!r} is not of the form 'package.module:Class'", fix)
            check_factory_spec(entry, "callbacks")
        elif not any(callable(getattr(entry, hook, None)) for hook in _HOOKS):
            fail("callbacks", callbacks, f"entry {entry!r} has none of the hooks {', '.join(_HOOKS)}",
                 "Pass an instance of a raytrain_mgpu.driver.callbacks.Callback subclass, or a "
                 "'package.module:Class'.")


# ----------------------------------------------------------------------------- the monitor and its mode


def monitor_keys(cfg) -> tuple:
    """The history keys ``monitor`` may name: ``train_``/``val_``/``test_`` + ``loss`` or a metric the run
    records; ``val_`` where there may be a validation split (``val_fraction``, a dataset factory's own, or a
    ``"val"`` Ray Dataset)."""
    metrics = getattr(cfg, "metrics", None)  # user metrics, where the config has them
    names = ["accuracy"] if metrics is None else [function_name(m) for m in metrics]
    dataset = getattr(cfg, "dataset", "")
    val = (getattr(cfg, "val_fraction", None) is not None or is_factory(dataset)
           or (isinstance(dataset, dict) and "val" in dataset))  # Ray Datasets with a "val" split
    return tuple(f"{split}_{name}" for split in ("train", *(("val",) if val else ()), "test")
                 for name in ["loss", *names])


# Which way is better for the built-in names of a history key's last part (``test_accuracy`` -> accuracy).
_HIGHER_IS_BETTER = {"loss": False, "accuracy": True, "top5": True, "mae": False, "mse": False, "perplexity": False}


def better_mode(key: str, metrics=None, mode: str = "auto") -> str:
    """``"max"`` or ``"min"``: how history key ``key`` ranks epochs or trials. ``mode`` ``"min"``/``"max"`` is the
    user's word; ``"auto"`` follows the metric: accuracy and top5 are maximised, losses and errors minimised, and a
    metric function of the user's says so itself with a ``higher_is_better`` attribute (torchmetrics' name).
    ``metrics``: the run's ``TrainConfig.metrics``, where ``key`` may name one of them."""
    if mode in ("min", "max"):
        return mode
    name = key.split("_", 1)[1] if key.split("_", 1)[0] in ("train", "val", "test") and "_" in key else key
    if name in _HIGHER_IS_BETTER and not any(function_name(m) == name and is_factory(m) for m in metrics or ()):
        return "max" if _HIGHER_IS_BETTER[name] else "min"
    for entry in metrics or ():
        if is_factory(entry) and function_name(entry) == name:
            higher = getattr(load_factory(entry, "metrics"), "higher_is_better", None)
            if isinstance(higher, bool):
                return "max" if higher else "min"
            raise ValueError(f"TrainConfig.mode='auto': cannot tell whether a higher {key} is better: your metric "
                             f"{function_name(entry)!r} does not say. Set mode='max' or mode='min', or give the "
                             f"function the attribute higher_is_better = True (or False).")
    raise ValueError(f"TrainConfig.mode='auto': {key!r} is not a loss or a metric of this run, so which way is "
                     f"better is not known. Set mode='max' or mode='min'.")


def monitor_mode(cfg) -> str:
    """``cfg.mode`` for ``cfg.monitor``, ``"auto"`` resolved (:func:`better_mode`); a config or a namespace of its
    fields (a run folder's recorded config)."""
    return better_mode(cfg.monitor, getattr(cfg, "metrics", None), getattr(cfg, "mode", "auto") or "auto")


def check_monitor(cfg) -> None:
    """``monitor`` names an epoch-row key; ``keep_best`` and ``early_stopping_patience`` need it."""
    monitor = cfg.monitor
    if monitor is None:
        for name in ("keep_best", "early_stopping_patience"):
            if getattr(cfg, name) not in (False, None):
                fail(name, getattr(cfg, name), "needs monitor, the history key that ranks epochs",
                     "Set monitor, e.g. monitor='test_loss' or 'test_accuracy' (mode follows it: min for losses, max for "
                     "accuracy).")
        return
    valid = monitor_keys(cfg)
    if not isinstance(monitor, str) or monitor not in valid:
        fail("monitor", monitor, f"is not a history key of this run ({', '.join(valid)})",
             "Set monitor to one of them, or leave it unset.")
    if monitor.startswith("test_") and getattr(cfg, "val_fraction", None) is not None:
        fail("monitor", monitor, f"ranks epochs on the test split, while val_fraction={cfg.val_fraction} holds out a "
                                 f"validation split for that: the best epoch's test score would be chosen by the "
                                 f"test split itself, so biased", f"Set monitor='val_{monitor[len('test_'):]}'.")
    monitor_mode(cfg)  # mode="auto" on a metric of the user's that does not say which way is better: refused now
    if monitor.startswith(("test_", "val_")) and cfg.eval_every_epochs > cfg.epochs:
        fail("monitor", monitor, f"is measured on evaluated epochs only, and eval_every_epochs="
                                 f"{cfg.eval_every_epochs} > epochs={cfg.epochs} evaluates only the last one",
             "Set eval_every_epochs to 1 (or a divisor of epochs), or monitor a train_* key.")
