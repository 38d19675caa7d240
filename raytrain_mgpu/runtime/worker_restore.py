"""What a Ray Train worker restores on a restart or resume: the run's last checkpoint, the optimizer's
state, each rank's random generators. ``runtime/worker_checkpoint.py`` writes what is read here."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

import ray.train
import torch

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.run_state import RunState

if TYPE_CHECKING:  # the strategies sit above the runtime (tests/test_imports.py LAYERS)
    from raytrain_mgpu.parallel import WorkerStrategy
    from raytrain_mgpu.strategies import WorkerContext

logger = logging.getLogger(__name__)


def seed_rank_stream(seed: int, rank: int, step: int = 0) -> None:
    """Seed this rank's CPU and CUDA generators: distinct per rank, and per step when re-seeding a resume."""
    torch.manual_seed((seed + 1 + rank) + 1_000_003 * step)


def restore(cfg: TrainConfig, strategy: WorkerStrategy, model) -> tuple:
    """Load the last checkpoint of this run, if Ray Train has one (resume or restart)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return RunState(), None
    with checkpoint.as_directory() as directory:
        meta = ckpt_format.read_meta(directory)
        ckpt_format.check_resumable(meta, cfg.model, cfg.strategy, directory)
        sharded = ckpt_format.is_sharded(directory)
        if not sharded and not strategy.build_on_meta():  # a meta model holds no data: rank 0 sends its weights
            model.load_state_dict(ckpt_format.load_model_state(directory))
        train_state = ckpt_format.load_train_state(directory)
        if sharded:  # model and optimizer once sharded and built (load_train_state), from every rank's files
            train_state["sharded_checkpoint"] = checkpoint
        history = ckpt_format.read_history(directory)
    state = RunState.resumed(meta, history, getattr(checkpoint, "path", None))
    restore_rng(train_state.get("rng_per_rank"), cfg.seed, strategy.ctx, state.step)
    if strategy.ctx.world_rank == 0:
        logger.info("resuming %s from epoch %d, step %d", cfg.name, state.epoch, state.step)
    return state, train_state


def load_train_state(strategy: WorkerStrategy, model, optimizer, scheduler, scaler, train_state: dict) -> None:
    """Optimizer, LR schedule and grad scaler (scale, growth tracker) from a checkpoint's train state;
    a sharded checkpoint's model and optimizer shards too (every rank reads the pieces its shards cover)."""
    if "sharded_checkpoint" in train_state:  # written by this strategy (check_resumable)
        with train_state["sharded_checkpoint"].as_directory() as directory:
            strategy.load_sharded(model, optimizer, os.path.join(directory, ckpt_format.SHARDED_DIR))
    else:
        strategy.load_optimizer_state_dict(model, optimizer, train_state["optimizer"])
    scheduler.load_state_dict(train_state["scheduler"])
    scaler.load_state_dict(train_state["scaler"])


def rng_state() -> dict:
    """This rank's generators as ByteTensors (loadable with ``weights_only=True``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


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
