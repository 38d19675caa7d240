"""The public entry point: ``fit(TrainConfig) -> TrainResult``.

``fit`` checks everything it can before asking Ray for anything (config, data files,
whether the run fits the cluster, whether an existing run of the same name can be
resumed), then runs the strategy's runner: Ray Train workers for the data-parallel
family, the pipeline's own actor group for ``pipeline``/``ddp_pipeline``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn

from raytrain_mgpu.engine.batches import as_shape, shape_record
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.engine import devices
from raytrain_mgpu.transports import ray_data
from raytrain_mgpu.config.factories import check_objects_ship, code_name, is_factory, load_factory, send_objects_by_value
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.driver.cluster import check_placeable, connect, keep_ray_started
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import check_data
from raytrain_mgpu.data.ray_datasets import take as take_ray_datasets
from raytrain_mgpu.engine.weights import load_weights, read_weights
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.lora import apply_lora
from raytrain_mgpu.planning.auto import RESUMING, previous_layout, resolve_auto
from raytrain_mgpu.planning.auto_devices import resolve_auto_devices
from raytrain_mgpu.planning.compare import compare as compare_with
from raytrain_mgpu.strategies.elastic import describe_range
from raytrain_mgpu.strategies.plan import RunPlan, build_plan
from raytrain_mgpu.driver.preflight import (check_data_fits, check_model_builds, check_run_folder,
                                              check_storage_reachable)
from raytrain_mgpu.driver.rerun import describe_changes, training_changes
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.driver.rerun import check_resume
from raytrain_mgpu.engine.run_state import stops_early
from raytrain_mgpu.driver.runlock import RunLock
from raytrain_mgpu.driver.progress import ProgressPrinter
from raytrain_mgpu.driver.callbacks import RunEvents, RunInfo, load_callbacks
from raytrain_mgpu.driver.export import export_run
from raytrain_mgpu.driver.loggers import build_loggers
from raytrain_mgpu.driver.goodput import Ledger, read_ledger
from raytrain_mgpu.strategies import get_strategy
from raytrain_mgpu.transports import carrier
from raytrain_mgpu.transports.base import runner_for

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run leaves behind. ``metrics`` is the last epoch's entry of ``history``;
    ``best_checkpoint_path`` the checkpoint of the best ``monitor`` epoch (with ``keep_best``)."""

    config: TrainConfig
    history: List[dict]
    checkpoint_path: Optional[str]
    path: str
    startup: dict = field(default_factory=dict)
    """Where this call's time to the first step went, in seconds (the Ray Train runner's; empty for the
    pipeline and for a run answered from its folder): ``checks_s`` (fit's checks before Ray), ``ray_s``
    (connecting to or starting Ray), ``worker_group_s`` (Ray Train's controller and workers, to rank 0's
    train function), ``setup_s`` (rank 0's data, model and resume, to its first step), ``first_step_s``
    (their sum: from the call to the first step)."""
    goodput: dict = field(default_factory=dict)
    """Where the run's wall time went, in seconds by kind, across its attempts and the ``fit`` calls that trained it
    (``driver/goodput.py``; ``raytrain-mgpu goodput RUN`` reads the same from its folder): ``productive``, ``redone``
    (steps trained again after a failure), ``startup``, ``checkpoint``, ``eval``, ``data_wait``, ``restart``, which
    add up to ``wall``; and ``step_s``, ``checkpoint_s``, ``interval_s``, ``startup_s``, ``restart_s``, ``saves``,
    ``restarts``, ``redone_steps``. Not in ``history``, whose rows are the epochs' as the ranks sent them."""
    metrics: dict = field(init=False)
    best_checkpoint_path: Optional[str] = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = self.history[-1] if self.history else {}
        best = RunFolder(self.path).best_checkpoint() if self.config.keep_best else None  # reads meta.json files
        self.best_checkpoint_path = None if best is None else best.uri

    def load_model(self, best: bool = False) -> nn.Module:
        """The trained model, weights from the last checkpoint (``best``: the best epoch's), on CPU, unwrapped (with
        ``lora``: a ``peft.PeftModel``, the base from its folder and the checkpoint's adapters)."""
        path = self.best_checkpoint_path if best else self.checkpoint_path
        if path is None and best:
            raise ValueError(f"run {self.config.name!r} has no best checkpoint: it is kept with keep_best=True and "
                             f"monitor set (monitor={self.config.monitor!r}, keep_best={self.config.keep_best}). "
                             f"Train with them, or call load_model() for the last checkpoint.")
        if path is None:
            raise ValueError(f"run {self.config.name!r} has no checkpoint to load.")
        with ckpt_format.local_checkpoint(path) as directory:
            meta = ckpt_format.read_meta(directory)
            state = ckpt_format.load_model_state(directory)
        with torch.random.fork_rng(devices=[]):  # built on the run's seed, as training built it; the caller's stream kept
            torch.manual_seed(self.config.seed)
            model = build_model(self.config.model, as_shape(meta["input_shape"]), meta["num_classes"],
                                self.config.model_kwargs, pretrained=True)  # an hf: model's base weights
            if self.config.lora is not None:  # a peft.PeftModel: the adapters' A drawn as training drew it
                torch.manual_seed(self.config.seed)
                model = apply_lora(model, self.config.lora)
        if self.config.save == "trainable":  # the frozen weights: from init_from (or the builder), as training had
            if self.config.init_from is not None:
                load_weights(model, read_weights(self.config.init_from)[0], self.config.init_strict,
                             self.config.init_from)
            model.load_state_dict(state, strict=False)
        else:
            model.load_state_dict(state)
        return model.eval()

    def export(self, out: Optional[str] = None, format: str = "safetensors", best: bool = False) -> List[str]:
        """The trained model (the last checkpoint's, or the best's) as ``model.safetensors`` with ``config.json`` beside
        it (``format="safetensors"``), a Hugging Face model's ``save_pretrained`` folder (``format="hf"``; LoRA's
        adapters merged, an ``hf:`` model's tokenizer beside it), or LoRA's adapter folder (``format="peft"``), in
        ``out`` (default ``<run>/export``); consolidated on this machine, also from a sharded (fsdp) run. The written
        paths. The CLI's ``raytrain-mgpu export RUN`` is the same."""
        # this config's model (code from Python too), with its adapters
        model = self.load_model(best=best) if format in ("hf", "peft") else None
        return export_run(self.path, out=out, fmt=format, best=best, model=model)


def fit(cfg: TrainConfig, stream=None) -> TrainResult:
    """Train ``cfg``; resumes if ``cfg.storage_path``/``cfg.name`` already holds a checkpoint.

    ``use_gpu``/``num_workers`` ``"auto"`` (the defaults) are resolved first, from the GPUs found
    (``planning/auto_devices.py``), and the banner says what was found and chosen.
    ``strategy="auto"`` is resolved once Ray is connected (it reads the cluster's devices);
    the choice and its reason are printed, logged, and added to every history row.
    ``cfg.loggers`` and ``cfg.callbacks`` see the run's events (``driver/callbacks.py``).
    """
    called = time.time()  # the start-up's clock (rank 0 reports its own times on this clock: time.time())
    cfg = take_ray_datasets(cfg)  # Ray Datasets from Python: counted and peeked here, streamed by Ray Train
    # use_gpu/num_workers "auto": the GPUs found (joins the cluster only where one is named or up) and the
    # strategy's layout on them; everything below sees concrete values
    cfg, devices_line = resolve_auto_devices(cfg)
    if is_factory(cfg.model):
        load_factory(cfg.model, "model")  # a user module that does not import fails here, not on workers
    send_objects_by_value(cfg)  # the user's own modules' objects, as __main__'s: the controller cannot import them
    check_objects_ship(cfg)  # a class or function from Python that cannot be pickled, named before Ray
    cfg, watchers = _watchers(cfg)  # a callback that does not import, or a logger not installed, fails before Ray
    input_shape, num_classes = check_data(cfg.data)  # missing/corrupt files fail before Ray
    check_model_builds(cfg, input_shape, num_classes)  # on meta: a factory that raises fails here, named
    data_info = {"input_shape": shape_record(input_shape), "num_classes": num_classes,
                 "train_split_size": check_data_fits(cfg, num_classes)}  # >= 2 classes, batch <= split
    lock = RunLock.acquire(_run_path(cfg))  # a second driver on this run folder is refused
    events = None
    try:
        auto_record = {}
        if cfg.strategy == "auto":
            previous = previous_layout(cfg)  # a resumed (or finished) auto run keeps its layout: no Ray needed
            if previous:
                cfg, auto_record = cfg.replace(**previous), {"auto_strategy": previous["strategy"],
                                                             "auto_reason": RESUMING}
            else:  # a fresh one meets check_run_folder once Ray has chosen its layout: resume="must" is said now
                folder = RunFolder.of(cfg)
                check_resume(cfg, folder.display, folder.newest_checkpoint())
        if cfg.strategy != "auto":  # a fresh auto run: the same checks run on its choice, below
            get_strategy(cfg.strategy).check_model(cfg, input_shape, num_classes)  # e.g. mp: more devices than blocks
            check_run_folder(cfg, data_info)  # checkpoints trained with other settings, whichever runner wrote them
            stored = _stored_result(cfg, stream)  # a finished run is answered from its folder: no Ray, no worker
            if stored is not None:
                return stored
        checked = time.time()
        runner = "ray"
        if cfg.strategy != "auto":
            plan = build_plan(cfg, data_info["train_split_size"])  # derived once, handed down
            runner = runner_for(cfg, plan)  # TrainConfig.runner: in this process where nothing needs Ray
        if runner == "ray":
            started = connect(cfg.address, cfg.verbose, local_has_gpu_check=cfg.use_gpu)
            keep_ray_started(started)  # the next fit in this process finds it up
        connected = time.time()
        if cfg.strategy == "auto":
            # validated and model-checked; auto_measure times the candidates with `compare`
            # (this module's: planning never imports the api)
            cfg, auto_record = resolve_auto(cfg, compare=compare)
            check_run_folder(cfg, data_info)
            plan = build_plan(cfg, data_info["train_split_size"])
            runner = runner_for(cfg, plan)  # Ray is up already; the run itself may still need none of it
        ingest_line = None  # where Ray Data's tasks run, for a stream (the banner's line)
        if runner == "ray":
            if plan.runner == "train_workers":  # the pipeline runner checks its stage actors, the fix in its terms
                check_placeable(list(plan.bundles), cfg.use_gpu, f"strategy={cfg.strategy!r}",
                                labels=cfg.label_selector, group_size=plan.tensor_group_size,
                                groups_may_span=cfg.tensor_parallel_across_nodes)
            ingest_line = ray_data.check_cpus_left(cfg, plan)  # Ray Data's tasks need CPUs beside the bundles
            check_storage_reachable(cfg.storage_path)  # multi-node: every node must see storage_path
        events = RunEvents(ProgressPrinter(cfg.epochs, stream), watchers)  # what every runner reports to
        if devices_line:
            events.banner(f"devices: {devices_line}")
        if auto_record:
            events.banner(f"strategy=auto chose {auto_record['auto_reason']}")
        events.banner(_banner(cfg, plan, input_shape, num_classes, runner))
        if ingest_line:
            events.banner(ingest_line)
        events.train_start(_run_info(cfg))
        # every transport tells the ledger of its attempts (transports/retry.run_attempts, the progress channel)
        events.goodput = ledger = Ledger(RunFolder.of(cfg), started=called)
        try:  # the in-process runner, Ray Train's workers or the pipeline's actor group: one call, one result
            history, checkpoint_path, rank0 = carrier(runner, plan)(cfg, plan, events)
        finally:
            ledger.close()  # goodput.json: what it knew, also of a failed run
        startup = _startup(called, checked, connected, rank0)
        run_path = _run_path(cfg)
        history = _stamp_auto(history, auto_record, run_path)
        _write_history(history, run_path)
        result = TrainResult(cfg, history, checkpoint_path, run_path, startup, ledger.summary(history))
        events.train_end(result)
        return result
    finally:
        if events is not None:
            events.close()  # the loggers' files and MLflow run, also after a failure
        lock.release()


def _watchers(cfg: TrainConfig):
    """The loggers and callbacks as ``(label, callback)``, and ``cfg`` without callback objects:
    the config is shipped to workers and recorded in checkpoints, where only names travel."""
    watchers = build_loggers(cfg) + load_callbacks(cfg.callbacks)
    if any(not isinstance(entry, str) for entry in cfg.callbacks):
        cfg = cfg.replace(callbacks=[entry for entry in cfg.callbacks if isinstance(entry, str)])
    return cfg, watchers


def _run_info(cfg: TrainConfig) -> RunInfo:
    state = RunFolder.of(cfg).state()  # the checkpoint this fit resumes from, if any
    return RunInfo(config=redact(cfg.to_dict()), path=_run_path(cfg), resumed=state.checkpoint is not None,
                   start_epoch=state.epoch, start_step=state.step)


def _banner(cfg: TrainConfig, plan: RunPlan, input_shape, num_classes, runner: str = "ray") -> str:
    device = f"{plan.devices_per_worker} GPU" if cfg.use_gpu else f"{cfg.cpus_per_worker} CPU"
    if cfg.use_gpu and devices.is_emulated():
        device += f" (emulated by {devices.EMULATE_ENV}: computed on CPU with gloo)"
    elif not cfg.use_gpu and plan.devices_per_worker > 1:  # dp, dp_balanced, mp, ddp2, ddp_mp on CPU
        device += f" ({plan.devices_per_worker} CPU stand-in devices)"
    outputs = f"{num_classes} classes" if num_classes is not None else "outputs (no classes)"
    where = "in this process" if runner == "local" else (
        "Ray actor group" if plan.runner == "actor_group" else "Ray Train workers")
    return (f"raytrain-mgpu: {code_name(cfg.model)} on {code_name(cfg.dataset)} {as_shape(input_shape)} -> {outputs} | "
            f"strategy {cfg.strategy}, {describe_range(cfg)} worker(s) x {device}, {where} | {plan.describe()} | "
            f"lr {cfg.optim.scaled_lr():g} | precision {cfg.precision} | run {redact(_run_path(cfg))}")


def _startup(called: float, checked: float, connected: float, rank0: Optional[dict]) -> dict:
    """``TrainResult.startup`` from the driver's times and rank 0's (``WorkerReporter.startup``: its
    train function's entry and its first step, on its node's clock; none if it never got that far)."""
    if not rank0:
        return {}
    parts = {"checks_s": checked - called, "ray_s": connected - checked,
             "worker_group_s": rank0["entered"] - connected, "setup_s": rank0["first_step"] - rank0["entered"]}
    return {**parts, "first_step_s": rank0["first_step"] - called}


def _run_path(cfg: TrainConfig) -> str:
    return RunFolder.of(cfg).uri


def _stamp_auto(history: list, auto_record: dict, run_path: str) -> list:
    """``strategy="auto"``'s choice and reason on the rows this call trained; a row an earlier call
    trained (the same epoch and attempt in the history it wrote) keeps what that call recorded (the
    reason it chose, not this resume's "keeps the strategy it started with")."""
    if not auto_record:
        return history
    earlier = {(row.get("epoch"), row.get("attempt")): row for row in RunFolder(run_path).read_history() or []}
    stamped = []
    for row in history:
        before = earlier.get((row.get("epoch"), row.get("attempt")), {})
        record = {key: before[key] for key in auto_record if before.get(key) is not None} or auto_record
        stamped.append({**row, **record})
    return stamped


def _write_history(history: list, run_path: str) -> None:
    RunFolder(run_path).write_history(history)  # atomically: a crash leaves the previous history


def _stored_result(cfg: TrainConfig, stream=None) -> Optional[TrainResult]:
    """The stored result of a run whose newest checkpoint says it is finished (all ``epochs``,
    or ``max_steps``), read from its folder in about a second; None when there is training to do.

    A finished run started with settings that would change its training is refused, naming them: its
    result would not be of them. A resume may change them (that is how a run is extended): one line names them."""
    folder = RunFolder.of(cfg)
    state = folder.state()
    if state.checkpoint is None:
        return None
    # _left_auto: the fields the user left "auto" that fit resolved (the devices found); the run's are its own
    changes = training_changes(cfg, state.meta.get("config") or {}, getattr(cfg, "_left_auto", ()))
    if not state.finished(cfg):
        if changes:
            ProgressPrinter(cfg.epochs, stream).banner(
                f"raytrain-mgpu: run {folder.display} resumes after epoch {state.epoch}, step {state.step} with "
                f"settings changed since its checkpoint: {describe_changes(changes)}; the steps from here use them.")
        return None
    stopped = stops_early(state.history, cfg)
    more = "early_stopping_patience" if stopped else "epochs (or max_steps)"
    if changes:  # before anything starts: the user learns now that the new values would not be used
        where = f"epoch {state.epoch}, step {state.step}" + (", stopped early" if stopped else "")
        raise ValueError(
            f"run {folder.display!r} is already finished ({where}), and this config would train it with other "
            f"settings: {describe_changes(changes)}. A finished run is answered from its folder, so these would not "
            f"be used. Use another `name` (--name) for a new run with them, or raise {more} to continue this run "
            f"with the new values.")
    why = (f"stopped early: {cfg.monitor} did not improve for early_stopping_patience={cfg.early_stopping_patience} "
           f"evaluated epoch(s). Raise {more}") if stopped else f"Raise {more}"
    history = folder.read_history()
    if not history or history[-1].get("step") != state.step:  # killed before history.parquet was written
        history = state.history
    ProgressPrinter(cfg.epochs, stream).banner(
        f"raytrain-mgpu: run {folder.display} is already finished (epoch {state.epoch}, step {state.step}); "
        f"nothing to train. {why} to train it further, or use another name for a new run.")
    try:
        goodput = read_ledger(folder.uri)
    except FileNotFoundError:  # trained before the ledger was kept
        goodput = {}
    return TrainResult(cfg, history, state.checkpoint, folder.uri, goodput=goodput)


def compare(cfg: TrainConfig, strategies: Optional[List[str]] = None, steps: int = 20, warmup_steps: int = 5,
            memory_budget_bytes=None, out_dir: Optional[str] = None, *, storage_path: Optional[str] = None,
            batch_search: Optional[str] = None, stream=None):
    """Run ``cfg`` under each strategy (default: all that can run here) and report side by side:
    :func:`raytrain_mgpu.planning.compare.compare` with each run trained by :func:`fit`.

    ``memory_budget_bytes``: per-device budget for the largest-batch column, bytes or a
    size such as ``"24GiB"`` (default: ``cfg.memory_budget_bytes``, else the GPU's memory;
    none on CPU). ``out_dir``: where the Markdown, Parquet and PNG go
    (default ``<storage_path>/compare-<time>``). ``stream``: where each run's progress
    lines go (default: nowhere).
    """
    return compare_with(cfg, strategies, steps, warmup_steps, memory_budget_bytes, out_dir,
                        storage_path=storage_path, batch_search=batch_search, stream=stream, fit=fit)
