"""A transport: how one rank's run reaches the outside (the engine's other side, ``engine/loop.py``).

Three carry a run: Ray Train's workers (``transports/ray_train/worker.py``), the pipeline's actor group
(``transports/actor_group/group.py``) and the driver's own process for a run of one worker (``transports/local.py``).
On each rank a transport answers the engine:

- ``reporter``: where rank 0's events go (a progress channel to the driver, or the driver's own
  ``RunEvents``); ``reports_scalars``: which ranks send per-step scalars;
- ``checkpoint_store()``: the rank's checkpoint store, handed what only the transport knows
  (``checkpointing/store.py``: the run folder's, ``FolderStore``; Ray Train's, ``ray_train/store.py``);
- ``where()``: this rank's node and GPU ids for the history; ``data_shard()``: its Ray Data stream;
  ``preemption()``: how it hears of a node's preemption (nothing, where no notice can come).

:class:`FolderTransport` is what the pipeline's actors and the in-process runner share: their checkpoints
published in the run folder (``FolderStore``), every rank of an attempt writing into one temporary folder.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Callable, NamedTuple, Optional

import torch

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.checkpointing.store import CheckpointStore, FolderStore
from raytrain_mgpu.config.factories import load_factory
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.engine.devices import resolve_devices
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.strategies import get_strategy
from raytrain_mgpu.strategies.elastic import is_elastic
from raytrain_mgpu.transports.placement import node_ip

__all__ = ["Transport", "FolderTransport", "check_writable",
           "RunResult", "rank_devices", "rank_engine", "data_parallel_steps", "runner_for", "local_refusal"]


class Transport:
    """The defaults: no events, no notices; each transport hands its own checkpoint store (see the module
    docstring)."""

    reporter = None

    def reports_scalars(self, rank: int, steps) -> bool:
        return rank == 0 and self.reporter is not None

    def checkpoint_store(self) -> CheckpointStore:
        """This rank's checkpoint store (``checkpointing/store.py``), handed what only this transport knows."""
        raise NotImplementedError

    def where(self) -> dict:
        return {}

    def data_shard(self):
        raise ValueError("ingest='ray_data' needs Ray: run it with runner='ray'.")

    def preemption(self) -> dict:
        """``PreemptionCheck``'s keyword arguments; ``enabled=False`` where no notice can come."""
        return {"enabled": False}

    def replica_groups(self, device):
        """This worker's ``engine/replica_groups.ReplicaGroups`` (``fault_tolerance="replica_groups"``), or None."""
        return None

    def start_heartbeat(self, rank: int, world_size: int) -> None:
        """Start this rank's heartbeats to the driver, which names a rank that stops making progress
        (``engine/liveness.py``; a Ray run's transports); none by default."""

    def check_storage(self) -> None:
        """Before the first step: this rank's node writes, reads and deletes a small file in the run folder
        (``RunFolder.check_writable``), so that a node without the storage (a mount missing on a node that joined
        later, no credentials) fails now, named, not at its first checkpoint. Where the transport has no config
        (tests' stand-ins), nothing is checked."""
        cfg = getattr(self, "cfg", None)
        if cfg is not None:
            check_writable(RunFolder.of(cfg), node_ip())

    def finish(self) -> None:
        """The run is over (its last epoch checkpointed, or failed): what the transport started for it stops,
        and the events it sent the driver are delivered before the run returns."""
        heartbeat = getattr(self, "heartbeat", None)
        if heartbeat is not None:
            heartbeat.stop()
        if self.reporter is not None:
            self.reporter.ended()  # its last step, for the goodput ledger (driver/goodput.py)
            self.reporter.flush()


class FolderTransport(Transport):
    """Checkpoints published in the run folder by its ranks (``FolderStore``). ``attempt``: a token of this attempt,
    so that every rank names the same temporary folder; ``barrier``: waits for every rank (a no-op with one); ``rank``
    0 publishes."""

    def __init__(self, cfg, rank: int, attempt: str, reporter=None, barrier: Callable[[], object] = lambda: None):
        self.cfg, self.rank, self.attempt, self.reporter, self.barrier = cfg, rank, attempt, reporter, barrier

    def checkpoint_store(self) -> FolderStore:
        return FolderStore(self.cfg, self.rank, self.attempt, self.reporter, self.barrier)


def check_writable(folder: RunFolder, node: str) -> None:
    """Write, read back and delete a small file in ``folder`` from ``node`` (a rank before its first step), or raise
    the ``OSError`` that stopped it (of the same type: the retry policy tells a refused mount from a hiccup), naming
    the node, the path and the cause."""
    try:
        probe = folder.join(f".reach-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        folder.fs.create_dir(folder.path, recursive=True)
        with folder.fs.open_output_stream(probe) as f:
            f.write(b"ok")
        with folder.fs.open_input_stream(probe) as f:
            if f.read() != b"ok":
                raise OSError("the file read back differs from the one written")
        folder.fs.delete_file(probe)
    except Exception as exc:
        message = (f"node {node} cannot write and read TrainConfig.storage_path: {folder.display} "
                   f"({type(exc).__name__}: {exc}). Checkpoints would fail there. Mount the storage on every node at "
                   f"the same path (NFS, EFS, a shared disk), or use a bucket URI such as s3://bucket/runs that every "
                   f"node has credentials for.")
        try:
            # its errno kept: the retry policy tells a read-only mount (not retried) from a hiccup
            error = (type(exc)(exc.errno, message) if isinstance(exc, OSError) and exc.errno is not None
                     else type(exc)(message) if isinstance(exc, OSError) else OSError(message))
        except Exception:  # an OSError type that takes other arguments
            error = OSError(message)
        raise error from exc


# ----------------------------------------------------------------------------- what every transport shares


class RunResult(NamedTuple):
    """What a transport's run gives back to ``fit``, whichever carried it."""

    history: list
    """One row per epoch trained, resumed attempts included."""
    checkpoint_path: Optional[str]
    """The last checkpoint (the whole model loads from it), or None."""
    startup: Optional[dict] = None
    """Rank 0's start-up times of the first attempt (``WorkerReporter.startup``), or None."""


def rank_devices(cfg, num_devices: int, gpu_ids=None):
    """The first thing every rank does, in the process that computes: its torch threads (``cpus_per_worker``), its
    devices (``gpu_ids``: the ones Ray gave it; ``engine/devices.resolve_devices``) and CUDA's current device."""
    torch.set_num_threads(cfg.cpus_per_worker)
    assignment = resolve_devices(cfg.use_gpu, num_devices, gpu_ids)
    if assignment.compute[0].type == "cuda":
        torch.cuda.set_device(assignment.compute[0])
    return assignment


def rank_engine(cfg, plan, ctx, transport, data=None, steps=None):
    """One rank's engine, whichever transport carries it (``.run(entered)`` trains): its datasets (unless given),
    its step runner (the data-parallel one unless given: a pipeline stage brings its own)."""
    # late: the engine (0.3 s of import over what the api loads) runs on a rank; the driver imports this module for
    # runner_for and the result; and tests replace engine.loop.Engine
    from raytrain_mgpu.engine.loop import Engine

    data = data if data is not None else build_datasets(cfg.data)
    steps = steps if steps is not None else data_parallel_steps(cfg, ctx, data)
    return Engine(cfg, plan, steps, transport, data)


def data_parallel_steps(cfg, ctx, data):
    """The data-parallel step runner of ``cfg``'s strategy on the rank ``ctx`` describes."""
    # late: parallel/ (1.0 s of import: FSDP, tensor parallel, DCP) is the worker side; a Ray run's driver, which
    # imports this module, never builds a step runner
    from raytrain_mgpu.parallel import build_worker

    step = None
    if cfg.train_step is not None:
        step = load_factory(cfg.train_step, "train_step")
    return build_worker(get_strategy(cfg.strategy), cfg.parallel, ctx, Objective.of(cfg, data.num_classes),
                        user_step=step, save_trainable=cfg.save == "trainable")


def local_refusal(cfg, plan) -> Optional[str]:
    """Why ``cfg`` cannot train in the driver's process (None: it can)."""
    if plan.runner != "train_workers":
        return f"strategy={cfg.strategy!r} runs its stages in an actor group of their own"
    if is_elastic(cfg) or plan.num_processes != 1:
        return f"num_workers={cfg.num_workers!r} asks for more than one worker process"
    if cfg.runner == "auto" and (cfg.address is not None or os.environ.get("RAY_ADDRESS")):
        return "a cluster address is set (address or RAY_ADDRESS): the run belongs on that cluster"
    if cfg.ingest == "ray_data" or isinstance(cfg.dataset, dict):
        return "Ray Data streams the training split (ingest='ray_data' or Ray Datasets)"
    if get_strategy(cfg.strategy).replication == "fully_shard":
        return f"strategy={cfg.strategy!r} shards over a process group, which one process without Ray does not have"
    if cfg.sync_batchnorm:
        return "sync_batchnorm=True needs a process group"
    return None


def runner_for(cfg, plan) -> str:
    """``"local"`` or ``"ray"`` for ``cfg`` (``TrainConfig.runner``); ValueError where ``local`` cannot be."""
    why = local_refusal(cfg, plan)
    if cfg.runner == "local" and why is not None:
        raise ValueError(f"TrainConfig.runner='local' cannot train this run in the driver's process: {why}. "
                         f"Set runner='auto' (or 'ray') to train it with Ray.")
    if cfg.runner == "ray" or why is not None:
        return "ray"
    return "local"
