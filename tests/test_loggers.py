"""The loggers of ``TrainConfig.loggers`` (TensorBoard, MLflow, CSV, W&B): files that their own readers
parse, a resume that continues them without duplicate steps, remote storage through pyarrow.

The events are driven by hand here, and a real fit and its resume run in this process (the in-process
runner: the engine's events, no Ray), checked with :func:`assert_logged`; tests/test_fit.py checks the
CSV logger's file after a fit and its resume through Ray Train's workers (:func:`assert_csv_logged`,
which needs no extra: that test runs whatever is installed).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import struct
import sys

import pytest
from _extras import require

import raytrain_mgpu as rtm
from raytrain_mgpu.driver.callbacks import RunEvents, RunInfo
from raytrain_mgpu.driver.loggers import (CSV_FILE, MLFLOW_EXPERIMENT, MLFLOW_RUN_FILE, TENSORBOARD_DIR,
                                           WANDB_PROJECT, WANDB_RUN_FILE, CsvLogger, MlflowLogger, TensorBoardLogger,
                                           WandbLogger)
from raytrain_mgpu.driver.progress import ProgressPrinter
from raytrain_mgpu.checkpointing.run_folder import RunFolder


@pytest.fixture
def extras():
    """The tests that read TensorBoard's or MLflow's files skip without those extras (on CI they fail:
    tests/_extras.py); the CSV logger's checks (importable from here) never do."""
    require("tensorboard", "mlflow")


needs_extras = pytest.mark.usefixtures("extras")


def tensorboard_scalars(run_path: str) -> dict:
    """{tag: [(step, value)]} as TensorBoard's own reader shows them (purged events hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.path.join(run_path, TENSORBOARD_DIR))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def csv_rows(run_path: str) -> list:
    with open(os.path.join(run_path, CSV_FILE), newline="") as f:
        return list(csv.DictReader(f))


def mlflow_runs(run_path: str):
    """The MLflow client of the run's default file store, and the runs of its experiment."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file:" + os.path.join(run_path, "mlruns"))
    experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    return client, client.search_runs([experiment.experiment_id])


def history(client, run_id: str, key: str) -> list:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def assert_csv_logged(run_path: str, rows: list, steps_per_log: int) -> None:
    """What a fit (and its resume) with the CSV logger leaves: every epoch row and the step scalars every
    ``steps_per_log`` steps, each step once."""
    logged_steps = list(range(steps_per_log, rows[-1]["step"] + 1, steps_per_log))
    table = csv_rows(run_path)
    assert [int(r["step"]) for r in table if r["name"] == "train/loss"] == logged_steps  # none twice after a resume
    assert [(int(r["epoch"]), float(r["value"])) for r in table if r["name"] == "epoch/train_loss"] == \
        [(row["epoch"], pytest.approx(row["train_loss"])) for row in rows]


def assert_logged(run_path: str, rows: list, steps_per_log: int, first_epochs: int) -> None:
    """What a fit (and its resume) with loggers=[tensorboard, mlflow, csv] leaves: every epoch row
    and the step scalars every ``steps_per_log`` steps, each step once, in one MLflow run whose
    ``epochs`` parameter is the first fit's (``first_epochs``)."""
    last = rows[-1]["step"]
    logged_steps = list(range(steps_per_log, last + 1, steps_per_log))
    tb = tensorboard_scalars(run_path)
    assert [step for step, _ in tb["train/loss"]] == logged_steps  # no duplicates after the resume
    assert [(step, value) for step, value in tb["epoch/train_loss"]] == \
        [(row["step"], pytest.approx(row["train_loss"])) for row in rows]
    assert_csv_logged(run_path, rows, steps_per_log)
    client, runs = mlflow_runs(run_path)
    assert len(runs) == 1  # the resume logged to the same MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["epochs"] == str(first_epochs)  # a param never changes
    assert [step for step, _ in history(client, run.info.run_id, "epoch/train_loss")] == [r["step"] for r in rows]
    assert [step for step, _ in history(client, run.info.run_id, "train/loss")] == logged_steps


def _events(folder: RunFolder, tracking_uri=None) -> RunEvents:
    loggers = [("tensorboard", TensorBoardLogger(folder)), ("csv", CsvLogger(folder))]
    if tracking_uri is not False:
        loggers.append(("mlflow", MlflowLogger(folder, tracking_uri)))
    return RunEvents(ProgressPrinter(3, io.StringIO(), live=False), loggers)


def _row(epoch: int, step: int) -> dict:
    return {"epoch": epoch, "step": step, "train_loss": 1.0 / epoch, "test_loss": None, "samples_per_s": 100.0,
            "peak_memory_bytes": [2**20], "devices": {"backend": "gloo"}}


def _train(folder, start_epoch, start_step, steps, config=None, tracking_uri=None, events=None):
    events = events or _events(folder, tracking_uri)
    events.train_start(RunInfo(config or {"name": "run", "epochs": 2}, folder.uri, start_step > 0, start_epoch,
                               start_step))
    for step in steps:
        if isinstance(step, dict):
            events.epoch(step)
        else:
            events.scalars(step, {"train/loss": 10.0 / step, "train/lr": 0.1})
    events.close()


@needs_extras
def test_a_resume_continues_every_logger_without_duplicate_steps(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    # Epoch 1 ends at step 4 (checkpointed); the run is killed after logging steps 6 and 8.
    _train(folder, 0, 0, [2, 4, _row(1, 4), 6, 8])
    # The resume starts after step 4: it logs 6 and 8 again, then 10, 12 and epoch 2 (and 3, with epochs raised).
    _train(folder, 1, 4, [6, 8, _row(2, 8), 10, 12, _row(3, 12)], config={"name": "run", "epochs": 3})
    tb = tensorboard_scalars(folder.uri)
    assert [step for step, _ in tb["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert tb["epoch/train_loss"] == [(4, 1.0), (8, 0.5), (12, pytest.approx(1 / 3))]
    assert "epoch/step" not in tb and "epoch/peak_memory_bytes" not in tb  # the x axis; lists are left out
    rows = csv_rows(folder.uri)
    assert [(r["step"], r["epoch"]) for r in rows if r["name"] == "train/loss"] == \
        [("2", "1"), ("4", "1"), ("6", "2"), ("8", "2"), ("10", "3"), ("12", "3")]
    assert [r["step"] for r in rows if r["name"] == "epoch/train_loss"] == ["4", "8", "12"]
    client, runs = mlflow_runs(folder.uri)
    assert len(runs) == 1 and runs[0].info.run_id == folder.read_json(folder.join(MLFLOW_RUN_FILE))["run_id"]
    assert runs[0].data.params == {"name": "run", "epochs": "2"}  # MLflow params never change
    # MLflow's metric history is append-only: the redone steps 6 and 8 are there twice (documented)
    assert [step for step, _ in history(client, runs[0].info.run_id, "train/loss")] == [2, 4, 6, 8, 6, 8, 10, 12]
    assert [step for step, _ in history(client, runs[0].info.run_id, "epoch/train_loss")] == [4, 8, 12]


@needs_extras
def test_a_restart_inside_one_fit_hides_the_redone_steps(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    # Ray Train restarts from the checkpoint at step 4: steps 6, 8 come again in the same fit (8 right
    # after 8: a redo, because the same scalar comes again). Another scalar at step 4 is no redo.
    events = _events(folder, tracking_uri=False)
    events.train_start(RunInfo({"name": "run"}, folder.uri, False, 0, 0))
    for step in (2, 4):
        events.scalars(step, {"train/loss": 10.0 / step})
    events.scalars(4, {"stage0/bubble": 0.25})  # the pipeline's stage figures share the epoch's last step
    events.epoch(_row(1, 4))
    for step in (6, 8, 8, 6, 8):
        events.scalars(step, {"train/loss": 10.0 / step})
    events.epoch(_row(2, 8))
    events.close()
    tb = tensorboard_scalars(folder.uri)
    assert [step for step, _ in tb["train/loss"]] == [2, 4, 6, 8] and tb["stage0/bubble"] == [(4, 0.25)]
    rows = csv_rows(folder.uri)
    assert [r["step"] for r in rows if r["name"] == "train/loss"] == ["2", "4", "6", "8"]
    assert [r["step"] for r in rows if r["name"] == "stage0/bubble"] == ["4"]


@needs_extras
def test_remote_storage_is_written_locally_and_uploaded(tmp_path):
    import pyarrow.fs as pafs

    # A filesystem that is not LocalFileSystem takes the upload path, as s3:// or gs:// would.
    remote = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())
    (tmp_path / "bucket").mkdir()
    folder = RunFolder("mock://bucket/run", filesystem=(remote, "run"))
    assert not folder.is_local
    _train(folder, 0, 0, [2, 4, _row(1, 4)], tracking_uri=False)
    _train(folder, 1, 4, [6, 8, _row(2, 8)], tracking_uri=False)  # the CSV is downloaded, appended
    local = str(tmp_path / "bucket" / "run")
    assert [step for step, _ in tensorboard_scalars(local)["train/loss"]] == [2, 4, 6, 8]
    assert [r["step"] for r in csv_rows(local) if r["name"] == "train/loss"] == ["2", "4", "6", "8"]
    with pytest.raises(ValueError, match=r"the default MLflow store \(file:<run>/mlruns\) needs local storage. "
                                         r"Set mlflow_tracking_uri"):
        MlflowLogger(folder, None)


@needs_extras
def test_a_fit_and_its_resume_leave_every_loggers_files_in_process(storage, monkeypatch):
    """A real run's events (the engine's rows and step scalars, in this process: one worker trains in the
    driver) reach every logger, and its resume continues them: no step twice, one MLflow run."""
    from raytrain_mgpu import api

    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("a one-worker run started Ray"))
    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", num_samples=256,
                          num_workers=1, batch_size=32, optimizer="sgd", lr=0.1, seed=1, log_every_n_steps=2, epochs=2,
                          name="logged", storage_path=storage, loggers=["tensorboard", "mlflow", "csv"], use_gpu=False)
    rtm.fit(cfg, stream=io.StringIO())
    resumed = rtm.fit(cfg.replace(epochs=3), stream=io.StringIO())
    assert [row["attempt"] for row in resumed.history] == [0, 0, 1]  # the third epoch by the second fit
    assert_logged(resumed.path, resumed.history, steps_per_log=2, first_epochs=2)


def wandb_runs(wandb_dir: str) -> dict:
    """{run id: [one dict per offline run file, oldest first]}: each file's ``project``, ``config``,
    ``history`` ([(step, {name: value})]) and ``summary`` (its updates in order), decoded with W&B's own
    record type (``wandb_internal_pb2.Record``) from the ``.wandb`` datastore file (a LevelDB log: a 7-byte
    file header, then chunks with a 7-byte header each, in 32 KiB blocks; wandb ships no reader of it)."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # W&B's service writes the files in the background: its teardown waits for it
    runs = {}
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "*.wandb")), key=os.path.getmtime):
        with open(path, "rb") as f:
            data = f.read()
        assert data[:4] == b":W&B", path
        pos, pending, found = 7, b"", {"config": {}, "history": [], "summary": {}}
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST; MIDDLE, LAST append
            if kind not in (1, 4):
                continue
            record = wandb_internal_pb2.Record.FromString(pending)
            which = record.WhichOneof("record_type")
            if which == "run":
                found["project"], found["id"] = record.run.project, record.run.run_id
                found["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif which == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                found["history"].append((record.history.step.num, items))
            elif which == "summary":
                found["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json)
                                         for u in record.summary.update})
        runs.setdefault(found["id"], []).append(found)
    return runs


def wandb_steps(files: list, name: str) -> list:
    """(step, value) of scalar ``name`` in every file of one run, in order."""
    return [(step, items[name]) for found in files for step, items in found["history"] if name in items]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, its files under tmp_path (the value), the default project. W&B reads its variables
    once a process (``wandb.setup``): its teardown before and after makes it read this test's."""
    require("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    wandb.teardown()
    yield str(tmp_path)
    wandb.teardown()


def test_wandb_continues_its_run_on_a_resume_and_sends_no_step_twice(tmp_path, wandb_offline, monkeypatch):
    folder = RunFolder(str(tmp_path / "run"))

    def events():
        return RunEvents(ProgressPrinter(3, io.StringIO(), live=False), [("wandb", WandbLogger(folder))])

    # Epoch 1 ends at step 4 (checkpointed); the run is killed after logging steps 6 and 8.
    _train(folder, 0, 0, [2, 4, _row(1, 4), 6, 8], events=events())
    # The resume redoes 6 and 8; a restart inside it redoes 10 (the same scalar at the same step again).
    monkeypatch.setenv("WANDB_PROJECT", "mine")  # W&B's own variable names the project
    _train(folder, 1, 4, [6, 8, _row(2, 8), 10, 10, 12, _row(3, 12)], config={"name": "run", "epochs": 3},
           events=events())
    runs = wandb_runs(wandb_offline)
    assert list(runs) == [folder.read_json(folder.join(WANDB_RUN_FILE))["run_id"]]  # one W&B run, resumed
    files = runs[folder.read_json(folder.join(WANDB_RUN_FILE))["run_id"]]
    assert [found["project"] for found in files] == [WANDB_PROJECT, "mine"]
    assert [found["config"]["epochs"] for found in files] == [2, 3]
    assert [step for step, _ in wandb_steps(files, "train/loss")] == [2, 4, 6, 8, 10, 12]
    assert wandb_steps(files, "epoch/train_loss") == [(4, 1.0), (8, 0.5), (12, pytest.approx(1 / 3))]


def test_wandb_offline_holds_a_fits_config_scalars_and_final_metrics_in_process(storage, wandb_offline,
                                                                                 monkeypatch):
    """A real run's events (in this process: one worker trains in the driver) and its resume, in one
    offline W&B run: the config, every logged step once, every epoch row, the final metrics as the summary."""
    from raytrain_mgpu import api

    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("a one-worker run started Ray"))
    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", num_samples=256,
                          num_workers=1, batch_size=32, optimizer="sgd", lr=0.1, seed=1, log_every_n_steps=2, epochs=2,
                          name="logged", storage_path=storage, loggers=["wandb"], use_gpu=False)
    rtm.fit(cfg, stream=io.StringIO())
    resumed = rtm.fit(cfg.replace(epochs=3), stream=io.StringIO())
    runs = wandb_runs(wandb_offline)
    assert len(runs) == 1  # the resume continued the same W&B run
    (files,) = runs.values()
    assert len(files) == 2 and [found["project"] for found in files] == [WANDB_PROJECT] * 2
    config = files[0]["config"]
    assert (config["name"], config["epochs"], config["model"], config["storage_path"]) == ("logged", 2, "mlp", storage)
    rows = resumed.history
    assert [step for step, _ in wandb_steps(files, "train/loss")] == list(range(2, rows[-1]["step"] + 1, 2))
    assert wandb_steps(files, "epoch/train_loss") == [(row["step"], pytest.approx(row["train_loss"])) for row in rows]
    summary = files[-1]["summary"]
    assert (summary["train_loss"], summary["test_accuracy"], summary["epoch"]) == \
        (pytest.approx(resumed.metrics["train_loss"]), pytest.approx(resumed.metrics["test_accuracy"]), 3)


def test_wandb_not_installed_names_the_extra_before_ray(monkeypatch, storage):
    from raytrain_mgpu import api

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("Ray started before the check"))
    with pytest.raises(ValueError, match=r"TrainConfig.loggers='wandb' needs the wandb package, which is not "
                                         r"installed. Install it with: pip install 'raytrain-mgpu\[wandb\]'"):
        rtm.fit(rtm.TrainConfig(model="mlp", dataset="digits", loggers=["wandb"], use_gpu=False, storage_path=storage))


def test_a_missing_extra_skips_its_tests_here_and_fails_them_on_ci(monkeypatch):
    """The rule of tests/_extras.py, which the extras' tests here follow: CI installs every extra."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.delenv("CI", raising=False)
    require("os", "csv")  # installed: nothing happens
    outcomes = []
    for ci in ("", "true"):
        monkeypatch.setenv("CI", ci)
        with pytest.raises(BaseException) as raised:  # a skip or a failure: either would end this test
            require("os", "wandb")
        outcomes.append((raised.type, str(raised.value)))
    assert outcomes[0] == (pytest.skip.Exception, "not installed: wandb")
    assert outcomes[1][0] is pytest.fail.Exception
    assert outcomes[1][1].startswith("not installed: wandb, on CI, ") and "the install is broken" in outcomes[1][1]


def test_a_missing_package_names_the_extra(monkeypatch, storage):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"TrainConfig.loggers='mlflow' needs the mlflow package, which is not "
                                         r"installed. Install it with: pip install 'raytrain-mgpu\[mlflow\]'"):
        rtm.fit(rtm.TrainConfig(model="mlp", dataset="digits", loggers=["mlflow"], use_gpu=False, storage_path=storage))
