"""Optimizers and LR schedules, built from ``OptimConfig`` alone.

``optimizer`` is ``sgd``, ``adamw`` or a ``"module:function"`` called as
``function(params, lr, **optimizer_kwargs)`` that returns a ``torch.optim.Optimizer``; the
LR schedule wraps whichever it is, and its ``state_dict()`` is checkpointed and restored
like the built-in ones' (checkpoints load with ``weights_only=True``: its state must be
tensors, numbers and plain containers, as torch's optimizers' is).

``param_groups`` (:func:`param_groups`) splits the trainable parameters into optimizer groups:
None (one group), ``"no_decay_norm_bias"`` (no weight decay on biases, normalisation weights and
other 1-D parameters) or the user's ``fn(model) -> [{"params": [...names or parameters], "lr": ...}]``.
Frozen parameters (``requires_grad=False``) never reach the optimizer. :func:`build_optimizer`
takes parameters or such groups; a group's own ``lr`` or ``weight_decay`` wins over the config's
(a group's ``lr`` is used as given: ``lr_scaling`` scales the config's ``lr`` only; the LR schedule
scales every group by the same factor).

The schedule is per optimizer step: linear warm-up over ``warmup_steps`` (or ``warmup_epochs``), then
constant, step, cosine, linear or warmup-stable-decay (``wsd``), the decays to ``min_lr`` on the run's last
step (:func:`lr_factor`); or the user's ``fn(optimizer, total_steps)`` returning a torch ``LRScheduler``, which
owns the LR. Either is stepped once per optimizer step, and its ``state_dict()`` is checkpointed, so a resume
continues where it stopped. ``lr_scaling`` scales the peak LR with the global batch relative to
``base_batch_size`` (Goyal et al. 2017: linear scaling + warm-up).
"""

from __future__ import annotations

import difflib
import math
from typing import Callable, Iterable, List, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from raytrain_mgpu.config.factories import code_name, function_name, is_factory, load_factory
from raytrain_mgpu.config.sections import OptimConfig


def build_optimizer(params: Iterable, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The configured optimizer over ``params``: parameters, or a list of group dicts (:func:`param_groups`),
    whose own options win over the config's (torch's optimizers read a group's keys before their defaults)."""
    lr, kwargs = cfg.scaled_lr(), dict(cfg.optimizer_kwargs)
    params = _checked_params(params)
    if is_factory(cfg.optimizer):
        return _from_factory(cfg.optimizer, params, lr, kwargs)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kwargs)
    return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **kwargs)


def _from_factory(factory_spec, params: Iterable, lr: float, kwargs: dict) -> torch.optim.Optimizer:
    factory, spec = load_factory(factory_spec, "optimizer"), code_name(factory_spec)
    call = f"{function_name(factory_spec)}(params, lr={lr!r}{''.join(f', {k}={v!r}' for k, v in kwargs.items())})"
    try:
        optimizer = factory(params, lr, **kwargs)
    except Exception as exc:  # the user's code: name it and what it was given
        raise ValueError(f"TrainConfig.optimizer={spec!r} failed: {call} raised {type(exc).__name__}: {exc}. "
                         f"Fix the factory or TrainConfig.optimizer_kwargs.") from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        # LambdaLR, the checkpoint and fsdp's optimizer state all need one
        raise ValueError(f"TrainConfig.optimizer={spec!r}: {call} returned a {type(optimizer).__name__}, not a "
                         f"torch.optim.Optimizer. Return the optimizer built over params.")
    return optimizer


def _checked_params(params: Iterable) -> list:
    """``params`` as a list; groups (dicts) and bare tensors are not mixed, and each group has its ``params``."""
    params = list(params)
    groups = [p for p in params if isinstance(p, dict)]
    if groups and len(groups) != len(params):
        raise ValueError("build_optimizer: params mixes parameter groups (dicts) and bare parameters. Pass one "
                         "kind: put the bare parameters into a group of their own.")
    missing = [i for i, group in enumerate(groups) if "params" not in group]
    if missing:
        raise ValueError(f"build_optimizer: parameter group(s) {missing} have no 'params' entry. Give each "
                         f"group {{'params': [...], ...options}}.")
    return params


# ----------------------------------------------------------------------------- parameter groups

NO_DECAY_NORM_BIAS = "no_decay_norm_bias"
ParamGroupsSpec = Union[None, str, Callable[[nn.Module], List[dict]]]
_SHOWN = 5  # names listed in a message before "and N more"


def param_groups(model: nn.Module, spec: ParamGroupsSpec, weight_decay: float) -> List[dict]:
    """The optimizer's parameter groups over ``model``'s trainable parameters (frozen ones are left out).

    ``spec``: None, one group; ``"no_decay_norm_bias"``, two: ``weight_decay`` on the weights of dim >= 2
    (matmuls, convolutions, embeddings: nanoGPT's and Hugging Face Trainer's rule) and 0 on biases,
    normalisation layers' weights, every other 1-D parameter and the names a timm model lists in its
    ``no_weight_decay()``; a callable ``fn(model)`` (or ``"module:function"``) returning group dicts whose
    ``"params"`` are parameters or their names, beside any optimizer option (``lr``, ``weight_decay``, ...).
    Named parameters only, so it works on the module as built and under FSDP2 (DTensor parameters, the
    same names). Every trainable parameter must be in exactly one group."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"param_groups: every parameter of the {type(model).__name__} is frozen "
                         f"(requires_grad=False), so there is nothing to train. Unfreeze the ones to train.")
    if spec is None:
        return [{"params": [p for _, p in trainable]}]
    if spec == NO_DECAY_NORM_BIAS:
        return _no_decay_norm_bias(model, trainable, weight_decay)
    if isinstance(spec, str) and not is_factory(spec):
        raise ValueError(f"param_groups={spec!r} is not a known rule. Use None, {NO_DECAY_NORM_BIAS!r}, a function "
                         f"fn(model) -> list of group dicts, or its 'package.module:function'.")
    if not callable(spec) and not isinstance(spec, str):
        raise ValueError(f"param_groups={spec!r} is a {type(spec).__name__}. Use None, {NO_DECAY_NORM_BIAS!r}, a "
                         f"function fn(model) -> list of group dicts, or its 'package.module:function'.")
    function = load_factory(spec, "param_groups")
    try:
        groups = function(model)
    except Exception as exc:  # the user's code: name it
        raise ValueError(f"param_groups={code_name(spec)!r} failed: {function_name(spec)}(model) raised "
                         f"{type(exc).__name__}: {exc}. Fix the function.") from exc
    return _checked_groups(model, groups, code_name(spec))


def _is_norm(module: nn.Module) -> bool:
    # By type, and by name for the norms models define themselves (LlamaRMSNorm, T5LayerNorm, FrozenBatchNorm2d).
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
             *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
    return isinstance(module, norms) or "Norm" in type(module).__name__


def _no_decay_norm_bias(model: nn.Module, trainable: list, weight_decay: float) -> List[dict]:
    in_norm = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules() if _is_norm(module)
               for name, _ in module.named_parameters(recurse=False)}
    listed = getattr(model, "no_weight_decay", None)  # timm: e.g. {"pos_embed", "cls_token"}
    listed = set(listed()) if callable(listed) else set()
    decay = [p for name, p in trainable if p.dim() >= 2 and name not in in_norm and name not in listed]
    taken = {id(p) for p in decay}
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": [p for _, p in trainable if id(p) not in taken], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] or [groups[0]]


def _listed(names: list) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _checked_groups(model: nn.Module, groups, spec: str) -> List[dict]:
    """The groups with names resolved to parameters, after the checks (each error names the fix)."""
    where = f"param_groups={spec!r}"
    if isinstance(groups, dict) or not isinstance(groups, (list, tuple)) or not groups:
        raise ValueError(f"{where} returned {groups!r:.80}: return a non-empty list of group dicts, "
                         f"e.g. [{{'params': ['fc.weight', 'fc.bias'], 'lr': 0.1}}, ...].")
    by_name = dict(model.named_parameters(remove_duplicate=False))  # a tied parameter under each of its names
    name_of = {}
    for name, p in by_name.items():
        name_of.setdefault(id(p), name)
    owner: dict = {}  # id(parameter) -> group index
    resolved = []
    for index, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"{where}: group {index} is {group!r:.80}, not a dict with 'params'. Write "
                             f"{{'params': [names or parameters], ...options}}.")
        entries = group["params"]
        entries = [entries] if isinstance(entries, (str, torch.Tensor)) else list(entries)
        params = []
        for entry in entries:
            p = _resolve(entry, by_name, name_of, where, index)
            name = name_of[id(p)]
            if not p.requires_grad:
                raise ValueError(f"{where}: group {index} lists {name!r}, which is frozen (requires_grad=False). "
                                 f"Leave it out of the groups, or unfreeze it (requires_grad_(True)).")
            if id(p) in owner:
                raise ValueError(f"{where}: {name!r} is in group {owner[id(p)]} and group {index}. Put each "
                                 f"parameter in one group.")
            owner[id(p)] = index
            params.append(p)
        resolved.append({**group, "params": params})
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if left:
        raise ValueError(f"{where}: {len(left)} trainable parameter(s) in no group ({_listed(left)}). Add them to "
                         f"a group, or freeze them (requires_grad_(False)) to leave them out of training.")
    return resolved


def _resolve(entry, by_name: dict, name_of: dict, where: str, index: int) -> torch.Tensor:
    if isinstance(entry, str):
        if entry not in by_name:
            close = difflib.get_close_matches(entry, list(by_name), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"{where}: group {index} names {entry!r}, which is not a parameter of the model "
                             f"(model.named_parameters()).{hint}")
        return by_name[entry]
    if not isinstance(entry, torch.Tensor) or id(entry) not in name_of:
        raise ValueError(f"{where}: group {index} holds a {type(entry).__name__} that is not a parameter of "
                         f"the model. List the model's parameters or their names.")
    return entry


# ----------------------------------------------------------------------------- LR schedules


def total_steps(cfg: OptimConfig, steps_per_epoch: int, epochs: int) -> int:
    """The run's optimizer steps: ``epochs`` x ``steps_per_epoch``, or ``max_steps`` where it is smaller (the
    same on every worker count: an elastic run keeps the global batch, so the steps per epoch)."""
    total = epochs * steps_per_epoch
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def warmup_steps(cfg: OptimConfig, steps_per_epoch: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(round(cfg.warmup_epochs * steps_per_epoch))


def lr_factor(step: int, cfg: OptimConfig, steps_per_epoch: int, epochs: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based) of a built-in schedule.

    Warm-up: step ``k`` (1-based) of ``W`` uses ``k / W`` of the peak. Then ``constant``; ``step`` (x gamma every
    ``lr_step_epochs``); ``cosine`` and ``linear`` from the peak at step ``W`` to ``min_lr`` at the last step;
    ``wsd`` at the peak until its last ``D = round(decay_fraction x total)`` steps (at least 1), which fall
    linearly to ``min_lr``, reached on the last step (warm-up wins where the two overlap)."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    if step < warmup:  # warm-up
        return (step + 1) / warmup
    schedule = cfg.lr_schedule
    if schedule == "step":
        return cfg.lr_step_gamma ** (step // (cfg.lr_step_epochs * steps_per_epoch))
    if schedule not in ("cosine", "linear", "wsd"):
        return 1.0
    total = total_steps(cfg, steps_per_epoch, epochs)
    floor = cfg.min_lr / cfg.scaled_lr()  # min_lr is absolute; groups with their own lr share the factor
    if schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * total))
        if step < total - decay:  # stable
            return 1.0
        progress = min(1.0, (step - (total - decay) + 1) / decay)  # decay: the last step at the floor
    else:
        progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    left = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * left


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps_per_epoch: int,
                    epochs: int) -> LRScheduler:
    """The configured schedule over ``optimizer``, stepped once per optimizer step: a built-in one (a
    ``LambdaLR`` of :func:`lr_factor`), or the user's ``fn(optimizer, total_steps)``."""
    if is_factory(cfg.lr_schedule):
        return _user_scheduler(cfg.lr_schedule, optimizer, total_steps(cfg, steps_per_epoch, epochs))
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, steps_per_epoch, epochs))


def _user_scheduler(spec, optimizer: torch.optim.Optimizer, total: int) -> LRScheduler:
    function, name = load_factory(spec, "lr_schedule"), code_name(spec)
    call = f"{function_name(spec)}(optimizer, total_steps={total})"
    try:
        scheduler = function(optimizer, total)
    except Exception as exc:  # the user's code: name it and what it was given
        raise ValueError(f"TrainConfig.lr_schedule={name!r} failed: {call} raised {type(exc).__name__}: {exc}. "
                         f"Fix the function.") from exc
    if isinstance(scheduler, ReduceLROnPlateau) or not isinstance(scheduler, LRScheduler):
        # ReduceLROnPlateau's step() wants a metric, which a per-step schedule does not have
        raise ValueError(f"TrainConfig.lr_schedule={name!r}: {call} returned a {type(scheduler).__name__}, not a "
                         f"torch.optim.lr_scheduler.LRScheduler stepped without arguments. Return one built over "
                         f"the optimizer it is given, e.g. OneCycleLR(optimizer, max_lr=..., total_steps=total_steps).")
    if scheduler.optimizer is not optimizer:
        raise ValueError(f"TrainConfig.lr_schedule={name!r}: {call} returned a scheduler of another optimizer. "
                         f"Build it over the optimizer it is given.")
    return scheduler
