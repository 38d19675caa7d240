"""One stage process of the pipeline's actor group: it joins the process group, then runs the engine
(``engine/loop.py``) with its stage runner (``pipeline/steps.py``) and :class:`StageTransport`. Plain
Python: the Ray actor (``group.py``) and the tests' local processes (``tests/_pipeline_local.py``) call the
same methods in the same order on every rank (SPMD).

Batch arithmetic (nanoGPT style): global batch B = D replicas x b per replica, and b = m micro-batches x
B / (D m) rows; replica r's first stage reads positions r, r+D, ... of each epoch's seeded permutation
(``engine/feed.py``), so the run matches one process with batch B.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import List, Optional

import ray
import torch
import torch.distributed as dist
from torch.utils.data._utils.collate import default_collate

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.data.ray_datasets import use_shards
from raytrain_mgpu.driver.heartbeat import Heartbeat
from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.models import build_model
from raytrain_mgpu.models.partition import Partition, blocks_of, profile_costs
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.pipeline.p2p import Comm, build_groups, nccl_semantics, warm_up
from raytrain_mgpu.pipeline.schedule import build_order, channel_sequences, num_virtual_stages, stage_rank
from raytrain_mgpu.pipeline.steps import PipelineSteps
from raytrain_mgpu.engine import devices
from raytrain_mgpu.transports.placement import free_address, node_ip, ray_gpu_ids
from raytrain_mgpu.transports.preemption import DrainWatcher
from raytrain_mgpu.engine.feed import steps_per_epoch
from raytrain_mgpu.transports.base import FolderTransport, rank_devices, rank_engine
from raytrain_mgpu.strategies import WorkerContext
from raytrain_mgpu.strategies.plan import RunPlan, build_plan
from raytrain_mgpu.transports.collective_timeouts import name_stuck_ranks
from raytrain_mgpu.transports.retry import errors_whole

logger = logging.getLogger(__name__)

__all__ = ["StageWorker", "StageTransport"]


class StageTransport(FolderTransport):
    """A stage actor's transport: its events through the run's progress channel (replica 0's first stage
    reports the run's events; it and the last stage per-step scalars), checkpoints published in the run
    folder by rank 0 once every stage's part is in (a barrier over the group's gloo group)."""

    def __init__(self, cfg, stage: "StageWorker", attempt: str, sink):
        reports = stage.replica == 0 and (stage.is_first or stage.is_last)
        super().__init__(cfg, stage.rank, attempt, WorkerReporter(sink if reports else None),
                         barrier=lambda: dist.barrier(group=stage.gloo))
        self.stage, self.sink = stage, sink

    def start_heartbeat(self, rank: int, world_size: int) -> None:
        # every stage of this attempt shares its token; outside Ray (local stages) nothing is sent
        self.heartbeat = Heartbeat(self.sink, rank, world_size, self.attempt, self.cfg.stall_timeout_s).start()

    def reports_scalars(self, rank: int, steps) -> bool:
        return self.reporter.sink is not None

    def where(self) -> dict:
        return {"gpu_ids": ray_gpu_ids(), "node_ip": node_ip()}

    def data_shard(self):
        return self.stage.data_shard["train"]

    def preemption(self) -> dict:
        """A node's preemption (a drain): this actor's own watcher of Ray's draining nodes. A stage outside Ray
        (local processes) hears of none: asking Ray for its node there would start a Ray instance of its own."""
        if not ray.is_initialized():
            return super().preemption()
        self.watcher = DrainWatcher(ray.get_runtime_context().get_node_id())
        return {"local_notice": self.watcher.local_notice, "get_info": self.watcher.agreed}

    def finish(self) -> None:
        super().finish()
        if getattr(self, "watcher", None) is not None:
            self.watcher.close()


class StageWorker:
    """One pipeline rank of one replica. ``emulate_nccl`` forces NCCL's semantics on gloo on or off (default:
    on when emulating GPUs)."""

    def __init__(self, cfg: TrainConfig, rank: int, emulate_nccl: Optional[bool] = None,
                 plan: Optional[RunPlan] = None):
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
        self.assignment = rank_devices(cfg, 1, ray_gpu_ids())  # the rank start every transport makes
        self.device = self.assignment.compute[0]
        self.peers = [self.replica * self.num_ranks + r for r in range(self.num_ranks)]
        self.data_shard = None  # ingest="ray_data": this replica's Ray Data iterators by split (use_data_shard)

    def holds(self, stage: int) -> bool:
        """Whether virtual stage ``stage`` runs on this rank."""
        return stage_rank(stage, self.num_ranks) == self.prank

    # ------------------------------------------------------------------ setup

    def address(self) -> tuple:
        return free_address()

    def use_data_shard(self, shards: dict) -> None:
        """``ingest="ray_data"``: this replica's share of the training stream (read by its first stage) and, for the
        user's own Ray Datasets, the evaluated splits' iterators (before ``setup``)."""
        self.data_shard = shards
        use_shards(shards)

    def profile_blocks(self) -> List[float]:
        """Forward+backward seconds per block on one training micro-batch (``balance="time"``)."""
        data = build_datasets(self.cfg.data)
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.cfg.model, data.input_shape, data.num_classes, self.cfg.model_kwargs)
        x, _ = default_collate([data.train[i] for i in range(min(self.plan.micro_batch, len(data.train)))])
        return profile_costs(blocks_of(model), x, self.device)

    def setup(self, master_addr: str, master_port: int, partition: Partition) -> dict:
        """Join the process group, create every channel's communicator, read the data's description."""
        cfg = self.cfg
        backend = devices.backend(cfg.use_gpu)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # device_id: NCCL creates the default communicator now, not on the first collective
        eager = {"device_id": self.device} if backend == "nccl" else {}
        world = self.num_ranks * self.num_replicas
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=world, timeout=timedelta(seconds=cfg.collective_timeout_s), **eager)
        self.gloo = dist.new_group(backend="gloo")  # checkpoints' barrier and small gathers, off the device
        self._build_groups()
        warm_up(self.comm, self.groups, self.device)
        self.partition = partition
        self.data = build_datasets(cfg.data)
        self.objective = Objective.of(cfg, self.data.num_classes)
        self.ctx = WorkerContext(self.rank, world, self.prank, self.num_ranks, self.replica, (self.device,),
                                 self.assignment)
        per_epoch = steps_per_epoch(cfg, len(self.data.train), self.num_replicas, self.plan.replica_batch)
        return {"rank": self.rank, "steps_per_epoch": per_epoch, "has_val": self.data.val is not None,
                "node_ip": node_ip(), **self.assignment.record(), "gpu_ids": ray_gpu_ids(),
                "nccl_semantics": self.emulate_nccl}

    def _build_groups(self) -> None:
        """Every rank creates every group in the same order (a torch.distributed rule)."""
        P = self.num_ranks
        self.comm = Comm(self.rank, self.cfg.collective_timeout_s, self.emulate_nccl)
        order = build_order(self.cfg.schedule, P, self.cfg.num_microbatches)
        keys = [k for k in channel_sequences(order, self.num_stages) if k[1] != k[2]]
        first, last = stage_rank(0, P), stage_rank(self.num_stages - 1, P)
        self.groups = build_groups(self.comm, keys, P, self.num_replicas, self.rank, first, last)
        self.first_peer, self.last_peer = self.replica * P + first, self.replica * P + last

    # ------------------------------------------------------------------ the run

    @errors_whole(lambda self, *args: (self.rank, node_ip()) if _in_ray() else None)
    @name_stuck_ranks(lambda self, *args: self.cfg.collective_timeout_s)
    def run(self, attempt: str, sink=None) -> dict:
        """Train the run's remaining epochs with the engine (every rank at once); ``attempt``: this attempt's token
        (the checkpoints' temporary folders), ``sink``: the run's progress channel. An error reaches the driver
        whole, with its verdict (a stuck peer named)."""
        self.steps = PipelineSteps(self, self.partition)
        transport = StageTransport(self.cfg, self, attempt, sink)
        engine = rank_engine(self.cfg, self.plan, self.ctx, transport, self.data, self.steps)
        try:
            return engine.run()
        finally:
            self.history = getattr(engine, "state", None) and engine.state.history

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _in_ray() -> bool:
    """Whether this stage is a Ray actor (the tests' local stages keep their errors in their process)."""
    return ray.is_initialized()
