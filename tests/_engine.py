"""One rank's engine (``engine/loop.py``) in the test's own process, without Ray: the data-parallel step
runner every Ray Train worker (and the in-process runner) uses, with a transport that publishes checkpoints in a
local run folder (``transports/base.FolderTransport``). For tests that drive the loop's parts directly: set
up, then ``engine.train_epoch(e)``, ``engine.checkpoints.saver.save(...)``, ``engine.evaluate(split)``.

With ``world`` > 1 the caller has made a process group (one process per rank, tests/_forkserver.py).
"""

from __future__ import annotations

import tempfile
from typing import Optional

import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.engine.devices import resolve_devices
from raytrain_mgpu.engine.loop import Engine
from raytrain_mgpu.driver.progress import WorkerReporter
from raytrain_mgpu.transports.base import FolderTransport
from raytrain_mgpu.strategies import WorkerContext, get_strategy
from raytrain_mgpu.strategies.plan import build_plan
from raytrain_mgpu.transports.base import data_parallel_steps

__all__ = ["make_engine", "TestTransport", "RecordingSink"]


class RecordingSink:
    """Stands in for the progress channel: ``put.remote(kind, payload)`` is recorded."""

    def __init__(self):
        self.events: list = []
        self.put = self  # sink.put.remote(...)

    def remote(self, kind, payload):
        self.events.append((kind, payload))

    def of(self, kind: str) -> list:
        return [payload for k, payload in self.events if k == kind]


class TestTransport(FolderTransport):
    """A rank's checkpoints in the run folder; rank 0's events to ``sink`` (a :class:`RecordingSink`), if any."""

    __test__ = False  # not a pytest class

    def __init__(self, cfg, rank: int, sink=None, barrier=None):
        import torch.distributed as dist

        def default_barrier():
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

        super().__init__(cfg, rank, "test", WorkerReporter(sink if rank == 0 else None),
                         barrier=barrier or default_barrier)

    def reports_scalars(self, rank: int, steps) -> bool:
        return self.reporter.sink is not None


def make_engine(fields: dict, rank: int = 0, world: int = 1, sink=None, storage: Optional[str] = None,
                transport=None, setup: bool = True) -> Engine:
    """The engine of rank ``rank`` of ``world`` for ``fields`` (``num_workers`` is ``world``), set up unless ``setup``
    is False; its run folder under ``storage`` (a temporary folder by default)."""
    cfg = rtm.TrainConfig(**{"storage_path": storage or tempfile.mkdtemp(prefix="engine-"), "use_gpu": False, **fields,
                             "num_workers": world})
    data = build_datasets(cfg.data)
    plan = build_plan(cfg, len(data.train))
    assignment = resolve_devices(cfg.use_gpu, get_strategy(cfg.strategy).devices_per_worker(cfg))
    ctx = WorkerContext(rank, world, rank, world, 0, assignment.compute, assignment)
    torch.set_num_threads(cfg.cpus_per_worker)
    engine = Engine(cfg, plan, data_parallel_steps(cfg, ctx, data), transport or TestTransport(cfg, rank, sink), data)
    if setup:
        engine.setup()
    return engine
