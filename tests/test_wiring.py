"""The fault hooks (``transports/ray_train/faults.py``, ``transports/collective_timeouts.py``, ``transports/retry.errors_whole``)
are applied by the product itself, not by a test.

``tests/_probe_data`` only observes and injects faults; these tests look at the Ray Train transport
(``transports/ray_train/worker.py``) directly, driven by the engine's own save (``engine_checkpoint.Saver``, one
rank's engine in this process: tests/_engine.py), so deleting the stuck-rank decorator or the wait after
each report fails here (and in the Ray runs of ``test_faults.py`` that rely on them).
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
import ray.train
from ray.train.v2._internal.execution import context as train_context

from _engine import make_engine
from raytrain_mgpu.checkpointing import contents as engine_checkpoint
from raytrain_mgpu.transports import collective_timeouts, retry
from raytrain_mgpu.transports.actor_group.stage import StageWorker
from raytrain_mgpu.engine.run_state import RunState
from raytrain_mgpu.transports.ray_train import worker as ray_train
from raytrain_mgpu.transports.ray_train import store as ray_store
from raytrain_mgpu.transports.ray_train import uploads as ray_uploads

COLLECT_AFTER_S = 0.3  # the stand-in controller takes each report this long after it was queued
SMALL = dict(model="mlp", model_kwargs={"widths": [4]}, dataset="digits", num_samples=64, batch_size=16)


@pytest.mark.parametrize("entry, module, name", [
    (ray_train.train_worker, "raytrain_mgpu.transports.ray_train.worker", "train_worker"),
    (StageWorker.run, "raytrain_mgpu.transports.actor_group.stage", "run"),
])
def test_every_rank_entry_is_wrapped_by_errors_whole_then_name_stuck_ranks(entry, module, name):
    # Each wrapper's code object, whatever function it wraps: only errors_whole and name_stuck_ranks make them.
    assert entry.__code__ is retry.errors_whole(lambda *args: None)(lambda: None).__code__
    inner = entry.__wrapped__
    assert inner.__code__ is collective_timeouts.name_stuck_ranks(lambda *args: 1.0)(lambda: None).__code__
    assert inner.__wrapped__.__module__ == module and inner.__wrapped__.__name__ == name


def ray_train_engine(fields: dict, rank: int, world: int, state: RunState, storage: str):
    """Rank ``rank`` of ``world``'s engine, set up in this process with the Ray Train transport (Ray Train's
    calls are the test's fakes; with ``world`` > 1 a one-rank gloo group stands in for the workers' group),
    at ``state`` (a save's point)."""
    engine = make_engine({**SMALL, **fields}, rank=rank, world=world, storage=storage, setup=False)
    engine.transport = ray_train.RayTrainTransport(engine.cfg, engine.ctx, None)
    engine.reporter = engine.transport.reporter if rank == 0 else None
    engine.setup()
    engine.state = engine.checkpoints.saver.state = state  # the run state the saver was handed
    return engine


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
def test_the_last_save_returns_only_after_the_controller_took_the_report(rank, monkeypatch, storage, gloo_group):
    events: list = []
    controller = _Controller(events)

    def report(metrics, checkpoint=None, **upload):  # what ray.train.report does in V2: queue the result
        if checkpoint is not None:
            assert upload["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.SYNC
            assert (Path(checkpoint.path) / "meta.json").is_file()
        events.append("report")
        controller.results.put((metrics, checkpoint))

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setattr(train_context, "get_train_context", lambda: controller)
    # The run's last save (epoch 1 of 1): rank 0's upload is synchronous; an asynchronous one returns at
    # once and is announced after the controller took it (tests/test_async_upload.py).
    engine = ray_train_engine(dict(epochs=1), rank, 2, RunState(epoch=1, step=2, history=[{"epoch": 1}]), storage)
    start = time.monotonic()
    engine.checkpoints.saver.save({"train_loss": 1.0})
    events.append("returned")
    controller.thread.join(timeout=30)
    assert events == ["report", "collected", "returned"]
    assert time.monotonic() - start >= COLLECT_AFTER_S


class _Reporter:
    """Rank 0's reporter: its flush (every event it sent is in the driver's mailbox) recorded."""

    def __init__(self, events: list):
        self.events, self.sink = events, "the driver's"

    def flush(self):
        self.events.append("flushed")

    def epoch(self, metrics):
        self.events.append("epoch row")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["step", "epoch"])
def test_a_checkpoint_uploaded_in_the_background_is_reported_before_its_write_and_uploaded_only_once_written(
        kind, rank, monkeypatch, tmp_path, storage, gloo_group):
    """A step or epoch checkpoint (background upload) is reported before its write (after the save's one gather,
    which checks that every rank's weights are finite), so the other ranks' wait for the controller overlaps
    rank 0's write; Ray Train's upload of rank 0's folder waits until it is complete and rank 0's events (the
    epoch's row) are in the driver's mailbox, so the controller's announcement comes after them; the other ranks
    still return only once the controller holds their report (rank 0's is queued after the upload, and waited
    for before its next save)."""
    events: list = []
    controller = _Controller(events)
    uploaded: list = []

    def report(metrics, checkpoint=None, checkpoint_upload_fn=None, **upload):
        events.append(("report", sorted(p.name for p in Path(checkpoint.path).iterdir()) if checkpoint else None))
        if checkpoint is None:
            controller.results.put((metrics, None))
            return
        assert upload["checkpoint_upload_mode"] == ray.train.CheckpointUploadMode.ASYNC

        def upload_then_queue():  # Ray Train's upload thread: the upload, then the report is queued
            uploaded.append(sorted(p.name for p in checkpoint_upload_fn(checkpoint, "ckpt").iterdir()))
            events.append("uploaded")
            controller.results.put((metrics, checkpoint))

        threading.Thread(target=upload_then_queue, daemon=True).start()

    def gather(own):
        events.append("gather")
        return [own, own]

    ray_storage = SimpleNamespace(persist_current_checkpoint=lambda checkpoint, name: Path(checkpoint.path))
    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: ray_storage))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setattr(train_context, "get_train_context", lambda: controller)
    monkeypatch.setattr(engine_checkpoint, "all_gather_objects", gather)
    monkeypatch.setattr(ray_store.tempfile, "tempdir", str(tmp_path))  # the folder outlives the upload here

    if kind == "step":  # 10 steps into epoch 2 of 2: a step checkpoint
        state, args = RunState(epoch=1, step=32, step_in_epoch=10, history=[{"epoch": 1}]), dict(partial={"samples": 320})
    else:  # the end of epoch 1 of 2
        state, args = RunState(epoch=1, step=22, history=[{"epoch": 1}]), dict(send_row=True)
    engine = ray_train_engine(dict(epochs=2, checkpoint_every_n_steps=10), rank, 2, state, storage)
    if rank == 0:
        engine.checkpoints.store.reporter = engine.checkpoints.saver.reporter = _Reporter(events)
    engine.checkpoints.saver.save({"epoch": 1, "step": state.step}, **args)
    events.append("returned")
    controller.thread.join(timeout=30)
    if rank == 0:
        assert events[:2] == ["gather", ("report", [])], events  # an empty folder: reported before the write
        assert uploaded == [["history.json", "meta.json", "model.pt", "train_state.pt"]]  # uploaded complete
        # The epoch's row, then every event in the mailbox, then the upload; its report reaches the controller
        # after the upload, and rank 0 waits for it before its next save.
        row = ["epoch row"] if kind == "epoch" else []
        assert [e for e in events[2:] if e != "returned"] == [*row, "flushed", "uploaded", "collected"], events
        assert events.index("flushed") < events.index("returned") < events.index("collected"), events
    else:
        assert events[:2] == ["gather", ("report", None)], events
        assert events[2:] == ["collected", "returned"], events


@pytest.mark.timeout(60)
def test_a_step_checkpoint_whose_write_fails_is_never_uploaded(monkeypatch, storage):
    """Reported before its write, a step checkpoint whose write fails fails its upload too (Ray Train then
    fails the run, as for any failed upload): nothing half-written is persisted or registered."""
    uploads: list = []

    def report(metrics, checkpoint=None, checkpoint_upload_fn=None, **upload):
        def upload_in_thread():
            try:
                checkpoint_upload_fn(checkpoint, "ckpt")
                uploads.append("persisted")
            except OSError as exc:
                uploads.append(str(exc))

        thread = threading.Thread(target=upload_in_thread, daemon=True)
        thread.start()
        uploads.append(thread)

    def failing_write(directory, **parts):
        raise OSError("disk full")

    ray_storage = SimpleNamespace(persist_current_checkpoint=lambda checkpoint, name: Path(checkpoint.path))
    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: ray_storage))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setattr(ray_store, "wait_until_report_collected", lambda: None)
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: None)
    engine = ray_train_engine(dict(epochs=2, checkpoint_every_n_steps=10), 0, 1,
                              RunState(epoch=1, step=10, step_in_epoch=10, history=[]), storage)
    monkeypatch.setattr(engine_checkpoint.ckpt_format, "write_checkpoint", failing_write)
    with pytest.raises(OSError, match="disk full"):
        engine.checkpoints.saver.save({"epoch": 1, "step": 10}, partial={"samples": 100})
    thread, *_ = uploads
    thread.join(timeout=30)
    (failed,) = uploads[1:]  # the upload waited for the write and failed with it (named, the cause in it)
    assert "disk full" in failed and "checkpoint_epoch000001_step000000010" in failed, failed
