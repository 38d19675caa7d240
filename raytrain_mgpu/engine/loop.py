"""The engine: one training run on one rank, the same whichever transport carries it.

Every process that trains runs an :class:`Engine`: a Ray Train worker (``transports/ray_train/worker.py``),
a pipeline stage actor (``transports/actor_group/group.py``) and, for a run of one worker, the driver itself
(``transports/local.py``). The engine owns the run (a transport only starts processes, carries a rank's report and puts a checkpoint's
files where they go):

- the epochs (:func:`run_epochs`: train, evaluate when due, record the row, checkpoint) and the
  steps within one (:meth:`Engine.train_epoch`: the counters, ``max_steps``, step checkpoints and
  preemption notices, the per-step scalars, the end of each step in :class:`OptimizerStep`);
- the data feed (the resumable sampler, the loaders, the time spent waiting for batches);
- the epoch row (one all-reduce of every rank's sums, one gather of the small per-rank records)
  and the evaluation's reduction;
- checkpoints (:class:`~raytrain_mgpu.checkpointing.manager.CheckpointManager`: when, what, the write, the
  resume choice; ``checkpointing/contents.py``: what each rank writes, names, every rank's random generators, the
  partial sums of an unfinished epoch, and the restore that reads them back);
- the run's precision (``engine/precision.py``: autocast, fp16's grad scaler), handed to the step runner.

What differs between strategies is a *step runner* (:class:`Steps`): how one step's micro-batches go
forward and backward and their gradients meet, and which files this rank's checkpoint part holds
(``parallel/steps.py`` for the data-parallel family, ``pipeline/steps.py`` for a pipeline stage).
What differs between transports is a :class:`~raytrain_mgpu.transports.base.Transport`: how a
rank's events reach the driver and where a checkpoint's files go. A feature of the loop lands here
once and runs in every transport (tests/test_engine.py).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from raytrain_mgpu.checkpointing import contents as checkpoints
from raytrain_mgpu.engine.feed import Feed
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.engine.observe import Observer
from raytrain_mgpu.engine.weights import load_weights, read_weights
from raytrain_mgpu.engine.step import (STEP_EVENTS, NonFiniteError, OptimizerStep, StepContext,
                                               Steps)
from raytrain_mgpu.engine.metrics import (EpochMeter, all_gather_objects, all_reduce_sum, barrier_s,
                                           peak_memory_bytes, reset_peak_memory)
from raytrain_mgpu.checkpointing.manager import CheckpointManager
from raytrain_mgpu.engine.run_state import (RunState, at_max_steps, epoch_row, eval_columns, perplexity_column,
                                             stops_early)
from raytrain_mgpu.engine.replica_groups import HealedFromPeer, RunOver
from raytrain_mgpu.engine.step_scalars import StepWindow

__all__ = ["Engine", "Steps", "run_epochs", "evaluation_due", "OptimizerStep", "STEP_EVENTS",
           "NonFiniteError", "StepContext"]


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
            row["eval_s"] = row.get("eval_s", 0.0) + time.perf_counter() - started
        state.history.append(row)
        end_epoch(row)


class Engine:
    """One run on one rank: ``Engine(cfg, plan, steps, transport, data).run()`` (see the module docstring)."""

    def __init__(self, cfg, plan, steps: Steps, transport, data):
        self.cfg, self.plan, self.steps, self.transport, self.data = cfg, plan, steps, transport, data
        self.ctx = steps.ctx
        self.rank, self.world = self.ctx.world_rank, self.ctx.world_size
        self.reporter = transport.reporter if self.rank == 0 else None  # the run's events come from rank 0
        self.window: Optional[StepWindow] = None
        self.partials: Optional[list] = None  # every rank's sums of the epoch a step checkpoint stopped in
        self.replicas = None  # fault_tolerance="replica_groups": this worker's group (engine/replica_groups.py)

    # ------------------------------------------------------------------ the run

    def run(self, entered: Optional[float] = None) -> dict:
        """Train the run's remaining epochs; ``entered``: when the transport's entry point started (``time.time()``)."""
        POSITION.reset()  # this attempt's place, read by the transport's heartbeat (engine/liveness.py)
        self.transport.start_heartbeat(self.rank, self.world)
        try:
            self.setup(entered)
        except BaseException:
            self.transport.finish()
            raise
        try:
            self._train()
        finally:
            self.transport.finish()
            self.feed.close()
            self.observer.close()
            if self.replicas is not None:
                self.replicas.shutdown()
        return {"epochs": self.state.epoch, "steps": self.state.step}

    def _train(self) -> None:
        while True:
            try:
                run_epochs(self.cfg, self.state, self.train_epoch, self.evaluate, self.checkpoints.save_epoch,
                           has_val=self.data.val is not None)
                return
            except HealedFromPeer:  # this replica group took a live peer's state: it goes on from its position
                self.feed.resume_at(self.state.epoch, self.state.step_in_epoch)
                self.partials = None
            except RunOver:  # a replacement that came after the run's end
                return

    def setup(self, entered: Optional[float] = None) -> None:
        """Everything before the first step: the model (the run's seed, then the resume point's weights), the step
        runner's placement, the data feed, optimizer, LR schedule, grad scaler, their states and every RNG."""
        entered = time.time() if entered is None else entered
        cfg, steps = self.cfg, self.steps
        self.transport.check_storage()  # this node reads and writes storage_path, before any step
        model = checkpoints.build_model(cfg, steps, self.data)
        self.checkpoints = CheckpointManager(cfg, steps, self.transport.checkpoint_store(), self.reporter, self.data)
        source = self.checkpoints.source()
        if cfg.init_from is not None and (source is None or cfg.save == "trainable"):
            self._init_from(model)  # a resume of this run wins, but a trainable-only checkpoint needs the rest
        self.observer = Observer(self, model)  # the FLOPs of a step (MFU), counted on the model as built
        restored = checkpoints.read(cfg, source, steps, self.rank)
        self.state = restored.state
        steps.setup(model, restored.model_state)
        self.feed = Feed(cfg, self.plan, steps, self.data, self.transport)
        self.optimizer = checkpoints.build_optimizer(cfg, steps)
        self.scheduler = checkpoints.build_scheduler(cfg, self.optimizer, self.feed.steps_per_epoch)
        # fp16 on the compute device's type: "cpu" under GPU emulation, so the scaler runs there too
        self.scaler = steps.precision.grad_scaler()
        if restored.train_state is not None:
            checkpoints.load_train_state(steps, self.optimizer, self.scheduler, self.scaler, restored)
        checkpoints.restore_rng(restored, cfg.seed, self.ctx, self.state.step)
        if self.state.step_in_epoch:  # a step checkpoint: the epoch goes on after the steps it had trained
            self.feed.resume_at(self.state.epoch, self.state.step_in_epoch)
            self.partials = (restored.train_state or {}).get(checkpoints.PARTIALS)
        self.window = (StepWindow(steps.device, self.plan.replicas, sees_loss=steps.sees_loss,
                                  reads_data=steps.reads_data)
                       if self.transport.reports_scalars(self.rank, steps) else None)
        self.end_step = OptimizerStep(cfg, self.optimizer, self.scheduler, steps.clip, self.scaler, self.window,
                                      grad_norm=steps.grad_norm,
                                      agree=steps.agree_found_inf if steps.agrees_on_overflow else None)
        self.replicas = self.transport.replica_groups(steps.device)
        if self.replicas is not None:
            self.replicas.attach(self.replica_state, self.load_replica_state, self.state.step)
        self.checkpoints.start(self.state, self.optimizer, self.scheduler, self.scaler, self.transport.preemption())
        self.observer.start(self.state.step)  # the profiler's window, from here
        if self.reporter is not None:
            self.reporter.startup(entered, time.time(), self.state.checkpoint)

    def replica_state(self) -> dict:
        """What a replica group that joins late takes from this one (``engine/replica_groups.py``): the weights, the
        optimizer, LR schedule and grad scaler, and where the run stands."""
        state = self.state
        return {"model": self.steps.named_model().state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "run": {"epoch": state.epoch, "step": state.step, "step_in_epoch": state.step_in_epoch,
                        "history": state.history}}

    def load_replica_state(self, taken: dict) -> None:
        self.steps.named_model().load_state_dict(taken["model"])
        self.steps.load_optimizer(self.optimizer, taken)
        self.scheduler.load_state_dict(taken["scheduler"])
        self.scaler.load_state_dict(taken["scaler"])
        for key, value in taken["run"].items():
            setattr(self.state, key, value)

    def _init_from(self, model: torch.nn.Module) -> None:
        """``init_from``'s weights into the model as built (every rank that holds weights: fsdp's rank 0 sends
        them on); rank 0 tells the driver what matched."""
        if self.steps.build_on_meta():
            return
        state, info = read_weights(self.cfg.init_from)
        report = load_weights(model, state, self.cfg.init_strict, self.cfg.init_from)
        if self.reporter is not None:
            self.reporter.notice(f"init_from {info['path']}: {report.describe()}")

    # ------------------------------------------------------------------ one epoch

    def train_epoch(self, epoch: int) -> dict:
        cfg, steps, state, feed = self.cfg, self.steps, self.state, self.feed
        steps.train()
        reset_peak_memory(steps.memory_devices())
        meter = EpochMeter(steps.device, steps.objective, finite_only=cfg.on_nonfinite == "skip")
        # Every rank but 0 of a Ray Train run holds its last report until the controller takes it, and rank 0
        # would wait for it in the first all-reduce, inside its steps: waited for here, it is checkpoint time.
        meter.checkpoint_s += barrier_s()
        batches = feed.epoch(epoch)
        done, spe, window = state.step_in_epoch, feed.steps_per_epoch, self.window
        self.checkpoints.resumed(spe)  # the driver's "resuming at step S", once
        if done:
            meter.resume(_own_partials(self.partials, self.ctx))
        if window is not None:
            window.resume()
        next_batch = feed.batches(batches, meter, window, self.observer.first_batch)
        context, watch = steps.step_context, cfg.on_nonfinite == "stop"
        context.epoch, self.end_step.epoch = epoch, epoch + 1
        if watch:  # the loss sum after every step: on the device, counted once an epoch
            meter.watch_loss(spe - done)
        replicas = self.replicas
        parameters = steps.parameters() if replicas is not None else None
        for _ in range(done, spe):
            if at_max_steps(cfg, state.step):
                break
            started = time.perf_counter()
            POSITION.at_step(state.step)
            if replicas is not None:
                replicas.begin_step()  # the groups' quorum (a late one heals here)
            context.step = state.step
            steps.train_step(next_batch, meter, window, self.scaler, feed.accum)
            if watch:
                meter.record_step()
            done += 1
            if replicas is not None and not replicas.commit(parameters):
                # not counted (a peer lost inside it): its gradients are dropped and its batch, as torchft does
                self.optimizer.zero_grad(set_to_none=True)
                state.step_in_epoch = done
                continue
            state.step += 1
            scalars = self.end_step(state.step)
            took = time.perf_counter() - started
            steps.step_time(took)
            POSITION.stepped_in(took)
            if scalars is not None:  # a log_every_n_steps window closed (a rank that reports scalars)
                self.transport.reporter.scalars(state.step, scalars)
            if self.reporter is not None:
                self.reporter.step(done, spe, epoch + 1)
            state.step_in_epoch = done
            self.observer.after_step(state.step, meter)  # the profiler's window; evaluation every N steps
            # checkpoint_every_n_steps (or _minutes), or the first preemption notice
            self.checkpoints.after_step(spe, meter)
        state.step_in_epoch = 0
        self.partials = None
        POSITION.mark("epoch end")
        # steps since the epoch's loss sum turned NaN or infinite (it stays so): read with the epoch's row
        return self._epoch_row(epoch, meter, done, meter.loss_not_finite() if watch else None)

    def _epoch_row(self, epoch: int, meter: EpochMeter, steps_done: int, bad: Optional[torch.Tensor] = None) -> dict:
        steps = self.steps
        sums = meter.totals
        # the time in steps: step checkpoints and evaluations every N steps are not training
        training_s = meter.elapsed() - meter.checkpoint_s - meter.eval_s
        reading_s = training_s if steps.reads_data else 0.0
        norm_sum, norms = self.end_step.epoch_norm()
        own = torch.tensor([meter.data_wait_s, training_s, meter.checkpoint_s, reading_s, meter.eval_s,
                            self.end_step.skipped], dtype=torch.float64, device=sums.device)
        norm = (norm_sum if norm_sum is not None else torch.zeros((), dtype=torch.float64, device=sums.device))
        extras = meter.extra_sums()
        # one all-reduce of every rank's loss, metric and extra sums and counts, its times and its skipped steps
        reduced, groups = all_reduce_sum(torch.cat([sums, extras, own, norm.reshape(1).to(sums)])), 1
        if self.replicas is not None:  # and over the replica groups of the current quorum
            reduced, groups = self.replicas.sum_over_groups(reduced)
        reduced = reduced.tolist()
        totals, extras = reduced[:len(sums)], reduced[len(sums):len(sums) + len(extras)]
        wait_sum, train_sum, checkpoint_sum, reading_sum, eval_sum, skipped, norm_sum = reduced[-7:]
        loss_sum, samples, metric_totals = meter.split(totals)
        # one small object all-gather per epoch: memory peaks, devices, the runner's own record, non-finite steps
        gathered = all_gather_objects((peak_memory_bytes(steps.memory_devices()), self._where(), steps.epoch_stats(),
                                       int(bad) if bad is not None else 0))
        world, stats = self.world * groups, [stats for _, _, stats, _ in gathered]
        self._stop_if_not_finite(epoch, [b for *_, b in gathered])
        # samples count targets (tokens for LMs); throughput is training throughput: samples over the mean
        # rank's time in steps. checkpoint_s gains the epoch's own checkpoint, eval_s the evaluation.
        row = epoch_row(epoch=epoch, state=self.state, lr=self.optimizer.param_groups[0]["lr"], loss_sum=loss_sum,
                        metric_totals={**metric_totals, **meter.split_extras(extras)}, samples=samples,
                        elapsed_s=train_sum / world, steps=max(steps_done, 1),
                        data_wait_share=wait_sum / max(reading_sum, 1e-9),
                        peak_memory_bytes=[b for peaks, *_ in gathered for b in peaks],
                        devices=_devices([where for _, where, *_ in gathered]), workers=world,
                        checkpoint_s=checkpoint_sum / world, eval_s=eval_sum / world,
                        **self.observer.columns(steps_done, train_sum / world),
                        **steps.epoch_columns(stats))
        if getattr(self.data, "seq_len", None):  # a language model's: samples count the targets, its tokens
            row["tokens_per_s"] = samples / max(train_sum / world, 1e-9)
        if norms:
            row["grad_norm"] = norm_sum / world / norms  # the mean over its steps (every rank has the global norm)
        if self.replicas is not None:  # steps averaged over fewer groups than the run has, steps not counted
            row.update(self.replicas.epoch_columns())
        if self.cfg.on_nonfinite == "skip":
            row["skipped_steps"] = int(round(skipped / world))
            self.end_step.skipped = 0
        scalars = steps.epoch_scalars(stats, row) if self.reporter is not None else None
        if scalars:  # the runner's figures of the epoch (a pipeline's per stage)
            self.reporter.scalars(self.state.step, scalars)
        return row

    def _stop_if_not_finite(self, epoch: int, bad_per_rank: list) -> None:
        """``on_nonfinite="stop"``: the epoch's loss turned NaN or infinite on some rank: stop before its row is
        checkpointed, naming the first such step (the loss sum stays non-finite once it is)."""
        if max(bad_per_rank, default=0) > 0:
            first = self.state.step - max(bad_per_rank) + 1
            raise NonFiniteError("the training loss became NaN or infinite", epoch + 1, first,
                                 [rank for rank, b in enumerate(bad_per_rank) if b])

    def _where(self) -> dict:
        return {**self.ctx.assignment.record(), **self.transport.where()}

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, split: str) -> dict:
        """Loss and metrics over the whole ``split`` (test or val): every replica takes a disjoint shard."""
        self.steps.train(False)
        meter = EpochMeter(self.steps.device, self.steps.objective)
        POSITION.mark(f"evaluating {split}")  # the step runners mark each batch (parallel/steps.py, pipeline/executor.py)
        self.steps.evaluate(self.feed.eval_loaders[split], meter)
        self.steps.train()
        sums, extras = meter.totals, meter.extra_sums()  # extras: a custom step's scalars
        values = all_reduce_sum(torch.cat([sums, extras])).tolist()
        loss_sum, samples, metric_totals = meter.split(values[:len(sums)])
        columns = eval_columns(loss_sum, samples, {**metric_totals, **meter.split_extras(values[len(sums):])},
                               split=split)
        if getattr(self.data, "seq_len", None) and self.cfg.loss == "cross_entropy":  # a language model's
            columns.update(perplexity_column(split, columns[f"{split}_loss"]))
        return columns


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
