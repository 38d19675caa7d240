"""What one stage process does: build its part of the model, read its data, train,
evaluate and save. Plain Python: the Ray actor (``group.py``) and the tests' local
processes (``tests/_pipeline_local.py``) call the same methods in the same order on every
rank (SPMD).

Ranks: global rank ``g = replica * num_stages + pipeline_rank``. Pipeline rank 0 reads
the data and sends the targets to the last pipeline rank, which computes the loss (so
only one rank pays for data loading); the others only pass activations. Actors holding
the same pipeline rank in different replicas average their gradients every step.

Batch arithmetic (nanoGPT style): global batch B = D replicas x b per replica, and
b = m micro-batches x B / (D m) rows. The ``DistributedSampler`` gives replica r the
positions r, r+D, ... of one seeded permutation per epoch, so step s always trains on
positions [sB, (s+1)B) of it, whatever D is: the run matches one process with batch B.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils.data._utils.collate import default_collate

from raytrain_mgpu.batches import flatten, split, unflatten
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime import devices
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.runtime.engine import OptimizerStep
from raytrain_mgpu.runtime.loaders import prefetch, test_loader, train_loader
from raytrain_mgpu.runtime.metrics import EpochMeter, StageTotals, peak_memory_bytes, reset_peak_memory
from raytrain_mgpu.runtime.placement import free_address, node_ip, ray_gpu_ids
from raytrain_mgpu.runtime.prefetch import Prefetcher
from raytrain_mgpu.runtime.ray_ingest import ShardLoader
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.step_checkpoints import ResumableSampler
from raytrain_mgpu.runtime.step_scalars import StepWindow, WindowedMeter
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.checkpointing import checkpoint_blocks
from raytrain_mgpu.objectives import Objective
from raytrain_mgpu.pipeline.checkpoints import BackgroundWriter, epoch_partial, resume_sums, snapshot
from raytrain_mgpu.pipeline.executor import PipelineExecutor
from raytrain_mgpu.pipeline.p2p import Comm, build_groups, nccl_semantics, warm_up
from raytrain_mgpu.models.partition import Partition, blocks_of, build_stage_modules, profile_costs
from raytrain_mgpu.pipeline.schedule import (Order, build_order, channel_sequences, forward_only,
                                             num_virtual_stages, stage_rank)

from raytrain_mgpu.strategies.plan import RunPlan, build_plan

logger = logging.getLogger(__name__)
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def microbatch_rows(size: int, num_microbatches: int) -> List[int]:
    """Rows of each micro-batch when ``size`` rows are split like ``Tensor.tensor_split``."""
    chunks = min(num_microbatches, size)
    base, extra = divmod(size, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


class StageWorker:
    """One pipeline rank of one replica.

    ``emulate_nccl`` forces NCCL's semantics on gloo on or off (default: on when emulating
    GPUs).
    """

    def __init__(self, cfg: TrainConfig, rank: int,
                 emulate_nccl: Optional[bool] = None, plan: Optional[RunPlan] = None):
        torch.set_num_threads(cfg.cpus_per_worker)
        self.cfg, self.rank = cfg, rank
        self.emulate_nccl = nccl_semantics(cfg.use_gpu) if emulate_nccl is None else emulate_nccl
        self.num_ranks = cfg.num_stages
        # fit's plan, handed down by the driver; the local harness (no driver) builds the same one
        self.plan = plan if plan is not None else build_plan(cfg)
        self.num_replicas = self.plan.replicas
        self.replica, self.prank = divmod(rank, self.num_ranks)
        self.num_stages = num_virtual_stages(cfg.schedule, self.num_ranks)
        self.is_first = self.prank == stage_rank(0, self.num_ranks)
        self.is_last = self.prank == stage_rank(self.num_stages - 1, self.num_ranks)
        # Ray gives a stage actor one GPU; under emulation it computes on the CPU, cuda:k recorded
        self.assignment = devices.resolve_devices(cfg.use_gpu, 1)
        self.device = self.assignment.compute[0]
        self.replica_batch = self.plan.replica_batch
        self.rows = [self.plan.micro_batch] * self.plan.micro_batches_per_step
        # Per-step scalars from replica 0: its last stage sees the loss, its first reads the data.
        reports = self.replica == 0 and (self.is_first or self.is_last)
        self.window = StepWindow(self.device, self.num_replicas, sees_loss=self.is_last,
                                 reads_data=self.is_first) if reports else None
        self._targets_spec = None  # the last rank's: how the targets' tensors rebuild a batch's targets
        self.data_shard = None  # ingest="ray_data": this replica's Ray Data iterator (use_data_shard)
        self.uploads = BackgroundWriter(f"rank {rank}'s checkpoint upload")  # pipeline/checkpoints.py
        self._resume: Optional[tuple] = None  # (positions to skip, epoch_partial): a step checkpoint's epoch

    # ------------------------------------------------------------------ setup

    def address(self) -> tuple:
        return free_address()

    def use_data_shard(self, shard) -> None:
        """``ingest="ray_data"``: this replica's share of the stream, read by its first stage (before ``setup``)."""
        self.data_shard = shard

    def profile_blocks(self) -> List[float]:
        """Forward+backward seconds per block on one training micro-batch (``balance="time"``)."""
        data = build_datasets(self.cfg.data)
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.cfg.model, data.input_shape, data.num_classes, self.cfg.model_kwargs)
        x, _ = default_collate([data.train[i] for i in range(min(self.rows[0], len(data.train)))])
        return profile_costs(blocks_of(model), x, self.device)

    def setup(self, master_addr: str, master_port: int, partition: Partition, resume_dir: Optional[str],
              start_step: int, step_in_epoch: int = 0, partials: Optional[list] = None) -> dict:
        """Join the process group, build this rank's stages, data and optimizer; restore if resuming
        (``step_in_epoch``, ``partials``: a step checkpoint's, whose epoch the next ``start_epoch`` continues)."""
        cfg = self.cfg
        backend = devices.backend(cfg.use_gpu)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # device_id: NCCL creates the default communicator now, not on the first collective
        eager = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.num_ranks * self.num_replicas,
                                timeout=timedelta(seconds=cfg.collective_timeout_s), **eager)
        self.train_order = build_order(cfg.schedule, self.num_ranks, cfg.num_microbatches)
        self._build_groups()
        warm_up(self.comm, self.groups, self.device)
        self.data = build_datasets(cfg.data)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank as in one process
        model = build_model(cfg.model, self.data.input_shape, self.data.num_classes, cfg.model_kwargs)
        checkpointed = checkpoint_blocks(model, cfg.activation_checkpointing)  # as a Ray Train worker
        stages = build_stage_modules(model, partition)
        self.stages = {s: stages[s].to(self.device) for s in range(self.num_stages)
                       if stage_rank(s, self.num_ranks) == self.prank}
        del model, stages  # other ranks' blocks are freed here
        self.params = [p for stage in self.stages.values() for p in stage.parameters()]
        # The loss and metrics (factories imported on every rank; the last stage applies them).
        self.objective = Objective.of(cfg, self.data.num_classes)
        self.executor = PipelineExecutor(self.stages, self.prank, self.num_ranks, self.num_stages,
                                         [self.replica * self.num_ranks + r for r in range(self.num_ranks)],
                                         self.groups.channels, self.device, self.comm, _AUTOCAST.get(cfg.precision),
                                         objective=self.objective)
        self._build_data()
        from raytrain_mgpu.optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.steps_per_epoch, cfg.epochs)
        # the end of each step, as a Ray Train worker ends its (runtime/engine.py); the norm is the whole model's
        self.end_step = OptimizerStep(cfg, self.optimizer, self.scheduler, self._clip_gradients, window=self.window)
        torch.manual_seed(cfg.seed + 1 + self.rank)  # dropout differs between replicas
        if resume_dir is not None:
            self._restore(resume_dir)
        if step_in_epoch:  # step s trains positions [sB, (s+1)B) of the epoch's order: b of them per replica
            own = partials[self.rank] if partials and len(partials) == self.num_ranks * self.num_replicas else None
            self._resume = (step_in_epoch * self.replica_batch, own)
        self.step = start_step
        self._eval_orders: Dict[int, Order] = {}
        return {"rank": self.rank, "params": sum(p.numel() for p in self.params),
                "steps_per_epoch": self.steps_per_epoch, "has_val": self.data.val is not None, "checkpointed_blocks": checkpointed, "node_ip": node_ip(),
                **self.assignment.record(),
                "gpu_ids": ray_gpu_ids(), "nccl_semantics": self.emulate_nccl}

    def _build_groups(self) -> None:
        """Every rank creates every group in the same order (a torch.distributed rule)."""
        P = self.num_ranks
        self.comm = Comm(self.rank, self.cfg.collective_timeout_s, self.emulate_nccl)
        keys = [k for k in channel_sequences(self.train_order, self.num_stages) if k[1] != k[2]]
        first, last = stage_rank(0, P), stage_rank(self.num_stages - 1, P)
        self.groups = build_groups(self.comm, keys, P, self.num_replicas, self.rank, first, last)
        self.first_peer, self.last_peer = self.replica * P + first, self.replica * P + last

    def _build_data(self) -> None:
        cfg, D = self.cfg, self.num_replicas
        self.steps_per_epoch = len(self.data.train) // D // self.replica_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"TrainConfig.batch_size={cfg.batch_size} is larger than the training split "
                             f"({len(self.data.train)} samples): no full step fits in an epoch. Lower batch_size.")
        self.sampler = ResumableSampler(self.data.train, num_replicas=D, rank=self.replica, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
        self.loader = train_loader(cfg.data, self.data.train, self.sampler, self.replica_batch, self.device)
        if cfg.ingest == "ray_data":  # Ray Data streams this replica's equal share instead (runtime/ray_ingest.py)
            self.loader = ShardLoader(self.data_shard, self.replica_batch, self.steps_per_epoch, cfg.seed, self.replica)
            self.sampler = self.loader.sampler  # set_epoch seeds the stream's local shuffle; no rows to prefetch
        self.eval_loaders = {split: test_loader(cfg.data, dataset, self.replica, D, self.replica_batch, self.device)
                             for split, dataset in (("test", self.data.test), ("val", self.data.val))
                             if dataset is not None}

    def _restore(self, directory: str) -> None:
        state, train_state = ckpt_format.load_part(RunFolder.of(self.cfg), directory, f"-stage{self.prank}")
        for stage in self.stages.values():
            stage.load_model_state_dict(state)
        if train_state is None:
            raise ValueError(f"checkpoint {directory!r} has no train_state-stage{self.prank}.pt; it was not "
                             f"written by a pipeline run with this many stages. Use another `name`.")
        self.optimizer.load_state_dict(train_state["optimizer"])
        self.scheduler.load_state_dict(train_state["scheduler"])
        torch.set_rng_state(train_state["torch_rng"])

    # ------------------------------------------------------------------ training

    def start_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # the loader hands the epoch to transforms with the indices
        if self._resume is not None:  # the epoch a step checkpoint stopped in goes on after its positions
            self.sampler.resume_at(epoch, self._resume[0])
        if getattr(self, "_batches", None) is not None:
            self._batches.close()
        if self.is_first:  # Parquet: this replica's rows of the epoch, loaded once before the loader forks
            prefetch(self.data.train, self.sampler)
        self._batches = Prefetcher(iter(self.loader)) if self.is_first else None
        for stage in self.stages.values():
            stage.train()
        reset_peak_memory([self.device])
        self.meter = EpochMeter(self.device, self.objective)
        self.totals = StageTotals()
        if self._resume is not None:
            if self._resume[1] is not None:  # None: saved by another world size; the row counts the rest only
                resume_sums(self._resume[1], self.totals, self.meter)
            self._resume = None
        self._step_meter = self.meter
        if self.window is not None:
            self.window.resume()
            if self.is_last:
                self._step_meter = WindowedMeter(self.meter, self.window)

    def train_steps(self, num_steps: int) -> list:
        """``num_steps`` optimizer steps; ``[(step, scalars)]`` of the ``log_every_n_steps`` windows that closed."""
        closed = []
        for _ in range(num_steps):
            scalars = self._train_step()
            if scalars is not None:
                closed.append((self.step, scalars))
        return closed

    def _train_step(self) -> Optional[dict]:
        """One step; the scalars of the log_every_n_steps window it closed, if any."""
        start = time.perf_counter()
        inputs, targets, sends = self._read_batch(self._batches, self.cfg.num_microbatches)
        if self.is_first:
            waited = time.perf_counter() - start  # loading is synchronous
            self.totals.data_wait_s += waited
            if self.window is not None:
                self.window.add_data_wait(waited)
        stats = self.executor.train_step(self.train_order, inputs, targets, self.rows, self._step_meter)
        self._wait_targets_sent(sends)
        self._average_gradients()
        self.step += 1
        scalars = self.end_step(self.step)
        self.totals.add_step(stats, time.perf_counter() - start)
        return scalars

    def _read_batch(self, batches, num_chunks: int) -> tuple:
        """``(input micro-batches, target micro-batches, sends to wait for)`` for this rank.

        The first rank reads and sends the targets to the last rank: one small message per
        step instead of a second rank loading (and, for images, decoding) every sample.
        """
        if self.is_first:
            x, y = next(batches)
            sends = []
            if self.groups.targets is not None:  # a structured target: its tensors one after the other
                for tensor in flatten(y)[0]:
                    sends += self.comm.isend_with_header(tensor.to(self.device), self.last_peer, self.groups.targets)
            targets = split(y, num_chunks) if self.is_last else None
            return split(x, num_chunks), targets, sends
        if self.is_last:
            spec = self._target_spec()
            y = unflatten([self.comm.recv_with_header(self.first_peer, self.groups.targets, self.device,
                                                      f"rank {self.rank}: the targets from rank {self.first_peer}")
                           for _ in range(spec.num_leaves)], spec)
            return None, split(y, num_chunks), []
        return None, None, []

    def _target_spec(self):
        """The structure of a batch's targets (every sample has the same), from one sample of the data."""
        if self._targets_spec is None:
            self._targets_spec = flatten(default_collate([self.data.train[0]])[1])[1]
        return self._targets_spec

    def _wait_targets_sent(self, sends: list) -> None:
        for work, _ in sends:
            self.comm.wait(work, f"rank {self.rank}: sending the targets to rank {self.last_peer}")

    def _grads(self) -> List[torch.Tensor]:
        for p in self.params:
            if p.grad is None:  # a parameter unused this step still takes part in the all-reduce
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def _average_gradients(self) -> None:
        """Mean over the replicas holding this stage: one flat all-reduce per step."""
        if self.groups.stage is None:
            return
        grads = self._grads()
        flat = torch._utils._flatten_dense_tensors(grads)
        self.comm.all_reduce(flat, self.groups.stage)
        flat /= self.num_replicas
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over the whole model: the squared norms of all stages are summed; that norm (unread)."""
        grads = self._grads()
        squared = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else \
            torch.zeros((), device=self.device)
        if self.groups.replica is not None:
            self.comm.all_reduce(squared, self.groups.replica)
        norm = squared.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
        return norm

    def finish_epoch(self) -> dict:
        """This rank's sums for the epoch (the last stage's with its loss and metric sums); the driver adds the ranks."""
        if self.is_last:
            self.totals.take(self.meter)  # one device read per epoch
        return {**self.totals.as_dict(), **self.assignment.record(), "gpu_ids": ray_gpu_ids(),
                "nccl_semantics": self.emulate_nccl, "rank": self.rank, "prank": self.prank, "replica": self.replica,
                "is_last": self.is_last,
                "peak_memory_bytes": peak_memory_bytes([self.device])[0], "node_ip": node_ip(),
                "lr": self.optimizer.param_groups[0]["lr"]}

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, split: str = "test") -> Optional[dict]:
        """Loss and metric sums over this replica's shard of ``split`` (test or val; ``StageTotals``' keys; from
        the last rank, others None)."""
        for stage in self.stages.values():
            stage.eval()
        meter = EpochMeter(self.device, self.objective)
        loader = self.eval_loaders[split]
        size, bs = len(loader.dataset), loader.batch_size
        batches = iter(loader) if self.is_first else None
        for start in range(0, size, bs):
            rows = microbatch_rows(min(bs, size - start), self.cfg.num_microbatches)
            order = self._eval_orders.setdefault(len(rows), forward_only(self.num_ranks, len(rows), self.num_stages))
            inputs, targets, sends = self._read_batch(batches, len(rows))
            self.executor.eval_step(order, inputs, targets, rows, meter)
            self._wait_targets_sent(sends)
        for stage in self.stages.values():
            stage.train()
        if not self.is_last:
            return None
        totals = StageTotals()
        totals.take(meter)
        return {"loss_sum": totals.loss_sum, "targets": totals.targets, "metrics": totals.metrics}

    # ------------------------------------------------------------------ checkpoints

    def model_state(self) -> dict:
        """This rank's weights under the unsplit model's names."""
        state = {}
        for stage in self.stages.values():
            state.update(stage.model_state_dict())
        return state

    def save(self, directory: str, in_epoch: bool = False) -> Optional[dict]:
        """Replica 0 takes its state (a copy on CPU) and writes ``model-stage{p}.pt`` and
        ``train_state-stage{p}.pt`` into ``directory`` of the run folder, local or remote, in the background
        (replicas are identical; the previous upload's failure is raised here). ``in_epoch``: every rank
        returns its sums of the unfinished epoch (for the driver's ``meta.json``)."""
        if self.replica == 0:
            self.uploads.wait()  # one at a time (the driver has waited for it already: no stall here)
            model_state, train_state = snapshot(self.model_state(), self.optimizer, self.scheduler)
            self.uploads.submit(ckpt_format.save_part, RunFolder.of(self.cfg), directory, f"-stage{self.prank}",
                                model_state, train_state)
        return epoch_partial(self.totals, self.meter if self.is_last else None) if in_epoch else None

    def wait_upload(self) -> None:
        """Until this stage's upload in flight is written (its failure raised); called in the "upload" group."""
        self.uploads.wait()

    def close(self) -> None:
        if getattr(self, "_batches", None) is not None:
            self._batches.close()
        if dist.is_initialized():
            dist.destroy_process_group()
