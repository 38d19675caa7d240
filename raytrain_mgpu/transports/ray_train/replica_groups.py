"""Replica groups through Ray Train (``fault_tolerance="replica_groups"``): the driver's backend config and a
worker's transport. The engine's side (the quorum each step, healing, the gradients' average) is
``engine/replica_groups.py``.

Ray Train's ``TorchftConfig`` makes every worker a replica group of its own, starts torchft's lighthouse beside the
controller and, when a worker is lost, replaces that worker alone while the others train on (the project's retry
policy still judges each failure: ``policy.OneRetryPolicy``). So a worker here:

- is a world of one for the engine (its process group is itself) and reads shard ``rank`` of ``world`` of the data;
- reports nothing to Ray Train while it trains (a report is a barrier of every worker, which a replaced worker
  would never reach): its checkpoints go to the run folder (``checkpointing/store.FolderStore``), written by the
  group that leads the current quorum alone, and a whole-group restart (every worker lost) resumes from them;
- on a first start, waits for every worker (Ray Train's barrier, at the end of the engine's set-up) so that no
  group trains alone before the others have started; a replacement does not (the others are training) and heals from a live group instead;
- once its run is over, marks the run folder so that a replacement that comes after the end (its quorum alone)
  stops instead of training on from an older checkpoint.

The marks are named after Ray Train's worker group (its synchronization actor): a whole-group restart is a new
group, which waits for every worker again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Optional

import ray
import ray.train
import ray.train.collective
from ray.train.torch import TorchConfig
from ray.train.v2._internal.execution import context as train_context  # by module: tests replace get_train_context
from ray.train.v2.torch.torchft_config import TorchftConfig  # Ray's side of torchft: torchft itself loads on use

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.checkpointing.store import FolderStore
from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.engine.replica_groups import ReplicaGroups
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.transports.base import Transport, rank_devices, rank_engine

__all__ = ["backend_config", "run_replica_group", "ReplicaGroupTransport", "LIGHTHOUSE", "QUORUM_TIMEOUT_S"]

LIGHTHOUSE = {"min_replicas": 1, "heartbeat_timeout_ms": 1000}
"""torchft's lighthouse: a quorum may hold one group (the survivor trains on alone), and a group that stopped
beating for a second is out of the next quorum. Measured on a 2-core machine: with ``min_replicas`` equal to the
groups, the survivor's quorum waits for the replacement (a lost worker stops the run for the replacement's start)."""

QUORUM_TIMEOUT_S = 30.0
"""torchft's bound on a collective between groups, a checkpoint's transfer to a joining group (the quorum's is
twice it): what a hung (not dead) peer costs the others once. A dead peer's socket fails at once."""


def backend_config(cfg, backend: str):
    """Ray Train's backend config for ``cfg``: ``TorchftConfig`` with the lighthouse above for replica groups, else
    its plain ``TorchConfig``."""
    if cfg.fault_tolerance != "replica_groups":
        return TorchConfig(backend=backend, timeout_s=int(cfg.collective_timeout_s))
    return TorchftConfig(lighthouse_kwargs=dict(LIGHTHOUSE), backend=backend,
                         timeout_s=int(cfg.collective_timeout_s))


class LeaderStore(FolderStore):
    """The run folder's store, written by the group that leads the quorum: the others' saves go to a scratch
    folder that is dropped (the engine's save is the same on every group; only where it lands differs)."""

    def __init__(self, transport: "ReplicaGroupTransport", reporter):
        super().__init__(transport.cfg, 0, uuid.uuid4().hex[:8], reporter)
        self.transport, self._scratch = transport, None

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> str:
        groups = self.transport.groups
        if groups is None or groups.leads():
            return super().begin(name, metrics, step, final, sharded)
        self._scratch = tempfile.mkdtemp(prefix="raytrain-mgpu-follower-")
        return self._scratch

    def commit(self, commit) -> None:
        if self._scratch is None:
            return super().commit(commit)
        self.abort(None)

    def abort(self, exc: Optional[BaseException]) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            return
        super().abort(exc)


class ReplicaGroupTransport(Transport):
    """One Ray Train worker as replica group ``rank`` of ``world`` (see the module docstring); rank 0 reports."""

    def __init__(self, cfg, rank: int, world: int, sink, worker_group: Optional[str] = None, barrier=None):
        """``worker_group``: Ray Train's worker group's id and ``barrier`` its barrier, unless given (a test's groups
        outside Ray)."""
        self.cfg, self.rank, self.world, self.sink = cfg, rank, world, sink
        self.reporter = WorkerReporter(sink if rank == 0 else None)
        self.groups: Optional[ReplicaGroups] = None
        self.worker_group = worker_group or _worker_group_id()
        self.barrier = barrier or ray.train.collective.barrier
        self.folder = RunFolder.of(cfg)

    def reports_scalars(self, rank: int, steps) -> bool:
        return self.reporter.sink is not None

    def checkpoint_store(self) -> LeaderStore:
        return LeaderStore(self, self.reporter)

    def replica_groups(self, device) -> ReplicaGroups:
        self.groups = ReplicaGroups(self.rank, self.world, device, f"{self.cfg.name}-{self.worker_group}",
                                    over=lambda: self._marked("finished"), timeout_s=QUORUM_TIMEOUT_S)
        # Made at the end of the engine's set-up: every group's manager beats before any asks for a quorum.
        # Measured: waited for before the set-up instead, the first group trained its first epoch (44 steps) alone.
        self._wait_for_every_group()
        return self.groups

    def where(self) -> dict:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def _wait_for_every_group(self) -> None:
        """A first start waits for every worker of the group (a replacement finds the mark and does not)."""
        if self._marked("started"):
            return
        self.barrier()
        if self.rank == 0:
            self._mark("started")

    def run_over(self) -> None:
        self._mark("finished")

    def _path(self, what: str) -> str:
        return self.folder.join(f".replica-groups-{self.worker_group}-{what}")

    def _marked(self, what: str) -> bool:
        return self.folder.fs.get_file_info(self._path(what)).type.name != "NotFound"

    def _mark(self, what: str) -> None:
        self.folder.fs.create_dir(self.folder.path, recursive=True)
        with self.folder.fs.open_output_stream(self._path(what)) as f:
            f.write(b"1")


def run_replica_group(cfg, plan, sink, entered: float) -> dict:
    """``train_worker``'s run for a replica group: this worker as a world of one reading its group's shard."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    assignment = rank_devices(cfg, get_strategy(cfg.strategy).devices_per_worker(cfg), ray.get_gpu_ids())
    worker = WorkerContext(0, 1, 0, 1, ctx.get_node_rank(), assignment.compute, assignment, replica_group=(rank, world))
    transport = ReplicaGroupTransport(cfg, rank, world, sink)
    result = rank_engine(cfg, plan, worker, transport).run(entered)
    transport.run_over()
    return result


def _worker_group_id() -> str:
    """Ray Train's worker group, named by its synchronization actor: a replacement joins the same one, a whole-group
    restart makes a new one (Ray Train's internal context: the Ray this package pins)."""
    return train_context.get_train_context().get_synchronization_actor()._actor_id.hex()[:12]
