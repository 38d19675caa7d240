"""A user dataset factory for the replica-group tests: ``bench-lost-worker``'s digits (a Ray Train worker of a planned
world rank kills its own process, SIGKILL: no goodbye to its peers, right after a planned optimizer step, once),
with a park.

``dataset="_replica_probe:killing_digits"`` with ``data_root=<probe dir>`` holding ``kill.json``:
``{"rank": 1, "step": 200}``, and optionally ``"park": {"rank": 0, "step": 400}``: that worker waits after that step
until a replacement of the killed rank has built its data (bounded: ``PARK_S``), so that a run cannot end before the
replacement joins on a slow machine (a test's, not a measurement's). Every worker process writes
``worker-<pid>.json`` (its world rank, pid and start time); the killed one writes ``killed-<rank>`` first, so its
replacement (which builds the data again) does not die too. On the driver, or without ``kill.json``, plain digits. ``fit`` ships this file to the
workers (a user module outside site-packages), so it imports no other test helper (the package it may).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from raytrain_mgpu.bench.lost_worker import killing_digits as _killing_digits
from raytrain_mgpu.data import Datasets


def killing_digits(cfg) -> Datasets:
    data = _killing_digits(cfg)  # the benchmark's: worker-<pid>.json, the kill
    park = (_plan(cfg) or {}).get("park")
    if park is None or _rank() != park["rank"]:
        return data
    probe = Path(cfg.data_root)
    from raytrain_mgpu.engine.step import STEP_EVENTS

    def wait(step: int) -> None:
        if step != park["step"]:
            return
        deadline = time.monotonic() + PARK_S
        while time.monotonic() < deadline and not _replaced(probe, _plan(cfg)["rank"]):
            time.sleep(0.1)

    STEP_EVENTS.append(wait)
    return data


def _plan(cfg):
    plan_file = Path(cfg.data_root) / "kill.json"
    return json.loads(plan_file.read_text()) if cfg.data_root and plan_file.is_file() else None


def _rank():
    try:
        import ray.train

        return ray.train.get_context().get_world_rank()
    except Exception:  # on the driver
        return None


PARK_S = 180


def _replaced(probe: Path, rank: int) -> bool:
    """Whether a second process of world rank ``rank`` has built its data (the killed one's replacement)."""
    records = [json.loads(p.read_text()) for p in probe.glob("worker-*.json")]
    return sum(1 for r in records if r["rank"] == rank) >= 2
