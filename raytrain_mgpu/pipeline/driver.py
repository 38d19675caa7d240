"""Driver side of one attempt: epochs, metrics, checkpoints, over a :class:`StageGroup`.

Checkpoints (``pipeline/checkpoints.py``): ``{storage_path}/{name}/checkpoint_epoch{E:06d}/`` after
each epoch and, with ``checkpoint_every_n_steps``, ``checkpoint_epoch{E:06d}_step{S:09d}/`` inside
one. The actors of replica 0 write their ``model-stage{p}.pt`` and ``train_state-stage{p}.pt``
into a temporary folder in the background, the driver then writes ``meta.json`` and
``history.json`` and renames the folder into place, so a half-written checkpoint never carries
the name a resume looks for. A step checkpoint's resume continues its epoch after the trained steps.
"""

from __future__ import annotations

import logging
import time
from statistics import mean
from typing import List, Optional, Tuple

from raytrain_mgpu.batches import shape_record
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime.engine import run_epochs
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.step_checkpoints import step_checkpoint_due
from raytrain_mgpu.runtime.step_scalars import stage_scalars
from raytrain_mgpu.runtime.run_state import RunState, add_metric_totals, epoch_row, eval_columns
from raytrain_mgpu.data import check_data
from raytrain_mgpu.pipeline.checkpoints import EPOCH_ELAPSED, EPOCH_PARTIALS, CheckpointSaver
from raytrain_mgpu.pipeline.group import StageGroup
from raytrain_mgpu.models.partition import Partition
from raytrain_mgpu.pipeline.plan import check_splittable, choose_partition, partition_from_checkpoint
from raytrain_mgpu.pipeline.schedule import ideal_bubble_fraction
from raytrain_mgpu.strategies.plan import RunPlan

logger = logging.getLogger(__name__)

CLOSE_UPLOAD_TIMEOUT_S = 60.0
"""After a failed attempt, before and after its actors are killed: how long its upload in flight may take."""
TARGET_CALL_S = 1.0
"""Steps per driver call are chosen so that one call lasts about this long: each call
costs a Ray round trip (about a millisecond), and progress is reported after each."""


def load_state(cfg: TrainConfig) -> RunState:
    """The state the next attempt starts from (the start of every attempt, before any actor
    runs: the moment nobody of ours writes here, so a killed driver's temporaries go)."""
    folder = RunFolder.of(cfg)
    folder.remove_temporaries()
    state = folder.state()
    if state.checkpoint is not None:
        ckpt_format.check_resumable(state.meta, cfg.model, cfg.strategy, state.checkpoint)
    return state


def train_attempt(cfg: TrainConfig, plan: RunPlan, reporter, state: RunState) -> Tuple[str, list]:
    """Start the actor group, train the remaining epochs, checkpoint each; always tear down.

    ``reporter``: ``step``, ``epoch`` and, where it has one, ``scalars(step, values)``: the
    ``train/*`` scalars every ``log_every_n_steps`` steps and the ``stage{k}/*`` figures once an epoch.
    """
    # Plan before any actor starts, so a model that cannot be split fails at once; only
    # balance="time" needs the actors (to profile on their device), after a cheap check.
    partition = None
    if state.checkpoint is not None and state.partition is not None:
        partition = partition_from_checkpoint(cfg, state.partition, state.checkpoint)
    elif cfg.balance == "time":
        check_splittable(cfg)
    else:
        partition = choose_partition(cfg)
    group = StageGroup(cfg, plan)
    saver = None
    try:
        started = time.perf_counter()
        group.start()
        logger.debug("actor group placed in %.1f s", time.perf_counter() - started)
        if partition is None:
            partition = choose_partition(cfg, profile=group.profile)
        infos = group.setup(partition, _path_in_folder(cfg, state.checkpoint), state.step, state.step_in_epoch,
                            state.meta.get(EPOCH_PARTIALS))  # a step checkpoint's: every rank's sums of its epoch
        logger.debug("actor group set up after %.1f s", time.perf_counter() - started)
        steps_per_epoch = infos[0]["steps_per_epoch"]
        logger.info("%s: %d replica(s) x %d stages (%s, partition %s); %s; %d steps per epoch; rank: node %s",
                    cfg.strategy, plan.replicas, cfg.num_stages, cfg.schedule, list(partition.counts),
                    plan.describe(), steps_per_epoch,
                    ", ".join(f"{info['rank']}: {info['node_ip']}" for info in infos))
        input_shape, num_classes = check_data(cfg.data)
        shape_info = {"input_shape": shape_record(input_shape), "num_classes": num_classes}  # for load_model()
        saver = CheckpointSaver(cfg, group, partition, shape_info)
        path = state.checkpoint

        def end_epoch(row: dict) -> None:
            nonlocal path
            # written in the background; on_checkpoint once published; the stages' pause joins checkpoint_s
            path = saver.save(state, reporter, row=row)
            reporter.epoch(row)

        def train_epoch(epoch: int) -> dict:
            return _train_epoch(cfg, group, state, epoch, steps_per_epoch, reporter, partition, saver)

        run_epochs(cfg, state, train_epoch, lambda split: _evaluate(group, split), end_epoch,
                   has_val=infos[0]["has_val"])
        saver.finish(reporter)  # the last upload, before the actors go
        group.shutdown(graceful=True)
        return path, state.history
    finally:
        if saver is not None:  # after a failure: an upload whose stages all finished is still published
            saver.abandon(CLOSE_UPLOAD_TIMEOUT_S)
        group.shutdown()
        if saver is not None:  # a dead actor's wait_upload fails at once: nothing of this attempt writes on
            saver.abandon(CLOSE_UPLOAD_TIMEOUT_S)  # when the next one starts (and removes its temporaries)


def _train_epoch(cfg: TrainConfig, group: StageGroup, state: RunState, epoch: int, steps_per_epoch: int,
                 reporter, partition: Partition, saver: CheckpointSaver) -> dict:
    group.call("start_epoch", epoch)
    # A step checkpoint's resume: the epoch goes on after the steps it had trained, on the clock it had
    done = state.step_in_epoch
    steps = steps_per_epoch if cfg.max_steps is None else min(steps_per_epoch, done + cfg.max_steps - state.step)
    start, chunk = time.perf_counter() - ((state.meta.get(EPOCH_ELAPSED) or 0.0) if done else 0.0), 1
    checkpoint_s = 0.0  # this attempt's step checkpoints: not training (training_s leaves them out)
    every = cfg.checkpoint_every_n_steps
    while done < steps:
        n = min(chunk, steps - done, every - state.step % every if every else steps)  # stop at a step checkpoint
        call_start = time.perf_counter()
        closed = group.call("train_steps", n)
        elapsed = time.perf_counter() - call_start
        done += n
        state.step += n
        state.step_in_epoch = done
        _report_scalars(reporter, closed)
        reporter.step(done, steps, epoch + 1)  # as the data-parallel loop reports: within the epoch
        saver.poll(reporter)
        if step_checkpoint_due(cfg, state.step, done, steps_per_epoch):
            saving = time.perf_counter()
            saver.save(state, reporter, epoch_elapsed_s=saving - start - checkpoint_s)  # the time in steps so far
            checkpoint_s += time.perf_counter() - saving
        chunk = max(1, int(n * TARGET_CALL_S / max(elapsed, 1e-3)))
    state.step_in_epoch = 0
    training_s = time.perf_counter() - start - checkpoint_s
    stats = group.call("finish_epoch")
    if hasattr(reporter, "scalars"):  # the stage figures the epoch row sums up, per stage
        reporter.scalars(state.step, stage_scalars(stats, cfg.num_stages))
    return epoch_metrics(cfg, stats, epoch, state, training_s, partition, checkpoint_s=checkpoint_s)


def _report_scalars(reporter, closed: List[list]) -> None:
    """Every rank's closed windows (``train_steps``' results), merged by step: the last stage's
    loss, lr, grad norm and samples/s with the first stage's data-wait share."""
    if not hasattr(reporter, "scalars"):
        return
    merged: dict = {}
    for windows in closed:
        for step, values in windows or ():
            merged.setdefault(step, {}).update(values)
    for step in sorted(merged):
        reporter.scalars(step, merged[step])


def epoch_metrics(cfg: TrainConfig, stats: List[dict], epoch: int, state: RunState, elapsed: float,
                  partition: Partition, checkpoint_s: float = 0.0) -> dict:
    """Combine every rank's ``finish_epoch()`` sums into the per-epoch metrics. ``elapsed``: the epoch's
    time in steps; ``checkpoint_s``: its step checkpoints' (the epoch's own and ``eval_s`` come after)."""
    readers = [s for s in stats if s["data_wait_s"] > 0] or stats
    steps = max(stats[0]["steps"], 1)
    stage_times = [mean(s["step_s"] / steps for s in stats if s["prank"] == p) for p in range(cfg.num_stages)]
    return epoch_row(
        epoch=epoch, state=state, lr=stats[0]["lr"], loss_sum=sum(s["loss_sum"] for s in stats),
        metric_totals=add_metric_totals(s["metrics"] for s in stats),  # the last stages' sums, over replicas
        samples=sum(s["targets"] for s in stats),  # tokens for an LM
        elapsed_s=elapsed, steps=steps, peak_memory_bytes=[s["peak_memory_bytes"] for s in stats],
        data_wait_share=sum(s["data_wait_s"] for s in readers) / max(sum(s["step_s"] for s in readers), 1e-9),
        # intended devices and backend (cuda:k and nccl also under GPU emulation, which computes on CPU)
        devices={"devices_per_rank": [s["devices"] for s in stats], "backend": stats[0]["backend"],
                 "gpu_ids_per_rank": [s["gpu_ids"] for s in stats]},  # Ray's ids: distinct per actor on a node
        node_ip_per_rank=[s["node_ip"] for s in stats],  # rank = replica x num_stages + stage
        stage_step_time_s=stage_times,
        bubble_fraction=mean(1 - s["busy_s"] / max(s["schedule_s"], 1e-9) for s in stats),
        ideal_bubble_fraction=ideal_bubble_fraction(cfg.schedule, cfg.num_stages, cfg.num_microbatches),
        bytes_between_stages_per_step=sum(s["bytes_sent"] for s in stats) / steps,
        partition=list(partition.counts), checkpoint_s=checkpoint_s, eval_s=0.0)


def _evaluate(group: StageGroup, split: str) -> dict:
    sums = [s for s in group.call("evaluate", split) if s is not None]  # one per replica: its last stage's
    return eval_columns(sum(s["loss_sum"] for s in sums), sum(s["targets"] for s in sums),
                        add_metric_totals(s["metrics"] for s in sums), split=split)


def _path_in_folder(cfg: TrainConfig, checkpoint: Optional[str]) -> Optional[str]:
    """A checkpoint's path in the run folder's filesystem (the actors open it through the same one)."""
    return None if checkpoint is None else RunFolder.of(cfg).join(checkpoint.rstrip("/").rsplit("/", 1)[-1])
