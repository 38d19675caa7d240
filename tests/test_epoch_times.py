"""Where an epoch's time goes (issue 24): ``samples_per_s`` is training throughput, the samples over
``training_s`` (the time in steps); ``checkpoint_s`` and ``eval_s`` are the epoch's time in checkpoints
and in evaluation, apart from it, so that the three add up to the epoch's wall time. Without Ray:
the engine's ``train_epoch`` (one rank's, in this process: tests/_engine.py) with a slow stand-in for the
step checkpoints' save, and the engine's save through the Ray Train transport with Ray Train's report
stood in for (tests/test_wiring.py). Through Ray: tests/test_fit.py's 2-worker run (every row's
parts, within the run's wall time); the pipeline runner's rows in
tests/test_pipeline_step_checkpoints.py (its checkpoint_s is the stages' logged pauses).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train

from _engine import make_engine
from raytrain_mgpu.engine import loop as engine_module
from raytrain_mgpu.checkpointing import manager as checkpoint_manager
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.driver.progress import ProgressPrinter
from raytrain_mgpu.engine.run_state import RunState
from raytrain_mgpu.transports.ray_train import store as ray_store
from raytrain_mgpu.transports.ray_train import uploads as ray_uploads

MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd", lr=0.1,
           seed=3, num_workers=1, epochs=1, checkpoint_every_n_steps=5)
SAVE_S = 0.1


def test_step_checkpoints_and_the_wait_for_the_last_reports_are_checkpoint_time_not_training_time(monkeypatch):
    """On 2+ workers every rank but 0 holds its epoch's report until the controller takes it; rank 0
    would wait for it in its next epoch's first all-reduce. The engine waits for them in a barrier
    before the steps (``barrier_s``, stood in for here): checkpoint time, not training."""
    saves, walls = [], []

    def slow_save(metrics, partial=None, send_row=False):  # a step checkpoint that holds training up for SAVE_S
        assert partial is not None  # a step checkpoint's, with the epoch's sums so far
        saves.append(metrics["step"])
        time.sleep(SAVE_S)

    def elapsed(meter):  # the epoch's wall time, as the engine reads it
        walls.append(time.perf_counter() - meter.start)
        return walls[-1]

    def barrier_s():  # the other ranks still holding their last report for Ray Train's controller
        time.sleep(SAVE_S)
        return SAVE_S

    monkeypatch.setattr(EpochMeter, "elapsed", elapsed)
    monkeypatch.setattr(engine_module, "barrier_s", barrier_s)  # the epoch's wait for the last reports
    monkeypatch.setattr(checkpoint_manager, "barrier_s", barrier_s)  # the wait after each step checkpoint
    engine = make_engine(MLP)
    monkeypatch.setattr(engine.checkpoints.saver, "save", slow_save)
    row = engine.train_epoch(0)
    steps = 1438 // 64
    assert saves == [5, 10, 15, 20]  # (the epoch's end is the epoch's checkpoint)
    # each save and the wait after it for the other ranks' reports, and the epoch's wait for the last ones
    assert row["checkpoint_s"] >= (2 * len(saves) + 1) * SAVE_S
    # The epoch's wall time is the time in steps plus the time in step checkpoints, each once; training
    # throughput is the epoch's samples over the time in steps alone.
    wall = walls[-1]  # the epoch row's read (each step checkpoint's partial sums read it too, before)
    assert len(walls) == len(saves) + 1
    assert 0 < row["training_s"] and row["training_s"] + row["checkpoint_s"] == pytest.approx(wall)
    assert row["samples_per_s"] * row["training_s"] == pytest.approx(steps * 64)
    assert row["step_time_s"] == pytest.approx(row["training_s"] / steps)
    assert row["eval_s"] == 0.0  # train_epoch's row; run_epochs times the evaluation


def test_an_epochs_checkpoint_time_is_in_its_row_its_history_and_reaches_the_driver_before_the_upload(
        monkeypatch, storage):
    """The save's own time is added to the epoch's row, written into the checkpoint's history and sent to the
    driver, all before Ray Train's upload may read the folder (the checkpoint is reported before its write: the
    metrics Ray Train gets are the row without this save's time)."""
    from test_wiring import ray_train_engine

    order, reported = [], []

    def report(metrics, checkpoint=None, checkpoint_upload_fn=None, **upload):  # Ray Train's upload deferred
        order.append("report")
        reported.append((dict(metrics), checkpoint, checkpoint_upload_fn))

    def upload(checkpoint, name):  # Ray Train's upload thread, once the write lets it
        order.append("upload")
        return json.loads((Path(checkpoint.path) / "history.json").read_text())

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setattr(ray.train, "get_context",
                        lambda: SimpleNamespace(get_storage=lambda: SimpleNamespace(persist_current_checkpoint=upload)))
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: None)
    monkeypatch.setattr(ray_store, "wait_until_report_collected", lambda: None)
    row = {"epoch": 1, "checkpoint_s": 0.25, "eval_s": 0.0}  # 0.25 s of the epoch's step checkpoints
    engine = ray_train_engine(dict(epochs=3), 0, 1, RunState(epoch=1, step=10, history=[row]), storage)
    engine.checkpoints.saver.reporter = SimpleNamespace(epoch=lambda row: order.append(("row", row["checkpoint_s"])))
    engine.checkpoints.store.reporter = SimpleNamespace(flush=lambda: order.append("flushed"))
    replication = engine.steps.replication
    state_dict = replication.state_dict

    def slow_state_dict(model):  # the model's serialisation, slow: training stands still for it
        time.sleep(SAVE_S)
        return state_dict(model)

    monkeypatch.setattr(replication, "state_dict", slow_state_dict)
    started = time.perf_counter()
    engine.checkpoints.saver.save(row, send_row=True)
    stall = time.perf_counter() - started
    (metrics, checkpoint, upload_when_written), = reported
    assert metrics["checkpoint_s"] == 0.25  # reported before the write
    history = upload_when_written(checkpoint, "checkpoint_epoch000001")
    assert 0.25 + SAVE_S <= history[-1]["checkpoint_s"] <= 0.25 + stall  # the checkpoint's history holds it
    assert engine.state.history[-1]["checkpoint_s"] == history[-1]["checkpoint_s"]  # and the run's row
    # the progress line, with it, and every event in the driver's mailbox before the upload (and the announcement)
    assert order == ["report", ("row", history[-1]["checkpoint_s"]), "flushed", "upload"], order


def test_the_progress_line_says_where_the_epochs_time_went():
    out = io.StringIO()
    row = {"epoch": 2, "step": 44, "train_loss": 0.5, "test_loss": 0.4, "test_accuracy": 0.9, "train_accuracy": 0.8,
           "samples_per_s": 1408 / 1.25, "training_s": 1.25, "checkpoint_s": 0.31, "eval_s": 0.12,
           "peak_memory_bytes": [2**20]}
    ProgressPrinter(3, out).epoch(row)
    # the whole line: the times are no metric of their own (no "train_"/"test_" key names one)
    assert out.getvalue().startswith("epoch   2/3  step     44  loss 0.5000  test_loss 0.4000  test_acc 0.9000  "
                                     "1,126 samples/s  train 1.25 s  ckpt 0.31 s  eval 0.12 s  mem/device"), out.getvalue()
    out = io.StringIO()  # a row without the parts (a run's history from before they were kept): as before
    ProgressPrinter(3, out).epoch({k: v for k, v in row.items() if k not in ("checkpoint_s", "eval_s")})
    assert "1,126 samples/s  mem/device" in out.getvalue()
