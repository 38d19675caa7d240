"""The engine's checkpoints: what every rank writes and reads back, one format and one naming for every
transport (``checkpointing/files.py`` describes the files).

A save (:class:`Saver`), the same on every rank, whatever carries it:

1. the checkpoint store gives this rank a folder (``CheckpointStore.begin``, ``checkpointing/store.py``: a Ray
   Train run's own local folder, or the run folder's temporary one);
2. the step runner writes this rank's part into it: the whole model and optimizer (a data-parallel rank
   0: ``model.pt``, ``train_state.pt``), a pipeline stage's (``model-stage{p}.pt``,
   ``train_state-stage{p}.pt``), or every rank its shards (``sharded/``, fsdp);
3. one collective gathers every rank's random generators (CPU and every CUDA device), a step checkpoint's
   partial epoch sums and rank 0's verdict on ``keep_best``;
4. rank 0 adds the run's common train state (LR schedule, grad scaler, the generators, the partial sums)
   to ``train_state.pt``, the history to ``history.json`` (after adding the save's time to the row's
   ``checkpoint_s``) and sends the epoch's row to the driver;
5. the store commits it (``meta.json`` last, published in the run folder or reported to Ray Train, the best
   copy, pruning).

Names: ``checkpoint_epoch{E:06d}`` after epoch E, ``checkpoint_epoch{E:06d}_step{S:09d}`` for a step
checkpoint after global step S of the epoch after E: names sort by age, and ``num_checkpoints_to_keep``
keeps the newest N of both kinds. A restore (:func:`read`) reads ``meta.json``, the history, the model
(merged from its parts: ``model.pt`` and every ``model-stage{p}.pt``), the common train state and this
rank's part; checkpoints of the pipeline runner's earlier layout (no common ``train_state.pt``: the LR
schedule in each stage's part) still resume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import NamedTuple, Optional

import torch

from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.engine.metrics import all_gather_objects
from raytrain_mgpu.config.code import monitor_mode
from raytrain_mgpu.engine.run_state import RunState, best_row, checkpoint_meta
from raytrain_mgpu.engine.step import NonFiniteError
from raytrain_mgpu.checkpointing.preemption import SaveClock
from raytrain_mgpu.checkpointing.step_checkpoints import STEP_IN_EPOCH
from raytrain_mgpu.engine import optim
from raytrain_mgpu.models import build_model as build_named_model
from raytrain_mgpu.models.checkpointing import checkpoint_blocks
from raytrain_mgpu.models.lora import apply_lora

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_name", "CHECKPOINT_PREFIX", "PARTIALS", "Restored", "Commit", "read", "build_model",
           "build_optimizer", "build_scheduler", "load_train_state", "restore_rng", "rng_state", "seed_rank_stream",
           "Saver"]

CHECKPOINT_PREFIX = "checkpoint_epoch"
ASYNC_SHARDED_ENV = "RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE"
"""Set to 1 for DCP's asynchronous save of a sharded (fsdp) checkpoint (the shards copied to host memory, written in
a thread while training goes on); unset, the save writes before training goes on. Measured on one H200 (docs/
performance.md): with an fsdp transformer LM and a checkpoint every epoch the asynchronous save stalled training 5.3 s an
epoch against 2.7 s for the synchronous one (its thread's write outlasted the steps to the next save), so the
synchronous save is the default. The driver's value reaches every worker (``driver/cluster.worker_env_vars``);
``jobs/fsdp_checkpoint_stall.py`` measures both."""
PARTIALS = "epoch_partial_per_rank"
"""A step checkpoint's train state key: every rank's sums of the unfinished epoch, in rank order."""


def checkpoint_name(epochs_done: int, step: Optional[int] = None) -> str:
    """``checkpoint_epoch{E}`` after epoch E, or a step checkpoint's inside the next epoch."""
    name = f"{CHECKPOINT_PREFIX}{epochs_done:06d}"
    return name if step is None else f"{name}_step{step:09d}"


# ----------------------------------------------------------------------------- building


def seed_rank_stream(seed: int, rank: int, step: int = 0) -> None:
    """Seed this rank's CPU and CUDA generators: distinct per rank, and per step when re-seeding a resume."""
    torch.manual_seed((seed + 1 + rank) + 1_000_003 * step)


def build_model(cfg, steps, data) -> torch.nn.Module:
    """The initial model, the same on every rank (the run's seed); then each rank's own random stream
    (with the shared seed every rank would draw the same dropout masks: R copies of one mask)."""
    torch.manual_seed(cfg.seed)
    # fsdp's ranks other than 0 build on meta (no memory): rank 0's weights reach their shards. An hf: model's
    # weights are read from its folder here (pretrained), by every rank that builds off meta (models/huggingface.py).
    with torch.device("meta") if steps.build_on_meta() else contextlib.nullcontext():
        model = build_named_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs, pretrained=True)
        if getattr(cfg, "lora", None) is not None:  # before the strategy wraps it; A drawn from the seed alone
            torch.manual_seed(cfg.seed)
            model = apply_lora(model, cfg.lora)
    if cfg.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    steps.checkpointed_blocks = checkpoint_blocks(model, cfg.activation_checkpointing)
    seed_rank_stream(cfg.seed, steps.ctx.world_rank)
    return model


def build_optimizer(cfg, steps) -> torch.optim.Optimizer:
    """Over the trainable parameters (frozen ones left out), in ``param_groups``' groups where it names them."""
    if cfg.param_groups is not None:
        return optim.build_optimizer(optim.param_groups(steps.named_model(), cfg.param_groups, cfg.weight_decay),
                                     cfg.optim)
    params = [p for p in steps.parameters() if p.requires_grad]
    if not params and steps.may_hold_no_parameters:
        # A pipeline stage of parameter-free blocks (a Flatten, a pooling; balance="time" can choose one): nothing
        # to step, but the schedule's scheduler, grad scaler and checkpoint all expect an optimizer. An empty
        # parameter (never a gradient) gives it one that steps nothing.
        params = [torch.nn.Parameter(torch.zeros(0))]
    return optim.build_optimizer(params, cfg.optim)


def build_scheduler(cfg, optimizer, steps_per_epoch: int):
    return optim.build_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.epochs)


# ----------------------------------------------------------------------------- reading


class Restored(NamedTuple):
    """What a rank resumes from: the run state, and (with a checkpoint) the model and train state."""

    state: RunState
    model_state: Optional[dict] = None
    train_state: Optional[dict] = None  # the common one with this rank's part (its optimizer) on top
    source: object = None               # the store's CheckpointSource (a sharded one is read again)
    sharded: bool = False


def read(cfg, source, steps, rank: int) -> Restored:
    """This rank's view of the checkpoint ``source`` (the store's ``CheckpointSource``; None: a new run)."""
    if source is None:
        return Restored(RunState())
    with source.open() as directory:
        meta = ckpt_format.read_meta(directory)
        ckpt_format.check_resumable(meta, cfg.model, cfg.strategy, directory)
        sharded = ckpt_format.is_sharded(directory)
        if sharded and not steps.sharded:
            written = (meta.get("config") or {}).get("tensor_parallel_size", 1)
            raise ValueError(
                f"checkpoint {directory!r} holds every rank's shards (strategy={meta.get('strategy')!r} with "
                f"tensor_parallel_size={written}), which this run's layout (tensor_parallel_size="
                f"{getattr(cfg, 'tensor_parallel_size', 1)}) saves and reads whole. Resume with "
                f"tensor_parallel_size={written}, or start a new run (another `name`) from its weights: "
                f"init_from={source.path!r}.")
        # a meta model holds no data: rank 0 sends its weights; a sharded one is read once sharded
        model_state = None if sharded or steps.build_on_meta() else ckpt_format.load_model_state(directory)
        common = ckpt_format.load_train_state(directory) or {}
        part = ckpt_format.load_train_state(directory, steps.part) if steps.part else None
        if steps.part and part is None:
            raise ValueError(f"checkpoint {directory!r} has no train_state{steps.part}.pt; it was not written by "
                             f"a run with this layout. Use another `name` for a new run.")
        history = ckpt_format.read_history(directory)
    state = RunState.resumed(meta, history, source.path)
    train_state = {**common, **(part or {})}
    if PARTIALS not in train_state and meta.get(PARTIALS) is not None:  # the pipeline's earlier layout
        train_state[PARTIALS] = None  # its partial sums are of another shape: the row counts the rest only
    if rank == 0:
        logger.info("resuming %s from epoch %d, step %d", cfg.name, state.epoch, state.step)
    return Restored(state, model_state, train_state, source, sharded)


def load_train_state(steps, optimizer, scheduler, scaler, restored: Restored) -> None:
    """Optimizer, LR schedule and grad scaler from the checkpoint (a sharded one's model and optimizer shards
    too: every rank reads the pieces its shards cover). The optimizer's hyperparameters stay this config's
    (:func:`_keep_configured`): a resume that changes ``lr`` or ``weight_decay`` trains on with them."""
    configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    train_state = restored.train_state
    if restored.sharded:  # written by this strategy (check_resumable)
        with restored.source.open() as directory:
            steps.load_sharded(optimizer, os.path.join(directory, ckpt_format.SHARDED_DIR))
    else:
        try:
            steps.load_optimizer(optimizer, train_state)
        except ValueError as exc:  # torch: the saved groups' parameter counts are not this optimizer's
            raise ValueError(
                f"checkpoint {restored.state.checkpoint!r}: its optimizer state does not fit this model's parameters "
                f"({exc}): the model's parameters changed since it was written (e.g. transformer_lm's attention, "
                f"once one fused qkv, now q/k/v). Start a new run (another `name`) from its weights: "
                f"init_from={restored.state.checkpoint!r}.") from exc
    scheduler.load_state_dict(train_state["scheduler"])
    _keep_configured(optimizer, scheduler, configured)
    if "scaler" in train_state:
        scaler.load_state_dict(train_state["scaler"])


def _keep_configured(optimizer, scheduler, configured: list) -> None:
    """Put this config's hyperparameters (``configured``: each group's options as built) back after a load.

    torch's ``load_state_dict`` restores the saved ones too (each group's lr, weight decay, betas, ...; the
    schedule's ``base_lrs``), so a resume with another ``lr`` trained silently with the old one. The state
    (moments, step counts) and the schedule's position stay the checkpoint's; the lr is this config's at that
    position, as the schedule's next step computes it. With the settings unchanged nothing changes: the same
    values, computed the same way."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return  # the user's own scheduler (lr_schedule) owns the options it moves (OneCycleLR's momentum too): as saved
    for group, options in zip(optimizer.param_groups, configured):
        group.update(options)
    scheduler.base_lrs = [options["initial_lr"] for options in configured]
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # get_last_lr()'s: LambdaLR keeps it so


def rng_state() -> dict:
    """This rank's generators as ByteTensors (loadable with ``weights_only=True``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def restore_rng(restored: Restored, seed: int, ctx, step: int) -> None:
    """This rank's saved generators, CPU and every CUDA device (once the model is set up: nothing after this
    draws before training); a different world size (or a checkpoint without them) re-seeds per rank and step."""
    if restored.train_state is None:
        return
    states = restored.train_state.get("rng_per_rank")
    if not states or len(states) != ctx.world_size:
        if ctx.world_rank == 0:
            logger.info("RNG states saved for %s ranks, %d now: re-seeding each rank's stream at step %d",
                        len(states) if states else "no", ctx.world_size, step)
        seed_rank_stream(seed, ctx.world_rank, step)
        return
    own = states[ctx.world_rank]
    torch.set_rng_state(own["cpu"])
    if own["cuda"] and torch.cuda.is_available() and len(own["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(own["cuda"])


# ----------------------------------------------------------------------------- writing


class Commit(NamedTuple):
    """One rank's finished part of a checkpoint, handed to its store (``CheckpointStore.commit``)."""

    name: str
    directory: str              # this rank's folder (``CheckpointStore.begin``)
    metrics: dict               # what the rank reports with it (the epoch's row, or where the step stands)
    meta: Optional[dict]        # rank 0: meta.json, written last by the store
    is_best: bool               # keep_best: this epoch is the best so far (the same on every rank)
    best_model: Optional[dict]  # rank 0 of a sharded run: the gathered model for the best copy
    writing: object             # a Future while the sharded save still writes (asynchronous), else None
    step: bool                  # a step checkpoint (inside an epoch)
    final: bool                 # the run's last save


class Saver:
    """A rank's saves (see the module docstring); ``save`` on every rank at the same points. It is handed what it
    saves: the step runner (the model, and this rank's files of it), the optimizer, LR schedule and grad scaler, the
    run state, and the checkpoint ``store`` its transport gave; ``reporter``: rank 0's events (None elsewhere);
    ``shape_info``: the data's shape and classes for ``meta.json``."""

    def __init__(self, cfg, steps, store, reporter, shape_info: dict, state: RunState, optimizer, scheduler, scaler):
        self.cfg, self.steps, self.store, self.reporter, self.shape_info = cfg, steps, store, reporter, shape_info
        self.state, self.optimizer, self.scheduler, self.scaler = state, optimizer, scheduler, scaler
        self.rank = steps.ctx.world_rank
        # this rank's clock of the last checkpoint and each save's stall (checkpoint_every_n_minutes, "auto": the MTBF
        # is the run's, over the devices its workers compute on: GPUs, emulated ones, or one CPU a worker)
        self.since_save = SaveClock(num_devices=steps.ctx.world_size * len(steps.ctx.devices))

    def save(self, metrics: dict, partial: Optional[dict] = None, send_row: bool = False) -> None:
        """``metrics``: the epoch's row (``send_row``: rank 0 adds this save's time to its ``checkpoint_s`` and
        sends it to the driver) or, for a step checkpoint, where it stands with ``partial`` this rank's sums."""
        cfg, state, steps, store = self.cfg, self.state, self.steps, self.store
        started = time.perf_counter()
        step, final = partial is not None, state.finished(cfg)
        is_best = (self.rank == 0 and cfg.keep_best and not step
                   and best_row(state.history, cfg.monitor, monitor_mode(cfg)) is state.history[-1])
        # One collective for all: every rank's random generators and partial sums, rank 0's verdict on keep_best,
        # and whether every rank's weights are finite (a checkpoint of non-finite weights is never written).
        gathered = all_gather_objects((rng_state(), partial, is_best, steps.weights_finite()))
        if not all(finite for *_, finite in gathered):
            self._not_finite(metrics, [rank for rank, (*_, finite) in enumerate(gathered) if not finite], send_row)
            return
        is_best = gathered[0][2]
        name = checkpoint_name(state.epoch, state.step if step else None)
        directory = store.begin(name, metrics, step=step, final=final, sharded=steps.sharded)
        try:
            writing, files = None, {}
            if steps.sharded:  # collective; asynchronous with the upload: training waits for the copy to host only
                asynchronous = os.environ.get(ASYNC_SHARDED_ENV) == "1" and store.asynchronous(step, final)
                writing = steps.write_sharded(self.optimizer, os.path.join(directory, ckpt_format.SHARDED_DIR),
                                              asynchronous=asynchronous)
            else:
                files = steps.checkpoint_files(self.optimizer)
            best_model = steps.model_state() if steps.sharded and is_best else None  # collective: to rank 0
            meta = None
            if self.rank == 0:
                common = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                          "rng_per_rank": [rng for rng, *_ in gathered]}
                if step:
                    common[PARTIALS] = [part for _, part, *_ in gathered]
                files.setdefault("train_state.pt", {}).update(common)
                extra = {STEP_IN_EPOCH: state.step_in_epoch} if step else {}
                if steps.sharded:
                    extra[ckpt_format.SHARDED_KEY] = True
                meta = checkpoint_meta(cfg, state, self.shape_info, **extra, **steps.meta_extra())
            _written(directory, name, lambda: ckpt_format.write_files(directory, files))
            if self.rank == 0:
                if send_row:
                    metrics["checkpoint_s"] = metrics.get("checkpoint_s", 0.0) + time.perf_counter() - started
                _written(directory, name, lambda: ckpt_format.write_checkpoint(directory, meta=None,
                                                                               history=state.history))
        except BaseException as exc:
            store.abort(exc)
            raise
        reported = None
        if self.rank == 0 and send_row and self.reporter is not None:
            try:
                self.reporter.epoch(metrics)  # the progress line, before the checkpoint's announcement
            except BaseException as exc:  # a user's callback raised (in-process): the checkpoint is published first
                reported = exc
        store.commit(Commit(name, directory, metrics, meta, is_best, best_model, writing, step, final))
        self.since_save.saved(time.perf_counter() - started)  # the training thread's stall for this save
        if reported is not None:
            raise reported

    def _not_finite(self, metrics: dict, ranks: list, send_row: bool) -> None:
        """Weights that are not finite are never checkpointed: ``on_nonfinite="stop"`` (and ``skip``, which should
        never get here) stops the run; ``ignore`` trains on without this checkpoint, saying so."""
        state, reporter = self.state, self.reporter
        if self.cfg.on_nonfinite != "ignore":
            raise NonFiniteError("the weights are not finite", state.epoch + (0 if send_row else 1), state.step, ranks)
        if send_row and reporter is not None:
            reporter.epoch(metrics)
        if reporter is not None:
            reporter.notice(f"checkpoint at step {state.step} not written: the weights are not finite on "
                              f"rank(s) {', '.join(map(str, ranks))} (on_nonfinite='ignore')")


def _written(directory: str, name: str, write) -> None:
    """``write()`` into ``directory``; a failure (disk full, permission) names the checkpoint, the folder and the
    cause. Nothing was published yet: the previous checkpoint is untouched and a resume starts from it."""
    try:
        write()
    except OSError as exc:
        raise OSError(exc.errno, f"writing checkpoint {name} into {directory} failed ({exc.strerror or exc}); the "
                                 f"previous checkpoint is intact and a run started again resumes from it. Free space "
                                 f"or fix the folder's permissions.") from exc
