"""The engine: one training run on one rank, the same whichever transport carries it.

Every process that trains runs an :class:`Engine`: a Ray Train worker (``transports/ray_train.py``),
a pipeline stage actor (``pipeline/group.py``) and, for a run of one worker, the driver itself
(``transports/local.py``). The engine owns the run (house style rule 13c):

- the epochs (:func:`run_epochs`: train, evaluate when due, record the row, checkpoint) and the
  steps within one (:meth:`Engine.train_epoch`: the counters, ``max_steps``, step checkpoints and
  preemption notices, the per-step scalars, the end of each step in :class:`OptimizerStep`);
- the data feed (the resumable sampler, the loaders, the time spent waiting for batches);
- the epoch row (one all-reduce of every rank's sums, one gather of the small per-rank records)
  and the evaluation's reduction;
- checkpoints (``runtime/engine_checkpoint.py``): what each rank writes, names, every rank's
  random generators (CPU and every CUDA device), the partial sums of an unfinished epoch, and the
  restore that reads them back;
- the autocast table and fp16's grad scaler.

What differs between strategies is a *step runner* (:class:`Steps`): how one step's micro-batches go
forward and backward and their gradients meet, and which files this rank's checkpoint part holds
(``parallel/steps.py`` for the data-parallel family, ``pipeline/steps.py`` for a pipeline stage).
What differs between transports is a :class:`~raytrain_mgpu.runtime.transport.Transport`: how a
rank's events reach the driver and where a checkpoint's files go. A feature of the loop lands here
once and runs in every transport (tests/test_engine.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional

import torch

from raytrain_mgpu.runtime.metrics import (EpochMeter, all_gather_objects, all_reduce_sum, barrier_s,
                                           peak_memory_bytes, reset_peak_memory)
from raytrain_mgpu.runtime.preemption import PreemptionCheck
from raytrain_mgpu.runtime.run_state import RunState, epoch_row, eval_columns, stops_early
from raytrain_mgpu.runtime.step_scalars import StepWindow

__all__ = ["Engine", "Steps", "run_epochs", "evaluation_due", "OptimizerStep", "STEP_EVENTS", "AUTOCAST"]

AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
"""``TrainConfig.precision`` -> the autocast dtype (``32``: no autocast at all)."""


def evaluation_due(cfg, state: RunState, row: dict) -> bool:
    """Whether the epoch just trained (``state.epoch`` counts it) is evaluated."""
    return (state.finished(cfg) or stops_early(state.history + [row], cfg)
            or state.epoch % cfg.eval_every_epochs == 0)


def run_epochs(cfg, state: RunState, train_epoch: Callable[[int], dict], evaluate: Callable[[str], dict],
               end_epoch: Callable[[dict], None], has_val: bool = False) -> None:
    """Train ``state``'s remaining epochs of ``cfg``: ``train_epoch(epoch)`` returns the epoch's row (0-based
    ``epoch``), ``evaluate(split)`` the columns of ``"val"`` or ``"test"``, ``end_epoch(row)`` checkpoints and
    reports it; ``has_val``: the data has a validation split.

    A finished run (every epoch, ``max_steps``, or an early stop) trains no further epoch; the last epoch is
    evaluated, and otherwise every ``eval_every_epochs``-th; with a validation split an evaluated epoch
    measures it and the test split only after the last epoch (or every time with ``test_every_epoch``). The
    row joins ``state.history`` before it is checkpointed, so the checkpoint holds it."""
    for epoch in range(state.epoch, cfg.epochs):
        if state.finished(cfg):
            break
        row = train_epoch(epoch)
        state.epoch = epoch + 1
        if evaluation_due(cfg, state, row):
            started = time.perf_counter()
            if has_val:
                row.update(evaluate("val"))
            last = state.finished(cfg) or stops_early(state.history + [row], cfg)  # an early stop on val_*
            if not has_val or last or cfg.test_every_epoch:
                row.update(evaluate("test"))
            row["eval_s"] = time.perf_counter() - started
        state.history.append(row)
        end_epoch(row)


STEP_EVENTS: List[Callable[[int], None]] = []
"""Called with the global step after every optimizer step, in every process that trains, by
:class:`OptimizerStep`: the engine's hook for what observes or disturbs training from outside (tests
register probes here; a run registers none)."""


class OptimizerStep:
    """The end of every training step, once the step's gradients are in place: the rate the step used read,
    gradients unscaled (fp16's ``scaler``) and clipped to ``grad_clip_norm`` by ``clip`` (the runner's norm:
    over this model, or over every stage of a pipeline), the optimizer stepped, gradients dropped, the LR
    schedule moved, the step's scalars added to ``window``, :data:`STEP_EVENTS` called."""

    def __init__(self, cfg, optimizer, scheduler, clip: Callable[[float], object], scaler=None, window=None):
        self.cfg, self.optimizer, self.scheduler, self.clip = cfg, optimizer, scheduler, clip
        # fp16's scaler only: a disabled one's step()/update() are calls that do nothing but cost a few us a step
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.window = window

    def __call__(self, step: int) -> Optional[dict]:
        """Take global step ``step`` (counted from 1 by the caller); the ``train/*`` scalars of the
        ``log_every_n_steps`` window it closes (one device read), else None."""
        optimizer = self.optimizer
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
        grad_norm = None
        if self.cfg.grad_clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            grad_norm = self.clip(self.cfg.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        for event in STEP_EVENTS:
            event(step)
        if self.window is None:
            return None
        self.window.end_step(lr, grad_norm)
        return self.window.read() if step % self.cfg.log_every_n_steps == 0 else None


class Steps:
    """What a strategy gives the engine on one rank (the defaults are a data-parallel worker's).

    Set by the runner before the engine starts: ``ctx`` (a ``WorkerContext``), ``device`` (where the step's
    sums live), ``objective``; ``reads_data``/``sees_loss``: this rank loads batches / computes the loss;
    ``shard``: ``(replica index, replicas)`` of this rank's data; ``loader_batch``: samples per loader batch;
    ``part``: the suffix of this rank's checkpoint files (``""``, ``"-stage1"``).
    """

    reads_data = sees_loss = True
    read_ahead = False  # load the next batch in a thread while this rank computes (a pipeline's first stage)
    part = ""
    sharded = False  # every rank writes its own shards of one checkpoint (fsdp)

    def build_on_meta(self) -> bool:
        """Whether this rank builds the model on ``meta`` (fsdp's ranks but 0: rank 0's weights reach them)."""
        return False

    def accum_at(self, plan, num_shards: int) -> int:
        """Micro-steps per optimizer step at ``num_shards`` data shards."""
        return 1

    def loader_batch(self, plan) -> int:
        """Samples per batch of this rank's loader."""
        raise NotImplementedError

    def setup(self, model: torch.nn.Module, model_state: Optional[dict]) -> None:
        """Place, wrap or split ``model`` (built on the run's seed), loading ``model_state`` (a resume's)."""
        raise NotImplementedError

    def parameters(self) -> list:
        raise NotImplementedError

    def load_optimizer(self, optimizer, train_state: dict) -> None:
        optimizer.load_state_dict(train_state["optimizer"])

    def train(self, mode: bool = True) -> None:
        raise NotImplementedError

    def train_step(self, next_batch: Callable[[], tuple], meter: EpochMeter, window: Optional[StepWindow],
                   scaler, accum: int) -> None:
        """Forward and backward one optimizer step's micro-batches (``accum`` of them for a data-parallel
        worker), gradients in place and synced across replicas; every micro-batch's loss into ``meter``."""
        raise NotImplementedError

    def step_time(self, seconds: float) -> None:
        """One step's wall time on this rank (a pipeline stage sums them for its row)."""

    def clip(self, max_norm: float) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, loader, meter: EpochMeter) -> None:
        raise NotImplementedError

    def memory_devices(self) -> List[torch.device]:
        return [self.device]

    def epoch_stats(self) -> dict:
        """This rank's small per-epoch record (gathered to every rank with the memory peaks)."""
        return {}

    def epoch_columns(self, stats: list) -> dict:
        """Extra history columns from every rank's :meth:`epoch_stats`."""
        return {}

    def epoch_scalars(self, stats: list, row: dict) -> dict:
        """Per-epoch scalars for the loggers (rank 0), from every rank's :meth:`epoch_stats` and the row."""
        return {}

    def checkpoint_files(self, optimizer) -> dict:
        """``{file name: object}`` this rank writes into a checkpoint (``torch.save``d)."""
        raise NotImplementedError

    def write_sharded(self, optimizer, path: str, asynchronous: bool):
        raise NotImplementedError

    def load_sharded(self, optimizer, path: str) -> None:
        raise NotImplementedError

    def meta_extra(self) -> dict:
        """Keys this runner adds to ``meta.json`` (the pipeline's partition)."""
        return {}

    def model_state(self) -> dict:
        """The plain model's whole state (collective where sharded)."""
        raise NotImplementedError


class Engine:
    """One run on one rank: ``Engine(cfg, plan, steps, transport, data).run()`` (see the module docstring)."""

    def __init__(self, cfg, plan, steps: Steps, transport, data):
        self.cfg, self.plan, self.steps, self.transport, self.data = cfg, plan, steps, transport, data
        self.ctx = steps.ctx
        self.rank, self.world = self.ctx.world_rank, self.ctx.world_size
        self.reporter = transport.reporter if self.rank == 0 else None  # the run's events come from rank 0
        dtype = AUTOCAST.get(cfg.precision)
        device_type = steps.device.type
        # fp32: no autocast context at all (entering a disabled one costs ~3.5 us a micro-batch on CPU)
        steps.autocast = (lambda: torch.autocast(device_type, dtype=dtype)) if dtype is not None else (
            contextlib.nullcontext)
        steps.autocast_dtype = dtype
        steps.channels_last = cfg.channels_last
        self.window: Optional[StepWindow] = None
        self.partials: Optional[list] = None  # every rank's sums of the epoch a step checkpoint stopped in

    # ------------------------------------------------------------------ the run

    def run(self, entered: Optional[float] = None) -> dict:
        """Train the run's remaining epochs; ``entered``: when the transport's entry point started (``time.time()``)."""
        self.setup(entered)
        try:
            run_epochs(self.cfg, self.state, self.train_epoch, self.evaluate,
                       lambda row: self.saver.save(row, send_row=True), has_val=self.data.val is not None)
            self.transport.finish()
        finally:
            self.feed.close()
        return {"epochs": self.state.epoch, "steps": self.state.step}

    def setup(self, entered: Optional[float] = None) -> None:
        """Everything before the first step: the model (the run's seed, then the resume point's weights), the step
        runner's placement, the data feed, optimizer, LR schedule, grad scaler, their states and every RNG."""
        from raytrain_mgpu.runtime import engine_checkpoint as checkpoints
        from raytrain_mgpu.runtime.engine_data import Feed

        entered = time.time() if entered is None else entered
        cfg, steps = self.cfg, self.steps
        model = checkpoints.build_model(cfg, steps, self.data)
        restored = checkpoints.read(cfg, self.transport.checkpoint(), steps, self.rank)
        self.state = restored.state
        steps.setup(model, restored.model_state)
        self.feed = Feed(cfg, self.plan, steps, self.data, self.transport)
        self.optimizer = checkpoints.build_optimizer(cfg, steps)
        self.scheduler = checkpoints.build_scheduler(cfg, self.optimizer, self.feed.steps_per_epoch)
        # fp16 on the compute device's type: "cpu" under GPU emulation, so the scaler runs there too
        self.scaler = torch.amp.GradScaler(steps.device.type, enabled=cfg.precision == "16-mixed")
        if restored.train_state is not None:
            checkpoints.load_train_state(steps, self.optimizer, self.scheduler, self.scaler, restored)
        checkpoints.restore_rng(restored, cfg.seed, self.ctx, self.state.step)
        if self.state.step_in_epoch:  # a step checkpoint: the epoch goes on after the steps it had trained
            self.feed.resume_at(self.state.epoch, self.state.step_in_epoch)
            self.partials = (restored.train_state or {}).get(checkpoints.PARTIALS)
        self.window = (StepWindow(steps.device, self.plan.replicas, sees_loss=steps.sees_loss,
                                  reads_data=steps.reads_data)
                       if self.transport.reports_scalars(self.rank, steps) else None)
        self.end_step = OptimizerStep(cfg, self.optimizer, self.scheduler, steps.clip, self.scaler, self.window)
        self.preemption = PreemptionCheck(cfg, self.reporter, **self.transport.preemption())
        self.saver = checkpoints.Saver(self)
        if self.reporter is not None:
            self.reporter.startup(entered, time.time())

    # ------------------------------------------------------------------ one epoch

    def train_epoch(self, epoch: int) -> dict:
        cfg, steps, state, feed = self.cfg, self.steps, self.state, self.feed
        steps.train()
        reset_peak_memory(steps.memory_devices())
        meter = EpochMeter(steps.device, steps.objective)
        # Every rank but 0 of a Ray Train run holds its last report until the controller takes it, and rank 0
        # would wait for it in the first all-reduce, inside its steps: waited for here, it is checkpoint time.
        meter.checkpoint_s += barrier_s()
        batches = feed.epoch(epoch)
        done, spe, window = state.step_in_epoch, feed.steps_per_epoch, self.window
        self.preemption.resumed(state, spe)  # the driver's "resuming at step S", once
        if done:
            meter.resume(_own_partials(self.partials, self.ctx))
        if window is not None:
            window.resume()
        next_batch = feed.batches(batches, meter, window)
        for _ in range(done, spe):
            if cfg.max_steps is not None and state.step >= cfg.max_steps:
                break
            started = time.perf_counter()
            steps.train_step(next_batch, meter, window, self.scaler, feed.accum)
            state.step += 1
            done += 1
            scalars = self.end_step(state.step)
            steps.step_time(time.perf_counter() - started)
            if scalars is not None:  # a log_every_n_steps window closed (a rank that reports scalars)
                self.transport.reporter.scalars(state.step, scalars)
            if self.reporter is not None:
                self.reporter.step(done, spe, epoch + 1)
            state.step_in_epoch = done
            # checkpoint_every_n_steps, or the first preemption notice
            self.preemption.after_step(state.step, done, spe, lambda: self._save_step(meter))
        state.step_in_epoch = 0
        self.partials = None
        return self._epoch_row(epoch, meter, done)

    def _save_step(self, meter: EpochMeter) -> None:
        """A step checkpoint; its time is the epoch's ``checkpoint_s``, not training (``training_s``)."""
        start = time.perf_counter()
        self.saver.save({"epoch": self.state.epoch, "step": self.state.step,
                         "step_in_epoch": self.state.step_in_epoch}, partial=meter.partial())
        barrier_s()  # the other ranks' wait for their report to be taken (Ray Train) is checkpoint time too
        meter.checkpoint_s += time.perf_counter() - start

    def _epoch_row(self, epoch: int, meter: EpochMeter, steps_done: int) -> dict:
        steps = self.steps
        sums = meter.totals
        training_s = meter.elapsed() - meter.checkpoint_s  # the time in steps: step checkpoints are not training
        reading_s = training_s if steps.reads_data else 0.0
        own = torch.tensor([meter.data_wait_s, training_s, meter.checkpoint_s, reading_s], dtype=torch.float64,
                           device=sums.device)
        # one all-reduce of every rank's loss and metric sums and counts and its times
        *totals, wait_sum, train_sum, checkpoint_sum, reading_sum = all_reduce_sum(torch.cat([sums, own])).tolist()
        loss_sum, samples, metric_totals = meter.split(totals)
        # one small object all-gather per epoch: memory peaks, devices, the runner's own record
        gathered = all_gather_objects((peak_memory_bytes(steps.memory_devices()), self._where(), steps.epoch_stats()))
        world, stats = self.world, [stats for _, _, stats in gathered]
        # samples count targets (tokens for LMs); throughput is training throughput: samples over the mean
        # rank's time in steps. checkpoint_s gains the epoch's own checkpoint, eval_s the evaluation.
        row = epoch_row(epoch=epoch, state=self.state, lr=self.optimizer.param_groups[0]["lr"], loss_sum=loss_sum,
                         metric_totals=metric_totals, samples=samples, elapsed_s=train_sum / world,
                         steps=max(steps_done, 1), data_wait_share=wait_sum / max(reading_sum, 1e-9),
                         peak_memory_bytes=[b for peaks, _, _ in gathered for b in peaks],
                         devices=_devices([where for _, where, _ in gathered]), workers=world,
                         checkpoint_s=checkpoint_sum / world, eval_s=0.0, **steps.epoch_columns(stats))
        scalars = steps.epoch_scalars(stats, row) if self.reporter is not None else None
        if scalars:  # the runner's figures of the epoch (a pipeline's per stage)
            self.reporter.scalars(self.state.step, scalars)
        return row

    def _where(self) -> dict:
        return {**self.ctx.assignment.record(), **self.transport.where()}

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, split: str) -> dict:
        """Loss and metrics over the whole ``split`` (test or val): every replica takes a disjoint shard."""
        self.steps.train(False)
        meter = EpochMeter(self.steps.device, self.steps.objective)
        self.steps.evaluate(self.feed.eval_loaders[split], meter)
        self.steps.train()
        return eval_columns(*meter.split(all_reduce_sum(meter.totals).tolist()), split=split)


def _devices(records: list) -> dict:
    """The row's device columns from every rank's record (intended devices, backend, Ray's ids, node)."""
    first = records[0]
    columns = {"devices_per_rank": [r["devices"] for r in records], "backend": first["backend"],
               "emulated": first["emulated"]}
    for key in ("gpu_ids", "cuda_visible_devices", "node_id", "node_ip"):
        if key in first:
            columns[f"{key}_per_rank"] = [r.get(key) for r in records]
    return columns


def _own_partials(partials: Optional[list], ctx) -> list:
    """This rank's saved epoch sums; all of them on rank 0 when the world size changed (they are summed anyway)."""
    if not partials:
        return []
    if len(partials) == ctx.world_size:
        return [partials[ctx.world_rank]] if partials[ctx.world_rank] is not None else []
    return [p for p in partials if p is not None] if ctx.world_rank == 0 else []
