"""The fault hooks of ``raytrain_mgpu.runtime.faults`` are applied by the product itself, not by a test.

``tests/_probe_data`` only observes and injects faults; these tests look at ``loop.py``
directly, so deleting the stuck-rank decorator or the wait after each report fails here
(and in the Ray runs of ``test_faults.py`` that rely on them).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import ray.train
import torch
from ray.train.v2._internal.execution import context as train_context

import raytrain_mgpu as rtm
from raytrain_mgpu.runtime import faults
from raytrain_mgpu.runtime import loop, worker_checkpoint
from raytrain_mgpu.strategies import WorkerContext

COLLECT_AFTER_S = 0.3  # the stand-in controller takes each report this long after it was queued


def test_train_worker_is_wrapped_by_name_stuck_ranks():
    # The wrapper's code object, whatever function it wraps: only name_stuck_ranks makes one.
    wrapper_code = faults.name_stuck_ranks(lambda payload: None).__code__
    assert loop.train_worker.__code__ is wrapper_code
    assert loop.train_worker.__wrapped__.__module__ == "raytrain_mgpu.runtime.loop"
    assert loop.train_worker.__wrapped__.__name__ == "train_worker"


class _Strategy:
    """What save_and_report asks of a strategy: the plain (unsharded) states."""

    sharded_checkpoint = False

    def state_dict(self, model):
        return model.state_dict()

    def optimizer_state_dict(self, model, optimizer):
        return optimizer.state_dict()


class _Controller:
    """Ray Train V2's side of a worker's result queue: takes each report ``COLLECT_AFTER_S``
    after it was queued and calls ``task_done`` (what ``wait_until_report_collected`` watches)."""

    def __init__(self, events: list):
        self.results: queue.Queue = queue.Queue()
        self.events = events
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def get_result_queue(self):
        return self.results

    def _collect(self):
        self.results.get(timeout=30)
        time.sleep(COLLECT_AFTER_S)
        self.events.append("collected")
        self.results.task_done()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])  # rank 0 carries the checkpoint, rank 1 reports metrics only
def test_save_and_report_returns_only_after_the_controller_took_the_report(rank, monkeypatch):
    events: list = []
    controller = _Controller(events)

    def report(metrics, checkpoint=None, **upload):  # what ray.train.report does in V2: queue the result
        if checkpoint is not None:
            assert upload["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.SYNC
            assert (Path(checkpoint.path) / "meta.json").is_file()
        events.append("report")
        controller.results.put((metrics, checkpoint))

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(train_context, "get_train_context", lambda: controller)

    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [4]}, dataset="digits", num_workers=2)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = loop._State(epoch=1, step=22, history=[{"epoch": 1}])
    ctx = WorkerContext(rank, 2, rank, 2, 0, (torch.device("cpu"),))
    shape_info = {"input_shape": [1, 8, 8], "num_classes": 10}
    start = time.monotonic()
    # Rank 0's synchronous upload (the run's last save, or upload=SYNC); its asynchronous one returns
    # at once and is announced after the controller took it (tests/test_async_upload.py).
    worker_checkpoint.save_and_report(cfg, _Strategy(), model, optimizer, scheduler, scaler, state, {"train_loss": 1.0},
                          ctx, shape_info, upload=ray.train.CheckpointUploadMode.SYNC)
    events.append("returned")
    controller.thread.join(timeout=30)
    assert events == ["report", "collected", "returned"]
    assert time.monotonic() - start >= COLLECT_AFTER_S
