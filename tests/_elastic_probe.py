"""User dataset factories for the two-node tests (elastic, spot, a pipeline that loses a node):
digits that record what each worker read and park at planned steps, so that a test acts on an
event instead of racing a clock.

``dataset="_elastic_probe:parked_digits"`` with ``data_root=<probe dir>``. Inside a Ray Train worker it
writes ``worker-<pid>.json`` (world rank and size, node IP, start time, the step it resumed after) and
appends one line per micro-batch it reads to ``batches-<pid>.txt``: with no loader workers a
micro-batch is read when the loop trains it, so the count tells how many micro-steps that process
started (a micro-batch it parked on and never returned is not counted).

``<probe dir>/parks.json`` (optional) lists parks, with the run's global batch size (the factory
gets the data section of the config only, and a step's count of micro-batches follows from it)::

    {"batch_size": 64, "parks": [{"name": "grow", "step": 28, "world_size": 1},
                                 {"name": "notice", "step": 30, "until": "preemption_notice"}]}

A worker process (of that ``world_size``, and of a group that resumed after that
``resumed_after_step``, 0 for a fresh start, where they are given) about to read the first
micro-batch of global optimizer step ``step`` writes ``parked-<name>-<world rank>`` and waits until
``release-<name>`` exists (``"until": "release"``, the default), or until Ray Train has handed this
worker a preemption notice (``"until": "preemption_notice"``); while parked it keeps the newest
notice's deadline in ``deadline-<world rank>``. Meanwhile the test acts (a node joins
or goes, a notice is sent) and Ray Train may stop the group. The wait is bounded: after ``PARK_S``
the process writes ``timeout-<name>-<world rank>`` and goes on, and the test fails on what follows
instead of hanging. A park whose release file exists already does not wait (a restarted group
passes it), nor does one at a step that this process does not read (it resumed after it).

``dataset="_elastic_probe:parked_stage_digits"``, for a pipeline's stage actors (not Ray Train workers:
no world rank, no step count of their own): each stage actor parks before its ``read``-th training
batch (1-based, counted per process) for every park of ``parks.json`` that names ``read``, e.g.
``{"parks": [{"name": "lost", "read": 23}]}``, writing ``parked-<name>-<pid>``; the same release
file and bound as above.

``fit`` ships this file to the workers (a user module outside site-packages), so it imports
no other test helper. It only observes and waits: nothing here changes what is trained.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, digits as _digits

PARK_S = 300.0  # the longest a park waits: far above what a node's start or a notice takes on a slow machine
POLL_S = 0.05


def parked_digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    info = _worker_info()
    if info is None or not cfg.data_root:  # on the driver (check_data), or not instrumented
        return data
    probe = Path(cfg.data_root)
    (probe / f"worker-{info['pid']}.json").write_text(json.dumps(info))
    parks_file = probe / "parks.json"
    plan = json.loads(parks_file.read_text()) if parks_file.is_file() else {"batch_size": None, "parks": []}
    parks = [p for p in plan["parks"] if all(p.get(key, info[key]) == info[key]
                                             for key in ("world_size", "resumed_after_step"))]
    return data._replace(train=_ParkingRecording(data.train, probe, info, parks, plan["batch_size"]))


def parked_stage_digits(cfg) -> Datasets:
    data = _digits.build(cfg)
    if not cfg.data_root or not _in_ray_actor():  # on the driver (check_data), or not instrumented
        return data
    probe = Path(cfg.data_root)
    plan = json.loads((probe / "parks.json").read_text())
    return data._replace(train=_ParkingByRead(data.train, probe, [p for p in plan["parks"] if "read" in p]))


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def _worker_info():
    try:
        import ray.train

        ctx = ray.train.get_context()
        info = {"world_rank": ctx.get_world_rank(), "world_size": ctx.get_world_size(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "started": time.time()}
    except Exception:  # on the driver (check_data): not a Ray Train worker
        return None
    checkpoint = ray.train.get_checkpoint()  # the one this group resumes from (the loop reads the same)
    info["resumed_after_step"] = 0 if checkpoint is None else json.loads(
        (Path(checkpoint.path) / "meta.json").read_text())["step"]
    return info


def _preemption_info():
    """The preemption notice Ray Train's watcher has handed this worker, or None (read without the
    barrier that ``ray.train.get_preemption_info`` is; None outside a Ray Train worker)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # a pipeline stage actor: no Ray Train context
        return None


def _has_preemption_notice() -> bool:
    return _preemption_info() is not None


def _record_deadline(probe: Path, who: int) -> None:
    """``deadline-<who>``: the deadline (epoch ms) of the newest notice this parked worker holds;
    a test that drains the node again with an earlier deadline waits until a worker has it, as
    Ray Train's controller reads it from the workers (it would otherwise wait out the first)."""
    info = _preemption_info()
    if info is not None and info.deadline_ms is not None:
        target = probe / f"deadline-{who}"
        text = str(int(info.deadline_ms))
        if not target.exists() or target.read_text() != text:
            target.write_text(text)


class _ParkingRecording(Dataset):
    def __init__(self, inner, probe: Path, info: dict, parks: list, batch_size: Optional[int]):
        self.inner, self.probe, self.parks, self.batch_size = inner, probe, parks, batch_size
        self.rank, self.world_size, self.start_step = info["world_rank"], info["world_size"], info["resumed_after_step"]
        self.log = probe / f"batches-{info['pid']}.txt"
        self.micro_batches = 0  # read by this process so far

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        # Micro-batches of one step: the batch is split over the workers, then into micro-batches.
        accum = max(1, (self.batch_size or 0) // (len(indices) * self.world_size))
        if self.parks and self.micro_batches % accum == 0:  # the first micro-batch of this step
            step = self.start_step + self.micro_batches // accum + 1
            for park in self.parks:
                if park["step"] == step:
                    self._park(park)
        self.micro_batches += 1
        with open(self.log, "a") as f:
            f.write(f"{len(indices)}\n")
        return self.inner.__getitems__(indices)

    def _park(self, park: dict) -> None:
        _park(self.probe, park, self.rank)


class _ParkingByRead(Dataset):
    def __init__(self, inner, probe: Path, parks: list):
        self.inner, self.probe, self.parks = inner, probe, parks
        self.reads = 0  # training batches this process has read

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices):
        self.reads += 1
        for park in self.parks:
            if park["read"] == self.reads:
                _park(self.probe, park, os.getpid())
        return self.inner.__getitems__(indices)


def _park(probe: Path, park: dict, who: int) -> None:
    """Write ``parked-<name>-<who>`` and wait for the park's release (at most PARK_S)."""
    name, until = park["name"], park.get("until", "release")
    release = probe / f"release-{name}"
    if release.exists():
        return
    (probe / f"parked-{name}-{who}").write_text(repr(time.time()))
    deadline = time.monotonic() + PARK_S
    while not (release.exists() or (until == "preemption_notice" and _has_preemption_notice())):
        _record_deadline(probe, who)
        if time.monotonic() > deadline:
            (probe / f"timeout-{name}-{who}").write_text(repr(time.time()))
            return
        time.sleep(POLL_S)
