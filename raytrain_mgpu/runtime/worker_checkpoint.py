"""What a Ray Train worker saves and restores: checkpoints, the optimizer's state, each rank's RNG.

``save_and_report`` writes a checkpoint (rank 0) and reports it to Ray Train on every rank;
``restore`` reads the run's last checkpoint back on a restart or resume. Used by the loop
(``runtime/loop.py``) at the end of every epoch and every ``checkpoint_every_n_steps``.
"""

from __future__ import annotations

import logging
import tempfile
from typing import TYPE_CHECKING, Optional

import ray.train
import torch

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.faults import wait_until_report_collected
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.run_state import RunState, best_row, checkpoint_meta
from raytrain_mgpu.runtime.step_checkpoints import STEP_IN_EPOCH

if TYPE_CHECKING:  # the strategies sit above the runtime (tests/test_imports.py LAYERS)
    from raytrain_mgpu.strategies import Strategy, WorkerContext

logger = logging.getLogger(__name__)


def seed_rank_stream(seed: int, rank: int, step: int = 0) -> None:
    """Seed this rank's CPU and CUDA generators: distinct per rank, and per step when re-seeding a resume."""
    torch.manual_seed((seed + 1 + rank) + 1_000_003 * step)


def restore(cfg: TrainConfig, strategy: Strategy, model) -> tuple:
    """Load the last checkpoint of this run, if Ray Train has one (resume or restart)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return RunState(), None
    with checkpoint.as_directory() as directory:
        meta = ckpt_format.read_meta(directory)
        ckpt_format.check_resumable(meta, cfg.model, cfg.strategy, directory)
        if not strategy.build_on_meta():  # a meta model holds no data: rank 0 sends its weights
            model.load_state_dict(ckpt_format.load_model_state(directory))
        train_state = ckpt_format.load_train_state(directory)
        history = ckpt_format.read_history(directory)
    state = RunState.resumed(meta, history, getattr(checkpoint, "path", None))
    restore_rng(train_state.get("rng_per_rank"), cfg.seed, strategy.ctx, state.step)
    if strategy.ctx.world_rank == 0:
        logger.info("resuming %s from epoch %d, step %d", cfg.name, state.epoch, state.step)
    return state, train_state


def load_train_state(strategy: Strategy, model, optimizer, scheduler, scaler, train_state: dict) -> None:
    """Optimizer, LR schedule and grad scaler (scale, growth tracker) from a checkpoint's train state."""
    strategy.load_optimizer_state_dict(model, optimizer, train_state["optimizer"])
    scheduler.load_state_dict(train_state["scheduler"])
    scaler.load_state_dict(train_state["scaler"])


def rng_state() -> dict:
    """This rank's generators as ByteTensors (loadable with ``weights_only=True``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def gather_rng_states() -> list:
    """Every rank's ``rng_state()``, in rank order (collective: every rank calls it)."""
    return gather_objects(rng_state())


def gather_objects(own) -> list:
    """Every rank's ``own``, in rank order (collective: every rank calls it; small objects only)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [own]
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, own)
    return gathered


def restore_rng(states: Optional[list], seed: int, ctx: WorkerContext, step: int) -> None:
    """This rank's saved generators; a different world size (or an old checkpoint) re-seeds per rank and step."""
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


def save_and_report(cfg: TrainConfig, strategy: Strategy, model, optimizer, scheduler, scaler,
                     state: RunState, metrics: dict, ctx: WorkerContext, shape_info: dict,
                     reporter: Optional[WorkerReporter] = None, epoch_partial: Optional[dict] = None) -> None:
    """Every rank reports once per epoch (Ray Train requires it); rank 0 carries the checkpoint
    and then tells the driver where Ray Train persisted it (``on_checkpoint``)."""
    model_state = strategy.state_dict(model)  # collective for sharded strategies: all ranks call
    optimizer_state = strategy.optimizer_state_dict(model, optimizer)  # collective too (fsdp)
    rng_states = gather_rng_states()  # collective: each rank keeps its own stream on resume
    # A step checkpoint (``epoch_partial``: this rank's sums of the unfinished epoch) keeps every rank's.
    partials = gather_objects(epoch_partial) if epoch_partial is not None else None
    with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-ckpt-") as directory:
        checkpoint: Optional[ray.train.Checkpoint] = None
        if ctx.world_rank == 0:
            meta = checkpoint_meta(cfg, state, shape_info, **({STEP_IN_EPOCH: state.step_in_epoch} if partials else {}))
            train_state = {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                           "scaler": scaler.state_dict(), "rng_per_rank": rng_states}
            if partials:
                train_state["epoch_partial_per_rank"] = partials
            ckpt_format.write_checkpoint(directory, meta=meta, history=state.history,
                                         model_state=model_state, train_state=train_state)
            if (cfg.keep_best and not partials
                    and best_row(state.history, cfg.monitor, cfg.mode) is state.history[-1]):
                # Ray Train prunes by age here (its score order would keep the N best, not the last N):
                # a new best's model is copied aside, one more model write per improvement.
                RunFolder.of(cfg).save_best(directory)
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report({k: v for k, v in metrics.items() if v is not None}, checkpoint=checkpoint)
    # A rank that dies before Ray Train's controller has taken its report would drop this
    # checkpoint although it is uploaded; waiting costs up to one controller poll (2 s).
    wait_until_report_collected()
    if checkpoint is not None and reporter is not None:
        # A synchronous report has uploaded the checkpoint before it returns, and the latest
        # reported checkpoint is then the persisted one (its path in the storage filesystem).
        persisted = ray.train.get_checkpoint()
        if persisted is not None:
            reporter.checkpoint(RunFolder.of(cfg).uri_of(persisted.path))
