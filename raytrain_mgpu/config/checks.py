"""The one validation pass over a ``TrainConfig``: ``validate`` (types, ranges, choices, then the strategy's rules).

Runs in ``TrainConfig.__post_init__`` (and ``replace``), on the driver, before Ray is
started. Types are checked strictly because values arrive from YAML and the CLI: ``'false'``
(a quoted YAML string) is not a bool, ``True`` is not a learning rate, ``0.4`` is not a
timeout in whole seconds. Every error is a ``ValueError`` naming the field, the value, the
rule and the fix. The registries (models, datasets, strategies) are imported inside the
functions that need them, so importing the config imports neither torch nor Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, Literal

from raytrain_mgpu.config.names import SPELLED_OTHERWISE, check_number, did_you_mean, fail, is_int
from raytrain_mgpu.config.factories import function_name, is_factory, is_object
from raytrain_mgpu.config.code import (check_callbacks, check_code_choices, check_lr_schedule, check_metrics,
                                       check_model_and_dataset, check_monitor, check_objective_signatures, is_code)
from raytrain_mgpu.config.sections import TensorParallelStyle
from raytrain_mgpu.config.units import parse_bytes
from raytrain_mgpu.data import check_data_fields
from raytrain_mgpu.data.ingest import check_ingest
from raytrain_mgpu.models import check_model_name
from raytrain_mgpu.models.huggingface import absolute, is_hf, run_label
from raytrain_mgpu.models.lora import check_lora

__all__ = ["validate", "warn_unused", "fail", "coerce", "check_fields", "check_name", "choices"]

_BOOLS = ("download", "auto_measure", "find_unused_parameters", "static_graph",
          "gradient_as_bucket_view", "sync_batchnorm", "cpu_offload", "channels_last", "verbose",
          "keep_best", "test_every_epoch", "init_strict", "tensor_parallel_across_nodes")
_POSITIVE_INTS = ("gpus_per_worker", "cpus_per_worker", "num_stages", "num_microbatches",
                  "epochs", "batch_size", "grad_accum_steps", "base_batch_size", "lr_step_epochs",
                  "num_checkpoints_to_keep", "eval_every_epochs", "log_every_n_steps", "max_skipped_steps",
                  "tensor_parallel_size")
_OPTIONAL_POSITIVE_INTS = ("max_steps", "num_samples", "memory_budget_bytes", "early_stopping_patience",
                           "checkpoint_every_n_steps", "shard_group_size", "eval_every_n_steps")
_NON_EMPTY_STRINGS = ("strategy", "image_column", "label_column")  # model, dataset: _check_code
_OPTIONAL_STRINGS = ("data_root", "address", "init_from")
SEED_LIMIT = 2**63


def validate(cfg) -> Dict[str, Any]:
    """Normalise and check ``cfg`` in place; ValueError names the field and the fix.

    Returns the options ``cfg`` sets that its strategy never reads (``{field: value}``);
    the caller warns about them (``warn_unused``) at the user's line.
    """
    coerce(cfg)
    check_fields(cfg)
    if cfg.name is None:
        model, dataset = (function_name(v) if is_object(v) else v for v in (cfg.model, cfg.dataset))
        dataset = "raydata" if isinstance(cfg.dataset, dict) else dataset  # Ray Datasets (data/ray_datasets.py)
        model = run_label(model) if is_hf(model) else model  # "hf:/models/llama-3" -> "hf.llama-3"
        # one plain folder name: "torchvision.models:resnet18" -> "torchvision.models.resnet18"
        cfg.name = "-".join(str(part).replace(":", ".") for part in (model, dataset, cfg.strategy))
    check_model_name(cfg.model)
    cfg.model = absolute(cfg.model)  # hf:./folder, read from the driver's working folder: a worker's is another
    check_lora(cfg)  # LoRA's settings on an hf: model (sets save="trainable": checkpoints hold the adapters)
    check_data_fields(cfg)  # the dataset name, loader workers and transforms
    check_ingest(cfg)  # ingest="ray_data": the datasets Ray Data streams (data/ingest.py)
    # late: strategies/ sits above the config (the one upward import tests/test_imports.py allows): at the top, every
    # strategy would load with the config (--help too), and a strategy importing the config would make a cycle
    from raytrain_mgpu.strategies import get_strategy
    from raytrain_mgpu.strategies.elastic import check_worker_range

    check_worker_range(cfg)  # a count, "auto", or (min, max) with an elastic strategy and a batch every count splits
    if cfg.strategy == "auto":  # resolved, and its choice validated, in fit()
        if cfg.fault_tolerance == "replica_groups":
            fail("strategy", "auto", "may choose one replica groups cannot run", "Set strategy='ddp'.")
        return {}
    strategy = get_strategy(cfg.strategy)
    _check_strategy_rules(cfg, strategy)
    return unused_options(cfg, strategy)


def _check_strategy_rules(cfg, strategy) -> None:
    """The strategy's rules, on ``cfg`` laid out provisionally where it says ``"auto"`` (``strategies/layout.py``:
    no device is read at construction; ``fit`` lays it out on the devices found and checks again). With
    ``use_gpu="auto"`` the config passes where either answer does: a GPU-only option (``precision="16-mixed"``,
    ``sync_batchnorm``) is refused when ``fit`` finds no GPU, not here."""
    # late: strategies/, as in validate
    from raytrain_mgpu.strategies.base import check_lora_strategy
    from raytrain_mgpu.strategies.replica_groups import check_replica_groups
    from raytrain_mgpu.strategies.elastic import at_count, worker_range
    from raytrain_mgpu.strategies.layout import is_auto, provisional

    errors = []
    for use_gpu in (False, True) if is_auto(cfg.use_gpu) else (False,):
        planned = provisional(cfg, use_gpu)
        try:
            # elastic: the largest count fixes the micro-batch
            strategy.validate(at_count(planned, worker_range(planned)[1]))
            check_sync_batchnorm(planned, strategy)
            check_lora_strategy(planned, strategy)
            check_replica_groups(planned, strategy)
            return
        except ValueError as exc:
            errors.append(exc)
    raise errors[0]  # the CPU layout's: the one a machine without a GPU trains


def unused_options(cfg, strategy_cls) -> Dict[str, Any]:
    """The optional fields ``cfg`` sets (to other than their default) that ``strategy_cls`` never reads."""
    from raytrain_mgpu.strategies.base import OPTIONAL_FIELDS  # late: strategies/, as in validate

    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return {option: getattr(cfg, option) for option in OPTIONAL_FIELDS
            if option not in strategy_cls.options_used and getattr(cfg, option) != defaults[option]}


def warn_unused(unused: Dict[str, Any], strategy: str, stacklevel: int) -> None:
    """One warning per option, naming the strategies that read it.

    ``stacklevel`` as if the caller called ``warnings.warn`` itself (the depth is fixed:
    ``TrainConfig.__post_init__`` passes 3, ``TrainConfig.replace`` 2).
    """
    if not unused:
        return
    from raytrain_mgpu.strategies import STRATEGIES  # late: strategies/, as in validate

    for option, value in unused.items():
        users = sorted(name for name, cls in STRATEGIES.items() if option in cls.options_used)
        warnings.warn(f"TrainConfig.{option}={value!r} has no effect with strategy={strategy!r}; it is "
                      f"read by {', '.join(users) or 'no registered strategy'}. Remove it, or pick one "
                      f"of those strategies.", UserWarning, stacklevel=stacklevel + 1)


@functools.lru_cache(maxsize=None)
def choices(cls) -> Dict[str, tuple]:
    """``{field: its values}`` for every field of dataclass ``cls`` typed ``Literal[...]``."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def check_name(name: Any) -> None:
    """A run name is one plain folder name: checkpoints, history and Ray's run folder must
    all land in ``storage_path/name`` (``'../x'`` or ``'/abs'`` would split them apart)."""
    if name is None:
        return
    fix = "Use one plain folder name such as 'lenet-digits-ddp' (letters, digits, '-', '_', '.')."
    if not isinstance(name, str) or not name.strip():
        fail("name", name, "must be a non-empty string", fix)
    if name in (".", "..") or any(c in name for c in "/\\") or any(ord(c) < 32 for c in name):
        fail("name", name, "must be a plain folder name inside storage_path (no '/', '\\\\', '..' or "
                           "control characters)", fix)


def coerce(cfg) -> None:
    """Normalise forms YAML and the CLI produce (lists for tuples, "24GiB" for bytes)."""
    storage = cfg.storage_path
    if not isinstance(storage, str) or not storage.strip():
        fail("storage_path", storage, "must be a non-empty path or URI",
             "Set storage_path to a folder (e.g. ~/raytrain_results) or s3://bucket/runs.")
    for name in ("input_shape", "balance"):
        if isinstance(getattr(cfg, name), list):
            setattr(cfg, name, tuple(getattr(cfg, name)))
    if is_int(cfg.precision):
        cfg.precision = str(cfg.precision)
    for name in ("metrics", "loggers", "callbacks"):
        if isinstance(getattr(cfg, name), tuple):
            setattr(cfg, name, list(getattr(cfg, name)))
    if isinstance(cfg.memory_budget_bytes, (str, float)) and not isinstance(cfg.memory_budget_bytes, bool):
        cfg.memory_budget_bytes = parse_bytes(cfg.memory_budget_bytes, "TrainConfig.memory_budget_bytes")
    if "://" not in storage:
        cfg.storage_path = str(Path(storage).expanduser().resolve())


def check_fields(cfg) -> None:
    """Every field's type and range; cross-field rules of a strategy live in its class."""
    _check_types(cfg)
    check_model_and_dataset(cfg)
    _check_ranges(cfg)
    for name, valid in choices(type(cfg)).items():
        value = getattr(cfg, name)
        if not (value is None or isinstance(value, str)) or value not in valid:
            hint = did_you_mean(value, [v for v in valid if v is not None], SPELLED_OTHERWISE.get(name))
            fail(name, value, f"is not one of {list(valid)}", f"{hint.lstrip()} Set {name} to one of them.".lstrip())
    check_code_choices(cfg)
    check_lr_schedule(cfg)
    check_metrics(cfg)
    check_objective_signatures(cfg)
    _check_balance(cfg)
    _check_shapes(cfg)
    _check_validation(cfg)
    check_monitor(cfg)
    _check_watching(cfg)
    _check_step_features(cfg)
    _check_tensor_parallel(cfg)


def _check_tensor_parallel(cfg) -> None:
    """``tensor_parallel_plan``'s shape and styles (whether its paths exist is checked on the model, before Ray)."""
    plan, styles = cfg.tensor_parallel_plan, typing.get_args(TensorParallelStyle)
    if plan is not None and not (isinstance(plan, dict) and plan and all(
            isinstance(k, str) and k.strip() and v in styles for k, v in plan.items())):
        fail("tensor_parallel_plan", plan, f"must map module paths to styles, one of {list(styles)}",
             'Write e.g. {"layers.*.attn.q": "colwise", "layers.*.attn.proj": "rowwise"}, or leave it unset.')
    if cfg.tensor_parallel_size > 1 and isinstance(cfg.num_workers, (list, tuple)):
        fail("tensor_parallel_size", cfg.tensor_parallel_size, f"needs a fixed number of workers, not the range "
             f"num_workers={list(cfg.num_workers)} (the mesh is fixed at start)",
             "Set num_workers to one count (a multiple of tensor_parallel_size), or tensor_parallel_size=1.")


def _check_step_features(cfg) -> None:
    """Time-based checkpoints, the profiler's window, and the fields that name a step or parameter groups."""
    minutes, rate = cfg.checkpoint_every_n_minutes, cfg.expected_reclaims_per_gpu_hour
    if minutes not in (None, "auto") and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                          or not minutes > 0 or minutes == float("inf")):
        fail("checkpoint_every_n_minutes", minutes, "must be a positive number of minutes, 'auto' or None",
             "Set it to e.g. 30, or to 'auto' with expected_reclaims_per_gpu_hour, or leave it unset.")
    if minutes == "auto" and rate is None:
        fail("checkpoint_every_n_minutes", minutes, "needs expected_reclaims_per_gpu_hour (the interval is "
             "Young-Daly's from the saves' stall and the run's mean time between reclaims)", "Set "
             "expected_reclaims_per_gpu_hour to your cluster's rate, e.g. 0.05, or checkpoint_every_n_minutes to a "
             "number of minutes.")
    if minutes != "auto" and rate is not None:  # refused, not ignored: a rate nothing reads is a mistake
        fail("expected_reclaims_per_gpu_hour", rate, f"is read by checkpoint_every_n_minutes='auto' alone (it is "
             f"{minutes!r})", "Set checkpoint_every_n_minutes='auto', or leave expected_reclaims_per_gpu_hour unset.")
    if rate is not None:
        check_number(cfg, "expected_reclaims_per_gpu_hour", 0, low_open=True, fix="Set it to e.g. 0.05.")
    window = cfg.profile_steps
    if window is not None:
        if isinstance(window, list):
            window = cfg.profile_steps = tuple(window)
        if not (isinstance(window, tuple) and len(window) == 2 and all(is_int(w) and w >= 1 for w in window)
                and window[0] <= window[1]):
            fail("profile_steps", cfg.profile_steps, "must be (first, last) global steps with 1 <= first <= last",
                 "Set it to e.g. (10, 15): six steps after the first nine (warm-up) ones.")
    for name, what in (("train_step", "fn(model, batch, ctx)"), ("param_groups", "fn(model) -> list of dicts")):
        value = getattr(cfg, name)
        if value is None or (name == "param_groups" and value == "no_decay_norm_bias"):
            continue
        if not is_code(name, value):
            fail(name, value, f"must be {what}, a 'package.module:function'"
                              + (" or 'no_decay_norm_bias'" if name == "param_groups" else ""),
                 "Pass the function itself from Python, or name it as 'my_code:function'.")


def check_sync_batchnorm(cfg, strategy_cls) -> None:
    """After the strategy's own checks: they name a better alternative where one exists."""
    if cfg.sync_batchnorm and not cfg.use_gpu and "sync_batchnorm" in strategy_cls.options_used:
        fail("sync_batchnorm", True, "SyncBatchNorm needs GPUs (torch has no CPU implementation; the first "
                                     "step would fail on the workers)",
             "Set use_gpu=True, or sync_batchnorm=False on CPU.")


def _check_types(cfg) -> None:
    for name in _BOOLS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            fail(name, value, "must be true or false", f"Write {name}: true or {name}: false (YAML booleans, "
                                                        f"not quoted strings).")
    if not (isinstance(cfg.use_gpu, bool) or cfg.use_gpu == "auto"):
        fail("use_gpu", cfg.use_gpu, "must be true, false or 'auto'",
             "Write use_gpu: auto (the GPUs found, if any), true, or false (YAML booleans, not quoted strings).")
    if not (isinstance(cfg.compile, bool) or cfg.compile == "blocks"):
        fail("compile", cfg.compile, "must be true, false or 'blocks'",
             "Write compile: true (the whole model), compile: blocks (each block), or compile: false.")
    for name in _POSITIVE_INTS:
        value = getattr(cfg, name)
        if not is_int(value) or value < 1:
            fail(name, value, "must be a positive integer", f"Set {name} to 1 or more.")
    for name in _OPTIONAL_POSITIVE_INTS:
        value = getattr(cfg, name)
        if value is not None and (not is_int(value) or value < 1):
            fail(name, value, "must be a positive integer or None", f"Set {name} to 1 or more, or leave it unset.")
    for name in _NON_EMPTY_STRINGS:
        value = getattr(cfg, name)
        if not isinstance(value, str) or not value.strip():
            fail(name, value, "must be a non-empty string", f"Set {name} to a name, e.g. the default.")
    for name in _OPTIONAL_STRINGS:
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            fail(name, value, "must be a non-empty string or None", f"Set {name} or leave it unset.")
    check_name(cfg.name)
    if not isinstance(cfg.model_kwargs, dict) or not all(isinstance(k, str) for k in cfg.model_kwargs):
        fail("model_kwargs", cfg.model_kwargs, "must be a mapping with string keys", "Write it as {key: value}.")


def _check_ranges(cfg) -> None:
    if cfg.num_classes is not None and (not is_int(cfg.num_classes) or cfg.num_classes < 2):
        fail("num_classes", cfg.num_classes, "must be an integer >= 2 or None",
             "A classifier needs at least 2 classes; set num_classes to 2 or more.")
    if cfg.shard_group_size is not None and isinstance(cfg.num_workers, (list, tuple)):
        fail("shard_group_size", cfg.shard_group_size, f"needs a fixed number of workers, not the range "
             f"num_workers={list(cfg.num_workers)} (an elastic run may go on with a count it does not divide)",
             "Set num_workers to one count, or leave shard_group_size unset.")
    if not is_int(cfg.activation_checkpointing) or cfg.activation_checkpointing < 0:
        fail("activation_checkpointing", cfg.activation_checkpointing, "must be an integer >= 0",
             "Set it to 1 to recompute every block, k for every k-th block, or 0 for none.")
    if not is_int(cfg.max_failures) or cfg.max_failures < -1:
        fail("max_failures", cfg.max_failures, "must be -1 (retry forever) or a count >= 0",
             "Set max_failures to 0 to fail fast.")
    if not is_int(cfg.max_preemption_failures) or cfg.max_preemption_failures < -1:
        fail("max_preemption_failures", cfg.max_preemption_failures,
             "must be -1 (restart after every preemption) or a count >= 0",
             "Leave it at -1 on spot nodes; 0 fails the run on the first preemption.")
    check_number(cfg, "preemption_grace_s", 0, fix="Set preemption_grace_s to 0 (restart at the deadline) or a few seconds.")
    if not is_int(cfg.seed) or not 0 <= cfg.seed < SEED_LIMIT:
        fail("seed", cfg.seed, "must be an integer in [0, 2**63)", "Set seed to e.g. 0.")
    if cfg.output_device is not None and (not is_int(cfg.output_device) or cfg.output_device < 0):
        fail("output_device", cfg.output_device, "must be a local device index >= 0 or None",
             "Leave it unset to gather on the first device.")
    check_number(cfg, "lr", 0, low_open=True, fix="Set lr to e.g. 0.05.")
    check_number(cfg, "momentum", 0, 1, fix="Set momentum to e.g. 0.9.")
    check_number(cfg, "weight_decay", 0, fix="Set weight_decay to 0 or a small positive value.")
    check_number(cfg, "warmup_epochs", 0, fix="Set warmup_epochs to 0 for no warm-up.")
    check_number(cfg, "lr_step_gamma", 0, 1, low_open=True, high_open=False,
            fix="Set lr_step_gamma to e.g. 0.1 (the LR shrinks; a negative one would ascend the loss).")
    check_number(cfg, "collective_timeout_s", 1, fix="Set it to e.g. 600 (whole seconds; torch rounds down).")
    check_number(cfg, "placement_timeout_s", 0, low_open=True, fix="Set it to e.g. 900 (an autoscaler's nodes take "
                                                                  "minutes to start).")
    if cfg.stall_timeout_s is not None:
        check_number(cfg, "stall_timeout_s", 0, fix="Leave it unset for max(120 s, 20 x the median step time), or 0 "
                                                    "to turn it off.")
    _check_placement_request(cfg)
    for name in ("grad_clip_norm", "bucket_cap_mb"):
        if getattr(cfg, name) is not None:
            check_number(cfg, name, 0, low_open=True, fix=f"Leave {name} unset for the default.")


_RAY_OWN_RESOURCES = {"CPU": "cpus_per_worker", "GPU": "use_gpu and gpus_per_worker", "memory": None,
                      "object_store_memory": None}


def _check_placement_request(cfg) -> None:
    """``resources_per_worker``, ``accelerator_type`` and ``label_selector``: their shapes (whether the cluster has
    them is checked once Ray is up, against its nodes and node types)."""
    request = cfg.resources_per_worker
    if not isinstance(request, dict) or not all(isinstance(k, str) and k.strip() for k in request):
        fail("resources_per_worker", request, "must be a mapping of Ray resource names to amounts",
             'Write it as {"spot": 1}.')
    for name, amount in request.items():
        if name in _RAY_OWN_RESOURCES:
            own = _RAY_OWN_RESOURCES[name]
            fail("resources_per_worker", request, f"{name!r} is not a custom resource",
                 f"Set {own} instead." if own else f"Leave {name!r} out: Ray accounts for it itself.")
        if name.startswith("accelerator_type:"):
            fail("resources_per_worker", request, f"{name!r} names a GPU type",
                 f"Set accelerator_type={name.split(':', 1)[1]!r} instead.")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < float("inf"):
            fail("resources_per_worker", request, f"the amount of {name!r} must be a positive number",
                 f'Write e.g. {{"{name}": 1}}.')
    if cfg.accelerator_type is not None:
        if not isinstance(cfg.accelerator_type, str) or not cfg.accelerator_type.strip():
            fail("accelerator_type", cfg.accelerator_type, "must be a GPU type's name or None",
                 "Set it as Ray names the type, e.g. 'A100' or 'H100', or leave it unset.")
        if not cfg.use_gpu:
            fail("accelerator_type", cfg.accelerator_type, "needs use_gpu=True (it chooses the GPU type)",
                 "Set use_gpu=True, or leave accelerator_type unset.")
    labels = cfg.label_selector
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        fail("label_selector", labels, "must be a mapping of label names to values, both strings",
             'Write it as {"market-type": "spot"}.')


def _check_balance(cfg) -> None:
    if isinstance(cfg.balance, tuple):
        if not cfg.balance or not all(is_int(n) and n > 0 for n in cfg.balance):
            fail("balance", cfg.balance, "an explicit split must list a positive block count per stage",
                 "E.g. [3, 2] puts 3 blocks on the first stage and 2 on the second.")
    elif not isinstance(cfg.balance, str) or cfg.balance not in ("params", "time"):
        fail("balance", cfg.balance, "must be 'params', 'time' or a list of block counts",
             "Use balance='params' for the default split.")


def _check_shapes(cfg) -> None:
    shape = cfg.input_shape
    if shape is not None and not (isinstance(shape, tuple) and shape and all(is_int(d) and d > 0 for d in shape)):
        fail("input_shape", shape, "must be a list of positive integers", "E.g. [1, 28, 28].")


def _check_validation(cfg) -> None:
    """``val_fraction``: a fraction of the training split, held out before it is sharded (loader or stream)."""
    if cfg.val_fraction is None:
        return
    check_number(cfg, "val_fraction", 0, 1, low_open=True, fix="Hold out e.g. val_fraction=0.1 of the training split.")


def _check_watching(cfg) -> None:
    """``loggers`` (distinct ``Logger`` names), ``mlflow_tracking_uri``, ``callbacks`` (``config_code``)."""
    valid = typing.get_args(typing.get_args(typing.get_type_hints(type(cfg))["loggers"])[0])
    loggers = cfg.loggers
    if not isinstance(loggers, list) or not all(isinstance(n, str) and n in valid for n in loggers):
        fail("loggers", loggers, f"must be a list of {list(valid)}",
             "Write e.g. loggers=['tensorboard', 'csv'] (CLI: --loggers tensorboard csv).")
    if len(set(loggers)) != len(loggers):
        fail("loggers", loggers, "names a logger twice", "List each logger once.")
    uri = cfg.mlflow_tracking_uri
    if uri is not None and (not isinstance(uri, str) or not uri.strip()):
        fail("mlflow_tracking_uri", uri, "must be a non-empty URI or None",
             "Write e.g. http://mlflow:5000 or file:/data/mlruns, or leave it unset for <run>/mlruns.")
    check_callbacks(cfg.callbacks)
