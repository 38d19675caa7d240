"""The training loop each Ray Train worker runs, the same for every data-parallel strategy.

Batch arithmetic: the global batch B is split over R data-parallel replicas and A
accumulation micro-steps, so each micro-batch holds B / (R * A) samples. The
``DistributedSampler`` (``drop_last=True``) gives replica r the positions r, r+R, ...
of one seeded permutation per epoch, so optimizer step s always sees positions
[s*B, (s+1)*B) of that permutation: the samples of a step do not depend on R.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import ray.train
import torch
from torch.utils.data import DataLoader

from raytrain_mgpu.batches import shape_record, to_device
from raytrain_mgpu.runtime import ray_ingest
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.runtime.devices import resolve_devices
from raytrain_mgpu.runtime.engine import OptimizerStep, run_epochs
from raytrain_mgpu.runtime.faults import name_stuck_ranks
from raytrain_mgpu.runtime.loaders import prefetch, test_loader, train_loader
from raytrain_mgpu.runtime.metrics import (EpochMeter, all_gather_list, all_reduce_sum, barrier_s, peak_memory_bytes,
                                           reset_peak_memory)
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.checkpointing import checkpoint_blocks
from raytrain_mgpu.objectives import Objective
from raytrain_mgpu.optim import build_optimizer, build_scheduler
from raytrain_mgpu.runtime.preemption import PreemptionCheck
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.runtime.step_checkpoints import STEP_IN_EPOCH, ResumableSampler
from raytrain_mgpu.runtime.run_state import RunState, epoch_row, eval_columns
from raytrain_mgpu.runtime.step_scalars import StepWindow
from raytrain_mgpu.runtime.worker_checkpoint import save_and_report
from raytrain_mgpu.runtime.worker_restore import load_train_state, restore, seed_rank_stream
from raytrain_mgpu.parallel import WorkerStrategy, build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.strategies.plan import RunPlan

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


_State = RunState  # what survives a restart: the same for both runners (runtime/run_state.py)


def _context(cfg: TrainConfig) -> WorkerContext:
    ctx = ray.train.get_context()
    # GPUs: this worker's ray.get_gpu_ids() through CUDA_VISIBLE_DEVICES (as Ray Train's
    # get_devices); under emulation the same cuda:k are recorded and the CPU computes.
    assignment = resolve_devices(cfg.use_gpu, get_strategy(cfg.strategy).devices_per_worker(cfg))
    return WorkerContext(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(),
                         ctx.get_local_world_size(), ctx.get_node_rank(), assignment.compute, assignment)


def _device_record(ctx: WorkerContext) -> dict:
    """Every rank's intended devices and what Ray gave it (a collective: all ranks call it once)."""
    own = {**ctx.assignment.record(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
           "node_id": ray.get_runtime_context().get_node_id()}
    ranks = all_gather_list([own])
    return {"devices_per_rank": [r["devices"] for r in ranks], "backend": own["backend"],
            "emulated": own["emulated"], "gpu_ids_per_rank": [r["gpu_ids"] for r in ranks],
            "cuda_visible_devices_per_rank": [r["cuda_visible_devices"] for r in ranks],
            "node_id_per_rank": [r["node_id"] for r in ranks]}


@name_stuck_ranks
def train_worker(payload: dict) -> dict:
    """Entry point of ``TorchTrainer``: ``payload`` = {"config": TrainConfig, "plan": RunPlan, "sink": actor}."""
    entered = time.time()  # the start-up's clock (fit's: TrainResult.startup)
    cfg: TrainConfig = payload["config"]
    plan: RunPlan = payload["plan"]  # built once by fit: the batch arithmetic is not derived again here
    torch.set_num_threads(cfg.cpus_per_worker)
    ctx = _context(cfg)
    data = build_datasets(cfg.data)
    # The loss and metrics (factories imported here, on every worker): the strategy applies them.
    strategy = build_worker(get_strategy(cfg.strategy), cfg.parallel, ctx, Objective.of(cfg, data.num_classes))
    reporter = WorkerReporter(payload.get("sink") if ctx.world_rank == 0 else None)

    model = _build_model(cfg, strategy, data.input_shape, data.num_classes)
    state, restored = restore(cfg, strategy, model)
    model = strategy.setup_model(model)
    if cfg.compile:
        model = torch.compile(model)

    shard, num_shards = strategy.data_shard()
    # Micro-steps per optimizer step for this world size: an elastic run's micro-batch is fixed by its max
    # count, so W workers accumulate max x grad_accum_steps / W (the global batch and steps per epoch stay).
    accum = plan.micro_batches_at(num_shards)  # ValueError for a count the plan does not have
    micro_batch = plan.micro_batch
    sampler = ResumableSampler(data.train, num_replicas=num_shards, rank=shard, shuffle=True,
                               seed=cfg.seed, drop_last=True)
    loader = train_loader(cfg.data, data.train, sampler, micro_batch, strategy.device)
    if cfg.ingest == "ray_data":  # Ray Data streams each worker an equal share instead (runtime/ray_ingest.py)
        loader = ray_ingest.shard_loader(cfg, micro_batch, len(data.train))
        sampler = loader.sampler  # set_epoch seeds the stream's local shuffle; no rows to prefetch
    steps_per_epoch = len(loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(f"TrainConfig.batch_size={cfg.batch_size} is larger than the training split "
                         f"({len(data.train)} samples): no full step fits in an epoch. Lower batch_size.")
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch, cfg.epochs)
    # fp16 on the compute device's type: "cpu" under GPU emulation, so the scaler runs there too.
    scaler = torch.amp.GradScaler(strategy.device.type, enabled=cfg.precision == "16-mixed")
    if restored is not None:
        load_train_state(strategy, model, optimizer, scheduler, scaler, restored)

    shape_info = {"input_shape": shape_record(data.input_shape), "num_classes": data.num_classes}
    loop = _Loop(cfg, strategy, model, optimizer, scheduler, scaler, loader, reporter, steps_per_epoch)
    loop.accum_steps = accum
    if state.step_in_epoch:  # a step checkpoint: the epoch goes on after the positions it had trained
        sampler.resume_at(state.epoch, state.step_in_epoch * accum * micro_batch)
        loop.partials = restored.get("epoch_partial_per_rank")
    loop.save_step = lambda meter: save_and_report(  # checkpoint_every_n_steps (runtime/step_checkpoints.py)
        cfg, strategy, model, optimizer, scheduler, scaler, state,
        {"epoch": state.epoch, "step": state.step, STEP_IN_EPOCH: state.step_in_epoch}, ctx, shape_info,
        reporter, epoch_partial=meter.partial())
    evaluated = {split: test_loader(cfg.data, dataset, shard, num_shards, plan.replica_batch, strategy.device)
                 for split, dataset in (("test", data.test), ("val", data.val)) if dataset is not None}
    reporter.startup(entered, time.time())

    def train_epoch(epoch: int) -> dict:
        sampler.set_epoch(epoch)  # the loader hands the epoch to transforms with the indices (runtime/loaders.py)
        prefetch(data.train, sampler)  # Parquet: load exactly this worker's rows once, before the loader forks
        return loop.train_epoch(epoch, state)

    # Every rank evaluates the same epochs (all-reduced rows); the row goes to the driver once its
    # checkpoint is written (checkpoint_s counts that write).
    run_epochs(cfg, state, train_epoch, lambda split: loop.evaluate(evaluated[split], split),
               lambda row: save_and_report(cfg, strategy, model, optimizer, scheduler, scaler, state, row, ctx,
                                           shape_info, reporter, send_row=True), has_val=data.val is not None)
    # An early stop is read from the history at the loop's top: every rank stops after the same epoch.
    return {"epochs": state.epoch, "steps": state.step}


def _build_model(cfg: TrainConfig, strategy: WorkerStrategy, input_shape: tuple, num_classes: int) -> torch.nn.Module:
    """The initial model, the same on every rank; then each rank's own random stream."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every worker
    # fsdp's ranks other than 0 build on meta (no memory): rank 0's weights reach their shards.
    with torch.device("meta") if strategy.build_on_meta() else contextlib.nullcontext():
        model = build_model(cfg.model, input_shape, num_classes, cfg.model_kwargs)
    if cfg.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    checkpoint_blocks(model, cfg.activation_checkpointing)  # as the pipeline's stages (models/checkpointing.py)
    # With the shared seed every rank would draw the same dropout masks: R copies of one mask.
    seed_rank_stream(cfg.seed, strategy.ctx.world_rank)
    return model


class _Loop:
    """One epoch of training and one pass of evaluation, with their metrics."""

    def __init__(self, cfg, strategy: WorkerStrategy, model, optimizer, scheduler, scaler, loader, reporter,
                 steps_per_epoch: int):
        self.cfg, self.strategy, self.model = cfg, strategy, model
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.loader, self.reporter, self.steps_per_epoch = loader, reporter, steps_per_epoch
        self.device = strategy.device
        dtype = _DTYPES.get(cfg.precision)
        # fp32: no autocast context at all (entering a disabled one costs ~3.5 us a micro-batch on CPU)
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=dtype)) if dtype is not None else (
            contextlib.nullcontext)
        self.partials: Optional[list] = None  # every rank's sums of the epoch a step checkpoint stopped in
        self.accum_steps = cfg.grad_accum_steps  # micro-steps per optimizer step (train_worker: its world size's)
        self.save_step = None  # writes a step checkpoint (set by train_worker)
        self.preemption = PreemptionCheck(cfg, reporter)  # checks only where save_step is set (on Ray Train)
        # Per-step scalars on the rank that holds the sink (rank 0); the other ranks do nothing extra.
        self.window = (StepWindow(self.device, strategy.data_shard()[1])
                       if getattr(reporter, "sink", None) is not None else None)
        # the end of each step, as the pipeline's stages end theirs (runtime/engine.py)
        self.end_step = OptimizerStep(cfg, optimizer, scheduler, self._clip, scaler, self.window)

    def _to_device(self, x, y):
        """Inputs and targets (tensors, or tuples/dicts of them: ``raytrain_mgpu.batches``) on the device."""
        return to_device(x, self.device, self.cfg.channels_last), to_device(y, self.device)

    def train_epoch(self, epoch: int, state: _State) -> dict:
        cfg, accum = self.cfg, self.accum_steps
        self.model.train()
        reset_peak_memory(self.strategy.memory_devices())
        meter = EpochMeter(self.device, self.strategy.objective)
        # Every rank but 0 holds its last report until Ray Train's controller takes it (up to a poll: the
        # kill-right-after-report guarantee, runtime/faults.py), and rank 0 would wait for it in the first
        # all-reduce, inside its steps. Waited for here, it is checkpoint time, not training.
        meter.checkpoint_s += barrier_s()
        batches = iter(self.loader)
        steps, window = state.step_in_epoch, self.window  # a step checkpoint resumes part-way
        self.preemption.resumed(state, self.steps_per_epoch)  # the driver's "resuming at step S", once
        if steps:
            meter.resume(_own_partials(self.partials, self.strategy.ctx))
        if window is not None:
            window.resume()
        for _ in range(steps, self.steps_per_epoch):
            if cfg.max_steps is not None and state.step >= cfg.max_steps:
                break
            for micro in range(accum):
                wait_start = time.perf_counter()
                x, y = next(batches)
                waited = time.perf_counter() - wait_start
                meter.data_wait_s += waited
                x, y = self._to_device(x, y)
                # Gradients are all-reduced only on the last micro-step of a step.
                sync = contextlib.nullcontext() if micro == accum - 1 else self.strategy.no_sync(self.model)
                with sync:
                    with self.autocast():
                        loss, outputs = self.strategy.compute_loss(self.model, x, y)
                    self.scaler.scale(loss / accum if accum > 1 else loss).backward()
                counted = meter.samples
                meter.add(loss, outputs, y)  # metrics on the outputs, or the sums computed where they live
                del outputs  # not held through the next forward: one micro-batch of outputs less per device
                if window is not None:
                    window.add_loss(loss, meter.samples - counted)  # the samples (targets) the meter counted
                    window.add_data_wait(waited)
            state.step += 1
            steps += 1
            scalars = self.end_step(state.step)
            if scalars is not None:  # a log_every_n_steps window closed (rank 0)
                self.reporter.scalars(state.step, scalars)
            self.reporter.step(steps, self.steps_per_epoch, epoch + 1)
            state.step_in_epoch = steps
            if self.save_step is not None:  # checkpoint_every_n_steps, or the first preemption notice
                self.preemption.after_step(state.step, steps, self.steps_per_epoch, lambda: self._save_step(meter))
        state.step_in_epoch = 0
        return self._epoch_metrics(epoch, state, meter, steps)

    def _save_step(self, meter: EpochMeter) -> None:
        """A step checkpoint; its time is the epoch's ``checkpoint_s``, not training (``training_s``), with
        the wait for the other ranks to hand their reports to Ray Train's controller (see ``train_epoch``)."""
        start = time.perf_counter()
        self.save_step(meter)
        barrier_s()
        meter.checkpoint_s += time.perf_counter() - start

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip this worker's model's gradients to ``max_norm``; their total norm (on the device, unread)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def _epoch_metrics(self, epoch: int, state: _State, meter: EpochMeter, steps: int) -> dict:
        elapsed = meter.elapsed()
        sums = meter.totals  # one all-reduce of every rank's loss and metric sums and counts, and its times
        training_s = elapsed - meter.checkpoint_s  # the time in steps: step checkpoints are not training
        totals = all_reduce_sum(torch.cat([sums, torch.tensor(
            [meter.data_wait_s, training_s, meter.checkpoint_s], dtype=torch.float64, device=sums.device)])).tolist()
        *sums, wait_sum, train_sum, checkpoint_sum = totals
        loss_sum, samples, metric_totals = meter.split(sums)
        peaks = all_gather_list(peak_memory_bytes(self.strategy.memory_devices()))
        world = self.strategy.ctx.world_size
        # samples count targets (tokens for LMs); throughput is training throughput: samples over the mean
        # worker's time in steps. checkpoint_s gains the epoch's own checkpoint (save_and_report), eval_s
        # the evaluation (train_worker): the three add up to the epoch's wall time.
        return epoch_row(epoch=epoch, state=state, lr=self.optimizer.param_groups[0]["lr"], loss_sum=loss_sum,
                         metric_totals=metric_totals, samples=samples, elapsed_s=train_sum / world, steps=steps,
                         data_wait_share=wait_sum / max(train_sum, 1e-9), peak_memory_bytes=peaks,
                         devices=_device_record(self.strategy.ctx),  # one small object all-gather per epoch
                         workers=world,  # elastic: the count that ended the epoch
                         checkpoint_s=checkpoint_sum / world, eval_s=0.0)

    @torch.no_grad()
    def evaluate(self, loader: DataLoader, split: str) -> dict:
        """Loss and metrics over the whole ``split`` (test or val): every worker takes a disjoint shard."""
        self.model.eval()
        meter = EpochMeter(self.device, self.strategy.objective)
        for x, y in loader:
            x, y = self._to_device(x, y)
            with self.autocast():
                loss, outputs = self.strategy.compute_loss(self.model, x, y)
            meter.add(loss.float(), outputs, y)
        return eval_columns(*meter.split(all_reduce_sum(meter.totals).tolist()), split=split)


def _own_partials(partials: Optional[list], ctx: WorkerContext) -> list:
    """This rank's saved epoch sums; all of them on rank 0 when the world size changed (they are summed anyway)."""
    if not partials:
        return []
    if len(partials) == ctx.world_size:
        return [partials[ctx.world_rank]]
    return list(partials) if ctx.world_rank == 0 else []
