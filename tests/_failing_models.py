"""User models that fail on purpose, for tests/test_cluster_failures.py: what a user's own code does to a run.

``model="_failing_models:failing"`` with ``model_kwargs={"probe": dir, "faults": [...]}``: an MLP over the input
whose process records its first training forward in ``probe/forward-<rank>-<pid>.json`` (with the Ray resources
assigned to it), and carries out each fault ``{"what": ..., "rank": r, "at": n}`` at its ``n``-th training forward
on rank ``r`` (counted per process; every rank if ``rank`` is left out), once per probe dir (``done-<i>`` records it
with the time), armed in a process only if the fault before it had happened when the process began training (a
restart's processes carry out the next one):

- ``raise``: a :class:`CodedError`, whose class does not unpickle (required arguments ``args`` does not hold);
- ``nan``: the outputs are NaN from then on (the loss too);
- ``hang``: sleep for ever (a rank stuck in its forward);
- ``exit``: the process ends (a lost process);
- ``oserror``: a ``ConnectionResetError`` (a storage or network hiccup).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

from torch import nn


class CodedError(Exception):
    def __init__(self, code: int, detail: str):
        super().__init__(f"code {code}: {detail}")
        self.code, self.detail = code, detail


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _assigned() -> dict:
    try:
        import ray

        return dict(ray.get_runtime_context().get_assigned_resources()) if ray.is_initialized() else {}
    except Exception:
        return {}


class Failing(nn.Module):
    def __init__(self, input_shape, num_classes, probe: str, faults: list):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                                 nn.Linear(32, num_classes))
        self.probe, self.faults, self.calls = Path(probe), faults, 0

    def forward(self, x):
        out = self.net(x)
        if not self.training:
            return out
        self.calls += 1
        rank = _rank()
        if self.calls == 1:
            (self.probe / f"forward-{rank}-{os.getpid()}.json").write_text(json.dumps({"resources": _assigned()}))
            self.armed = {i for i in range(len(self.faults)) if i == 0 or (self.probe / f"done-{i - 1}").exists()}
        for i, fault in enumerate(self.faults):
            done = self.probe / f"done-{i}"
            if fault.get("rank", rank) != rank or i not in self.armed:
                continue
            if fault["what"] == "nan" and self.calls >= fault["at"]:
                done.write_text(str(time.time()))
                return out * float("nan")
            if self.calls != fault["at"] or done.exists():
                continue
            done.write_text(str(time.time()))
            if fault["what"] == "raise":
                raise CodedError(42, "the widget is bent")
            if fault["what"] == "hang":
                while True:
                    time.sleep(60)
            if fault["what"] == "exit":
                os._exit(1)
            if fault["what"] == "oserror":
                raise ConnectionResetError(104, "the object store reset the connection")
        return out


def failing(input_shape, num_classes, probe: str, faults: list) -> nn.Module:
    return Failing(input_shape, num_classes, probe, faults)


@contextlib.contextmanager
def fault_once_after_step(step: int):
    """The in-process engine (``engine.loop.STEP_EVENTS``) raises once, right after optimizer step ``step``, as a
    crash would; yields the steps trained, in order, across the attempts (a resume trains some again)."""
    from raytrain_mgpu.engine import loop as engine

    steps, failed = [], []

    def fail_once(trained: int) -> None:
        steps.append(trained)
        if trained == step and not failed:
            failed.append(trained)
            raise RuntimeError(f"a fault after step {step}")

    engine.STEP_EVENTS.append(fail_once)
    try:
        yield steps
    finally:
        engine.STEP_EVENTS.remove(fail_once)
    assert failed == [step], f"the run never reached step {step}"
