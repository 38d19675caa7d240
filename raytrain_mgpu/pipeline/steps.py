"""A pipeline stage's step runner: what one rank of the pipeline's actor group gives the engine
(``engine/loop.py``), which runs on every stage actor as on every Ray Train worker (SPMD).

Ranks: global rank ``g = replica * num_stages + pipeline_rank``. Pipeline rank 0 reads the data (a
replica's whole batch, ``B / D`` rows) and sends the targets to the last pipeline rank, which computes the
loss (so only one rank pays for data loading); the others only pass activations. One optimizer step is
the schedule's forwards and backwards of ``num_microbatches`` micro-batches (``pipeline/executor.py``);
actors holding the same pipeline rank in different replicas then average their gradients (one flat
all-reduce), and the gradient norm for clipping is the whole model's (every stage's squares summed).
Replica 0's stages write the checkpoint's parts (``model-stage{p}.pt``, ``train_state-stage{p}.pt``).
"""

from __future__ import annotations

from statistics import mean
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils.data._utils.collate import default_collate

from raytrain_mgpu.engine.batches import flatten, split, unflatten
from raytrain_mgpu.models.partition import Partition, build_stage_modules
from raytrain_mgpu.pipeline.executor import PipelineExecutor, busy_of
from raytrain_mgpu.pipeline.schedule import Order, build_order, forward_only, ideal_bubble_fraction
from raytrain_mgpu.engine.precision import Precision
from raytrain_mgpu.engine.step import StepContext, Steps
from raytrain_mgpu.engine.step_scalars import WindowedMeter, stage_scalars

__all__ = ["PipelineSteps", "microbatch_rows"]


def microbatch_rows(size: int, num_microbatches: int) -> List[int]:
    """Rows of each micro-batch when ``size`` rows are split like ``Tensor.tensor_split``."""
    chunks = min(num_microbatches, size)
    base, extra = divmod(size, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


class PipelineSteps(Steps):
    """The stages of one pipeline rank (``stage`` is the actor's :class:`~raytrain_mgpu.transports.actor_group.stage.StageWorker`:
    its rank, process groups and data)."""

    read_ahead = True  # the first stage cannot fill its pipeline until micro-batch 0 exists: load in its bubble
    may_hold_no_parameters = True  # a stage of parameter-free blocks
    agrees_on_overflow = True  # fp16: a step is skipped on every stage when any stage's gradients overflowed

    def __init__(self, stage, partition: Partition):
        self.stage, self.partition, self.cfg = stage, partition, stage.cfg
        self.ctx, self.device, self.objective = stage.ctx, stage.device, stage.objective
        self.precision = Precision(self.cfg.precision, self.device.type)  # the executor's autocast, fp16's scaler
        self.step_context = StepContext(self.ctx.world_rank, self.ctx.world_size, self.device, self.cfg.precision,
                                        self.objective.loss, list(self.objective.names))
        self.reads_data, self.sees_loss = stage.is_first, stage.is_last
        self.shard = (stage.replica, stage.num_replicas)
        self.part = f"-stage{stage.prank}"
        self.train_order = build_order(self.cfg.schedule, stage.num_ranks, self.cfg.num_microbatches)
        self._eval_orders: Dict[int, Order] = {}
        self._targets_spec = None  # the last rank's: how the targets' tensors rebuild a batch's targets
        self._target_shapes = None  # a training step's targets' (shape, dtype)s, once the first has sent them
        self._totals = dict.fromkeys(("steps", "busy_s", "schedule_s", "step_s", "bytes_sent"), 0.0)
        self._spans: list = []
        self._scaling = False

    def loader_batch(self, plan) -> int:
        return plan.replica_batch  # split into micro-batches by the schedule

    def setup(self, model: torch.nn.Module, model_state: Optional[dict]) -> None:
        if model_state is not None:  # the merged parts, in the unsplit model's names
            model.load_state_dict(model_state)
        stage = self.stage
        modules = build_stage_modules(model, self.partition)
        self.stages = {s: modules[s].to(self.device) for s in range(stage.num_stages)
                       if stage.holds(s)}
        del model, modules  # other ranks' blocks are freed here
        self.params = [p for module in self.stages.values() for p in module.parameters()]
        self.executor = PipelineExecutor(self.stages, stage.prank, stage.num_ranks, stage.num_stages,
                                         stage.peers, stage.groups.channels, self.device, stage.comm,
                                         self.precision, objective=self.objective)

    def parameters(self) -> list:
        return self.params

    def owned_tensors(self) -> list:
        return [t for module in self.stages.values() for t in (*module.parameters(), *module.buffers())]

    def train(self, mode: bool = True) -> None:
        for module in self.stages.values():
            module.train(mode)

    # ------------------------------------------------------------------ a step

    def train_step(self, next_batch: Callable[[], tuple], meter, window, scaler, accum: int) -> None:
        inputs, targets, sends = self._read_batch(next_batch, self.cfg.num_microbatches, fixed=True)
        rows = [self.stage.plan.micro_batch] * self.cfg.num_microbatches
        step_meter = WindowedMeter(meter, window) if window is not None and self.sees_loss else meter
        self.executor.scaler = scaler if scaler.is_enabled() else None
        if self.executor.scaler is not None and not self._scaling:
            # the stages before the last receive gradients of the scaled loss, and unscale them with the same
            # factor: their scaler's scale starts with its first scale() (every stage's then moves alike)
            scaler.scale(torch.zeros((), device=self.device))
            self._scaling = True
        stats = self.executor.train_step(self.train_order, inputs, targets, rows, step_meter)
        self._wait_sent(sends)
        self._average_gradients()
        for key, value in (("steps", 1), ("busy_s", stats.busy_s), ("schedule_s", stats.wall_s),
                           ("bytes_sent", stats.bytes_sent)):
            self._totals[key] += value
        self._spans += stats.busy_spans or []  # CUDA's busy time: read once an epoch (epoch_stats)

    def step_time(self, seconds: float) -> None:
        self._totals["step_s"] += seconds

    def _read_batch(self, next_batch: Optional[Callable[[], tuple]], num_chunks: int, fixed: bool = False) -> tuple:
        """``(input micro-batches, target micro-batches, sends to wait for)`` for this rank: the first rank reads
        and sends the targets to the last (one small message a step instead of a second rank loading them).
        ``fixed``: a training step, whose targets have the same shapes every step: their shapes travel with the
        first step's only (a header's read is a host-device sync on a GPU)."""
        stage = self.stage
        known = fixed and self._target_shapes is not None
        if self.reads_data:
            x, y = next_batch()
            sends = []
            if stage.groups.targets is not None:  # a structured target: its tensors one after the other
                for tensor in flatten(y)[0]:
                    tensor = tensor.to(self.device).contiguous()
                    sends += ([(stage.comm.isend(tensor, stage.last_peer, stage.groups.targets), tensor)] if known
                              else stage.comm.isend_with_header(tensor, stage.last_peer, stage.groups.targets))
                if fixed:
                    self._target_shapes = True
            return split(x, num_chunks), split(y, num_chunks) if self.sees_loss else None, sends
        if self.sees_loss:
            spec, what = self._target_spec(), f"rank {stage.rank}: the targets from rank {stage.first_peer}"
            if known:
                leaves = [stage.comm.recv(torch.empty(shape, dtype=dtype, device=self.device), stage.first_peer,
                                          stage.groups.targets, what) for shape, dtype in self._target_shapes]
            else:
                leaves = [stage.comm.recv_with_header(stage.first_peer, stage.groups.targets, self.device, what)
                          for _ in range(spec.num_leaves)]
                if fixed:
                    self._target_shapes = [(tuple(t.shape), t.dtype) for t in leaves]
            return None, split(unflatten(leaves, spec), num_chunks), []
        return None, None, []

    def _target_spec(self):
        """The structure of a batch's targets (every sample has the same), from one sample of the data."""
        if self._targets_spec is None:  # the test split's: a streamed training split (Ray Data) is not indexed
            self._targets_spec = flatten(default_collate([self.stage.data.test[0]])[1])[1]
        return self._targets_spec

    def _wait_sent(self, sends: list) -> None:
        for work, _ in sends:
            self.stage.comm.wait(work, f"rank {self.stage.rank}: sending the targets to rank {self.stage.last_peer}")

    def _grads(self) -> List[torch.Tensor]:
        for p in self.params:
            if p.grad is None:  # a parameter unused this step still takes part in the all-reduce
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def _average_gradients(self) -> None:
        """Mean over the replicas holding this stage: one flat all-reduce per step."""
        stage = self.stage
        if stage.groups.stage is None:
            return
        grads = self._grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        stage.comm.all_reduce(flat, stage.groups.stage)
        flat /= stage.num_replicas
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def grad_norm(self) -> torch.Tensor:
        """The norm over the whole model: the squared norms of all of a replica's stages summed (unread)."""
        grads = self._grads()
        squared = (torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads
                   else torch.zeros((), device=self.device))
        if self.stage.groups.replica is not None:
            self.stage.comm.all_reduce(squared, self.stage.groups.replica)
        return squared.sqrt()

    def agree_found_inf(self, scaler, optimizer) -> None:
        """fp16, after ``scaler.unscale_``: every rank's overflow verdict becomes every rank's (one all-reduce of a
        flag on the device), so each stage's scaler skips the same steps and keeps the same scale."""
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # torch's own record of it
        # A stage without gradients (parameter-free blocks) has no verdict of its own, but takes part in the
        # all-reduce (the others wait for it) and records the agreed one (scaler.step needs one to step).
        flag = (torch.stack([value.to(self.device) for value in found.values()]).amax() if found
                else torch.zeros((), device=self.device))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not found:
            found[self.device] = flag
        for value in found.values():
            value.copy_(flag)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over the whole model (:meth:`grad_norm`); that norm (unread)."""
        grads = self._grads()
        norm = self.grad_norm()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        return norm

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, loader, meter) -> None:
        """This replica's shard of a split: forwards only, in micro-batches of the same schedule's shape."""
        size, bs = len(loader.dataset), loader.batch_size
        batches = iter(loader) if self.reads_data else None
        for start in range(0, size, bs):
            rows = microbatch_rows(min(bs, size - start), self.cfg.num_microbatches)
            order = self._eval_orders.setdefault(
                len(rows), forward_only(self.stage.num_ranks, len(rows), self.stage.num_stages))
            inputs, targets, sends = self._read_batch(batches and (lambda: next(batches)), len(rows))
            self.executor.eval_step(order, inputs, targets, rows, meter)
            self._wait_sent(sends)

    # ------------------------------------------------------------------ the epoch's row

    def epoch_stats(self) -> dict:
        """This rank's sums of the epoch (then reset): steps, busy and schedule time, bytes sent."""
        self._totals["busy_s"] += busy_of(self._spans)
        self._spans = []
        stats, self._totals = {**self._totals, "prank": self.stage.prank}, dict.fromkeys(self._totals, 0.0)
        return stats

    def epoch_columns(self, stats: list) -> dict:
        cfg = self.cfg
        steps = max(stats[0]["steps"], 1)
        per_stage = [[s for s in stats if s["prank"] == p] for p in range(self.stage.num_ranks)]
        return {"stage_step_time_s": [mean(s["step_s"] / steps for s in ranks) for ranks in per_stage],
                "bubble_fraction": mean(1 - s["busy_s"] / max(s["schedule_s"], 1e-9) for s in stats),
                "ideal_bubble_fraction": ideal_bubble_fraction(cfg.schedule, cfg.num_stages, cfg.num_microbatches),
                "bytes_between_stages_per_step": sum(s["bytes_sent"] for s in stats) / steps,
                "partition": list(self.partition.counts)}

    def epoch_scalars(self, stats: list, row: dict) -> dict:
        """``stage{k}/*``: each stage's step time, bubble and peak memory (``engine/step_scalars.stage_scalars``)."""
        memory = row["peak_memory_bytes"]
        return stage_scalars([{**s, "peak_memory_bytes": memory[rank]} for rank, s in enumerate(stats)],
                             self.stage.num_ranks)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_files(self, optimizer) -> dict:
        """Replica 0's stages write their weights (the unsplit model's names) and optimizer; replicas are equal."""
        if self.stage.replica != 0:
            return {}
        return {f"model{self.part}.pt": self.model_state(), f"train_state{self.part}.pt": {"optimizer": optimizer.state_dict()}}

    def model_state(self) -> dict:
        """This stage's weights under the unsplit model's names (its part of the whole model)."""
        state = {}
        for module in self.stages.values():
            state.update(module.model_state_dict())
        return state

    def meta_extra(self) -> dict:
        return {"partition": list(self.partition.counts), "num_stages": self.cfg.num_stages,
                "schedule": self.cfg.schedule}
