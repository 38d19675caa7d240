"""Driver side of one attempt: epochs, metrics, checkpoints, over a :class:`StageGroup`.

Checkpoints: ``{storage_path}/{name}/checkpoint_epoch{E:06d}/``. The actors of replica 0
write their ``model-stage{p}.pt`` and ``train_state-stage{p}.pt`` into a temporary
folder, the driver then writes ``meta.json`` and ``history.json`` and renames the folder
into place, so a half-written checkpoint never carries the name a resume looks for.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import List, Optional, Tuple

from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu._redact import redact
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime.runlock import other_live_owner
from raytrain_mgpu.data import check_data
from raytrain_mgpu.pipeline.group import StageGroup
from raytrain_mgpu.models.partition import Partition
from raytrain_mgpu.pipeline.plan import check_splittable, choose_partition, partition_from_checkpoint
from raytrain_mgpu.pipeline.schedule import ideal_bubble_fraction
from raytrain_mgpu.pipeline.worker import num_replicas

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_epoch"
TMP_PREFIX = f".tmp-{CHECKPOINT_PREFIX}"  # + epoch + a unique suffix: see _save
TARGET_CALL_S = 1.0
"""Steps per driver call are chosen so that one call lasts about this long: each call
costs a Ray round trip (about a millisecond), and progress is reported after each."""


@dataclass
class RunState:
    """What a resume starts from."""

    epoch: int = 0
    step: int = 0
    attempt: int = 0
    history: list = field(default_factory=list)
    checkpoint: Optional[str] = None
    partition: Optional[List[int]] = None


def run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.storage_path) / cfg.name


def latest_checkpoint(cfg: TrainConfig) -> Optional[str]:
    """The newest complete checkpoint of this run (temporary folders are never matched)."""
    folder = run_dir(cfg)
    done = sorted(p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if (p / ckpt_format.META_FILE).is_file())
    return str(done[-1]) if done else None


def load_state(cfg: TrainConfig) -> RunState:
    # The start of every attempt, before any actor runs: the moment nobody of ours writes here.
    prune_stale_temporaries(cfg)
    directory = latest_checkpoint(cfg)
    if directory is None:
        return RunState()
    meta = ckpt_format.read_meta(directory)
    ckpt_format.check_resumable(meta, cfg.model, cfg.strategy, directory)
    return RunState(epoch=meta["epoch"], step=meta["step"], attempt=meta.get("attempt", 0) + 1,
                    history=ckpt_format.read_history(directory), checkpoint=directory,
                    partition=meta.get("partition"))


def prune_stale_temporaries(cfg: TrainConfig) -> List[str]:
    """Remove the temporary checkpoint folders that a killed driver (or attempt) left in this
    run folder; returns their names.

    Their names are unique, so nobody would ever reuse or remove them otherwise. Under our own
    run lock (``fit`` holds it) no other driver writes here, so every one is stale; if the
    lock names another live driver, its save may be in flight and nothing is removed.
    """
    folder = run_dir(cfg)
    owner = other_live_owner(str(folder))
    if owner is not None:
        logger.warning("run folder %s is locked by another live driver (host %s, pid %s): its temporary "
                       "checkpoint folders are left alone", redact(str(folder)), owner.get("host"), owner.get("pid"))
        return []
    stale = sorted(p for p in folder.glob(f"{TMP_PREFIX}*") if p.is_dir())
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    if stale:
        logger.info("run folder %s: removed %d temporary checkpoint folder(s) left by a stopped driver: %s",
                    redact(str(folder)), len(stale), ", ".join(p.name for p in stale))
    return [p.name for p in stale]


def finished(cfg: TrainConfig, state: RunState) -> bool:
    return state.epoch >= cfg.epochs or (cfg.max_steps is not None and state.step >= cfg.max_steps)


def train_attempt(cfg: TrainConfig, reporter, state: RunState, fail_at_step: Optional[int]) -> Tuple[str, list]:
    """Start the actor group, train the remaining epochs, checkpoint each; always tear down."""
    # Plan before any actor starts, so a model that cannot be split fails at once; only
    # balance="time" needs the actors (to profile on their device), after a cheap check.
    partition = None
    if state.checkpoint is not None and state.partition is not None:
        partition = partition_from_checkpoint(cfg, state.partition, state.checkpoint)
    elif cfg.balance == "time":
        check_splittable(cfg)
    else:
        partition = choose_partition(cfg)
    group = StageGroup(cfg, fail_at_step)
    try:
        started = time.perf_counter()
        group.start()
        logger.debug("actor group placed in %.1f s", time.perf_counter() - started)
        if partition is None:
            partition = choose_partition(cfg, profile=group.profile)
        infos = group.setup(partition, state.checkpoint, state.step)
        logger.debug("actor group set up after %.1f s", time.perf_counter() - started)
        steps_per_epoch = infos[0]["steps_per_epoch"]
        D, m = num_replicas(cfg), cfg.num_microbatches
        logger.info("%s: %d replica(s) x %d stages (%s, partition %s); global batch %d = %d x %d micro-batches "
                    "x %d rows; %d steps per epoch; rank: node %s", cfg.strategy, D, cfg.num_stages, cfg.schedule,
                    list(partition.counts), cfg.batch_size, D, m, cfg.batch_size // (D * m), steps_per_epoch,
                    ", ".join(f"{info['rank']}: {info['node_ip']}" for info in infos))
        input_shape, num_classes = check_data(cfg.data)
        shape_info = {"input_shape": list(input_shape), "num_classes": num_classes}  # for load_model()
        path = state.checkpoint
        for epoch in range(state.epoch, cfg.epochs):
            if finished(cfg, state):
                break
            metrics = _train_epoch(cfg, group, state, epoch, steps_per_epoch, reporter, partition)
            last = epoch + 1 == cfg.epochs or finished(cfg, state)
            if last or (epoch + 1) % cfg.eval_every_epochs == 0:
                metrics.update(_evaluate(group))
            state.epoch = epoch + 1
            state.history.append(metrics)
            path = _save(cfg, group, state, partition, shape_info)
            reporter.epoch(metrics)
        group.shutdown(graceful=True)
        return path, state.history
    finally:
        group.shutdown()


def _train_epoch(cfg: TrainConfig, group: StageGroup, state: RunState, epoch: int, steps_per_epoch: int,
                 reporter, partition: Partition) -> dict:
    group.call("start_epoch", epoch)
    steps = steps_per_epoch if cfg.max_steps is None else min(steps_per_epoch, cfg.max_steps - state.step)
    start, done, chunk = time.perf_counter(), 0, 1
    while done < steps:
        n = min(chunk, steps - done)
        call_start = time.perf_counter()
        group.call("train_steps", n)
        elapsed = time.perf_counter() - call_start
        done += n
        state.step += n
        reporter.step(done, steps, epoch + 1)  # as the data-parallel loop reports: within the epoch
        chunk = max(1, int(n * TARGET_CALL_S / max(elapsed, 1e-3)))
    elapsed = time.perf_counter() - start
    return epoch_metrics(cfg, group.call("finish_epoch"), epoch, state, elapsed, partition)


def epoch_metrics(cfg: TrainConfig, stats: List[dict], epoch: int, state: RunState, elapsed: float,
                  partition: Partition) -> dict:
    """Combine every rank's ``finish_epoch()`` sums into the per-epoch metrics."""
    steps = max(stats[0]["steps"], 1)
    targets = sum(s["targets"] for s in stats)
    readers = [s for s in stats if s["data_wait_s"] > 0] or stats
    stage_times = [mean(s["step_s"] / steps for s in stats if s["prank"] == p) for p in range(cfg.num_stages)]
    return {
        "epoch": epoch + 1, "step": state.step, "attempt": state.attempt, "lr": stats[0]["lr"],
        "train_loss": sum(s["loss_sum"] for s in stats) / max(targets, 1),
        "train_accuracy": sum(s["correct"] for s in stats) / max(targets, 1),
        "test_loss": None, "test_accuracy": None,
        # targets, as the data-parallel loop counts them: tokens for a language model
        "samples_per_s": targets / max(elapsed, 1e-9),
        "step_time_s": elapsed / steps,
        "data_wait_share": sum(s["data_wait_s"] for s in readers) / max(sum(s["step_s"] for s in readers), 1e-9),
        "peak_memory_bytes": [int(s["peak_memory_bytes"]) for s in stats],
        "node_ip_per_rank": [s["node_ip"] for s in stats],  # rank = replica x num_stages + stage
        # intended devices and backend (cuda:k and nccl also under GPU emulation, which computes on CPU)
        "devices_per_rank": [s["devices"] for s in stats], "backend": stats[0]["backend"],
        "gpu_ids_per_rank": [s["gpu_ids"] for s in stats],  # Ray's ids: distinct per actor on a node
        "stage_step_time_s": stage_times,
        "bubble_fraction": mean(1 - s["busy_s"] / max(s["schedule_s"], 1e-9) for s in stats),
        "ideal_bubble_fraction": ideal_bubble_fraction(cfg.schedule, cfg.num_stages, cfg.num_microbatches),
        "bytes_between_stages_per_step": sum(s["bytes_sent"] for s in stats) / steps,
        "partition": list(partition.counts),
    }


def _evaluate(group: StageGroup) -> dict:
    sums = [s for s in group.call("evaluate") if s is not None]
    loss_sum, correct, count = (sum(column) for column in zip(*sums))
    return {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1)}


def _save(cfg: TrainConfig, group: StageGroup, state: RunState, partition: Partition, shape_info: dict) -> str:
    folder = run_dir(cfg)
    final = folder / f"{CHECKPOINT_PREFIX}{state.epoch:06d}"
    # Unique per save: two drivers (or a killed one's leftovers) never share a temporary folder.
    tmp = folder / f"{TMP_PREFIX}{state.epoch:06d}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    group.call("save", str(tmp))
    meta = {"model": cfg.model, "dataset": cfg.dataset, "strategy": cfg.strategy, "epoch": state.epoch,
            "step": state.step, "attempt": state.attempt, "partition": list(partition.counts),
            "num_stages": cfg.num_stages, "schedule": cfg.schedule, **shape_info, "config": redact(cfg.to_dict())}
    ckpt_format.write_checkpoint(str(tmp), meta=meta, history=state.history)  # last: marks it complete
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(folder, cfg.num_checkpoints_to_keep)
    logger.info("checkpoint %s", final)
    return str(final)


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
