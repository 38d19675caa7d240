"""Hardening (issue 11): no code runs from checkpoints, data or config files; bad values
stop before Ray; runs in one folder never mix."""

from __future__ import annotations

import json
import os
import re
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.config.factories import TRUSTED_MODULES_ENV, load_factory
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.cli import main
from raytrain_mgpu.data import check_data, cifar10
from raytrain_mgpu.driver.preflight import check_data_fits, check_run_folder
from raytrain_mgpu.driver.runlock import LOCK_FILE, RunLock, remove_stale_temporaries


class _Payload:
    """Unpickling this creates ``marker``: the proof that a file ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


# ----------------------------------------------------------------------------- code from files


def _legit_train_state() -> dict:
    model = torch.nn.Linear(4, 3)
    states = {}
    for optimizer in (torch.optim.AdamW(model.parameters(), lr=0.1),
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        states[type(optimizer).__name__] = optimizer.state_dict()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch)
    scaler = torch.amp.GradScaler("cpu")
    return {"optimizer": states, "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "torch_rng": torch.get_rng_state(), "rng_per_rank": [torch.get_rng_state(), torch.get_rng_state()]}


def test_a_legitimate_train_state_loads_with_weights_only(tmp_path):
    state = _legit_train_state()
    ckpt_format.write_checkpoint(str(tmp_path), meta={}, history=[], train_state=state, part="-stage1")
    loaded = ckpt_format.load_train_state(str(tmp_path), "-stage1")
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])
    assert loaded["optimizer"]["AdamW"]["state"][0]["step"] == state["optimizer"]["AdamW"]["state"][0]["step"]
    assert len(loaded["rng_per_rank"]) == 2 and loaded["scheduler"]["base_lrs"] == [0.1]


def test_a_planted_train_state_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(str(marker))}, tmp_path / "train_state.pt")
    with pytest.raises(ValueError, match=r"train_state.pt'.*refused without running it.*another `name`"):
        ckpt_format.load_train_state(str(tmp_path))
    assert not marker.exists()


def test_a_planted_model_part_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": _Payload(str(marker))}, tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"model.pt'.*refused without running it"):
        ckpt_format.load_model_state(str(tmp_path))
    assert not marker.exists()


def test_only_our_own_part_names_are_merged(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "model-stage0.pt")
    torch.save({"v": torch.ones(1)}, tmp_path / "model-stage1.pt")
    torch.save({"w": torch.zeros(1), "extra": torch.zeros(1)}, tmp_path / "model_backup.pt")
    state = ckpt_format.load_model_state(str(tmp_path))
    assert sorted(state) == ["v", "w"] and state["w"].item() == 1.0


def test_train_state_part_must_be_ours(tmp_path):
    with pytest.raises(ValueError, match=r"part '/../x' is not '' or '-stage<p>'"):
        ckpt_format.load_train_state(str(tmp_path), "/../x")


def _cifar_batch(n: int = 4) -> dict:
    rng = np.random.default_rng(0)
    return {b"batch_label": b"x", b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
            b"labels": list(range(n)), b"filenames": [b"a.png"] * n}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_real_cifar_batch_reads_with_the_restricted_unpickler(tmp_path, protocol):
    path = tmp_path / "data_batch_1"
    batch = _cifar_batch()
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    images, labels = cifar10.read_batch(str(path))
    assert images.shape == (4, 3, 32, 32) and labels.tolist() == [0, 1, 2, 3]
    assert np.array_equal(images.reshape(4, -1), batch[b"data"])


def test_a_planted_cifar_batch_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({**_cifar_batch(), b"labels": _Payload(str(marker))}, protocol=2))
    cifar10.check_batch_file(str(path))  # the header check alone cannot tell: it looks like a batch
    with pytest.raises(ValueError, match=r"data_batch_1: cannot be unpickled .*references posix.mkdir.*refused"):
        cifar10.read_batch(str(path))
    assert not marker.exists()


# ----------------------------------------------------------------------------- factories


@pytest.mark.parametrize("spec", ["os:system", "builtins:eval", "subprocess:run", "posix:system",
                                  "importlib.util:spec_from_file_location"])
def test_standard_library_callables_are_never_factories(spec):
    with pytest.raises(ValueError, match=rf"model='{spec}': '[\w.]+' is a standard-library module.*your own"):
        TrainConfig(model=spec)


def test_a_reexported_standard_library_callable_is_refused(tmp_path, monkeypatch):
    (tmp_path / "sneaky_models.py").write_text("from os import system as build\nfrom builtins import eval\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("build", "eval"):
        with pytest.raises(ValueError, match=rf"sneaky_models:{name}'.*standard-library or builtin callable"):
            load_factory(f"sneaky_models:{name}", "model")


def test_a_config_file_that_names_code_needs_an_opt_in(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "file_models.py").write_text(
        "import torch\n\ndef tiny(input_shape, num_classes, marker=None):\n"
        "    return torch.nn.Linear(64, num_classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(TRUSTED_MODULES_ENV, raising=False)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: file_models:tiny\nmodel_kwargs: {{marker: {marker}}}\n")
    with pytest.raises(ValueError, match=r"c.yaml: model='file_models:tiny' names code to run.*allow_code=True "
                                         r"to TrainConfig.from_yaml \(CLI: --allow-code\).*"
                                         r"RAYTRAIN_MGPU_TRUSTED_MODULES=file_models"):
        TrainConfig.from_yaml(path)
    assert TrainConfig.from_yaml(path, allow_code=True).model == "file_models:tiny"
    monkeypatch.setenv(TRUSTED_MODULES_ENV, "other, file_models")
    assert TrainConfig.from_yaml(path).model == "file_models:tiny"
    assert TrainConfig(model="file_models:tiny").model == "file_models:tiny"  # from Python: the user's own code
    path.write_text("model: lenet\ndataset: digits\n")
    assert TrainConfig.from_yaml(path).model == "lenet"  # registry names need nothing


def test_the_issue_payload_from_yaml_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"model: os:system\nmodel_kwargs: {{command: mkdir {marker}}}\n")
    for allow in ([], ["--allow-code"]):
        assert main(["train", "--config", str(path), *allow]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("raytrain-mgpu: error: ")
    assert not marker.exists()


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("overrides,match", [
    (dict(lr=float("inf")), r"lr=inf: must be a finite positive number"),
    (dict(lr=True), r"lr=True: must be a finite positive number"),
    (dict(grad_clip_norm=float("nan")), r"grad_clip_norm=nan: must be a finite positive number"),
    (dict(lr_step_gamma=-1), r"lr_step_gamma=-1: must be a finite number in \(0, 1\].*ascend"),
    (dict(warmup_epochs=float("inf")), r"warmup_epochs=inf: must be a finite number >= 0"),
    (dict(seed="abc"), r"seed='abc': must be an integer in \[0, 2\*\*63\)"),
    (dict(seed=2**70), r"seed=1180591620717411303424: must be an integer in \[0, 2\*\*63\)"),
    (dict(collective_timeout_s=0.4), r"collective_timeout_s=0.4: must be a finite number in \[1, inf\)"),
    (dict(collective_timeout_s="60"), r"collective_timeout_s='60': must be a finite number"),
    (dict(bucket_cap_mb=-1), r"bucket_cap_mb=-1: must be a finite positive number"),
    (dict(use_gpu="false"), r"use_gpu='false': must be true, false or 'auto'.*not quoted strings"),
    (dict(download="no"), r"download='no': must be true or false"),
    (dict(momentum="abc"), r"momentum='abc': must be a finite number in \[0, 1\)"),
    (dict(epochs=2.0), r"epochs=2.0: must be a positive integer"),
    (dict(storage_path=None), r"storage_path=None: must be a non-empty path or URI"),
    (dict(storage_path=""), r"storage_path='': must be a non-empty path or URI"),
    (dict(sync_batchnorm=True, use_gpu=False), r"sync_batchnorm=True: SyncBatchNorm needs GPUs.*Set use_gpu=True"),
    (dict(name="../x"), r"name='../x': must be a plain folder name"),
    (dict(name="/abs"), r"name='/abs': must be a plain folder name"),
    (dict(name=""), r"name='': must be a non-empty string.*plain folder name"),
    (dict(name=".."), r"name='..': must be a plain folder name"),
    (dict(dataset="synthetic", num_classes=1, num_samples=64, input_shape=[4]), r"num_classes=1: .*>= 2"),
])
def test_bad_values_stop_in_the_config(overrides, match):
    with pytest.raises(ValueError, match=r"TrainConfig\." + match):
        TrainConfig(**overrides)


@pytest.mark.parametrize("argv,match", [
    (["--weight-decay", "abc"], r"TrainConfig.weight_decay='abc': must be a finite number >= 0"),
    (["--lr", "[1"], r"argument --lr: '\[1' is not a YAML value"),
    (["--batch-size"], r"argument --batch-size: expected one argument"),
    (["--no-such-option"], r"unrecognized arguments: --no-such-option"),
])
def test_cli_bad_values_exit_2_with_one_line(argv, match, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"raytrain-mgpu: error: " + match, err)


# ----------------------------------------------------------------------------- run folders


def _ckpt(run, meta_config: dict, **extra):
    folder = run / "checkpoint_000001"
    ckpt_format.write_checkpoint(str(folder), meta={"model": meta_config["model"], "strategy": meta_config["strategy"],
                                                    "config": meta_config, **extra}, history=[])


def test_a_resume_that_changes_what_the_run_is_is_refused(tmp_path):
    cfg = TrainConfig(optimizer="sgd", storage_path=str(tmp_path), name="r")
    info = {"input_shape": [1, 8, 8], "num_classes": 10, "train_split_size": 1438}
    check_run_folder(cfg, info)  # a new run: recorded
    assert json.loads((tmp_path / "r" / "run.json").read_text())["optimizer"] == "sgd"
    _ckpt(tmp_path / "r", cfg.to_dict(), input_shape=[1, 8, 8], num_classes=10)
    check_run_folder(cfg.replace(epochs=20, lr=0.5, max_failures=3, verbose=True), info)  # may change
    with pytest.raises(ValueError, match=r"run folder .*/r' holds checkpoints trained with optimizer='sgd', but "
                                         r"this run has optimizer='adamw': resuming would mix.*Use another `name`"):
        check_run_folder(cfg.replace(optimizer="adamw"), info)
    with pytest.raises(ValueError, match=r"trained with data.train_split_size=1438, but this run has data.train_split_size=1000"):
        check_run_folder(cfg, {**info, "train_split_size": 1000})


def test_a_run_folder_without_a_record_compares_with_its_checkpoint(tmp_path):
    cfg = TrainConfig(dataset="synthetic", num_samples=64, input_shape=[1, 8, 8], storage_path=str(tmp_path), name="r")
    _ckpt(tmp_path / "r", TrainConfig(storage_path=str(tmp_path), name="r").to_dict(),
          input_shape=[1, 8, 8], num_classes=10)
    with pytest.raises(ValueError, match=r"trained with dataset='digits', but this run has dataset='synthetic'"):
        check_run_folder(cfg, {"input_shape": [1, 8, 8], "num_classes": 10})


def test_batch_larger_than_the_training_split_and_too_few_classes(tmp_path):
    with pytest.raises(ValueError, match=r"batch_size=2048: the global batch is larger than the training split "
                                         r"of 'digits' \(1438 samples\).*Set batch_size to 1438 or less"):
        check_data_fits(TrainConfig(batch_size=2048), 10)
    assert check_data_fits(TrainConfig(dataset="synthetic", num_samples=64, input_shape=[4], batch_size=64), 10) == 64
    with pytest.raises(ValueError, match=r"the data has 1 class\(es\); a classifier needs at least 2"):
        check_data_fits(TrainConfig(), 1)


def test_a_parquet_table_with_zero_rows_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": pa.array([], pa.binary()), "label": pa.array([], pa.int64())}),
                   tmp_path / "empty.parquet")
    cfg = TrainConfig(dataset="parquet", data_root=str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match=r"empty.parquet: the table has 0 rows"):
        check_data(cfg.data)


def test_a_second_driver_is_refused_while_the_first_lives(tmp_path, caplog):
    run = str(tmp_path / "r")
    first = RunLock.acquire(run)
    try:
        with pytest.raises(ValueError, match=r"run folder .* is in use by another driver \(host .*, pid "
                                             rf"{os.getpid()}.*another `name`"):
            RunLock.acquire(run)
    finally:
        first.release()
    assert not (tmp_path / "r" / LOCK_FILE).exists()
    # a driver that died: its lock is stale and taken over with a log line
    (tmp_path / "r" / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": 0}))
    with caplog.at_level("WARNING"):
        RunLock.acquire(run).release()
    assert "taking over a stale lock of host elsewhere" in caplog.text


def test_history_and_compare_outputs_are_written_by_rename(tmp_path):
    from raytrain_mgpu.api import _write_history
    from raytrain_mgpu.planning.compare_report import _write

    _write_history([{"epoch": 1}], str(tmp_path))
    _write(str(tmp_path / "c" / "compare.md"), b"x")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["compare.md", "history.parquet"]


@pytest.mark.parametrize("text,expected", [
    ("s3://AKIA:SECRET@bucket/runs", "s3://***@bucket/runs"),
    ("run gs://tok@b/x failed", "run gs://***@b/x failed"),
    ("s3://bucket/runs?access_key=AKIA&secret_key=S&region=eu", "s3://bucket/runs?access_key=***&secret_key=***&region=eu"),
    ("/plain/path", "/plain/path"),
])
def test_credentials_in_uris_are_redacted(text, expected):
    assert redact(text) == expected
    assert redact({"storage_path": text, "n": 1}) == {"storage_path": expected, "n": 1}


def test_banner_and_failure_message_hold_no_secret():
    from raytrain_mgpu.api import _banner
    from raytrain_mgpu.transports.retry import whole_failure
    from raytrain_mgpu.strategies.plan import build_plan

    cfg = TrainConfig(storage_path="s3://AKIA:SECRET@bucket/runs", name="r", use_gpu=False, num_workers=2)
    failed = whole_failure(cfg, RuntimeError("x"))
    texts = [_banner(cfg, build_plan(cfg), (1, 8, 8), 10), "\n".join(failed.__notes__)]
    assert all("SECRET" not in t and "s3://***@bucket/runs/r" in t for t in texts)


def test_compare_keeps_uri_credentials_out_of_its_report_and_errors(monkeypatch, caplog):
    import traceback

    from raytrain_mgpu.planning.compare import _run, _write_report
    from raytrain_mgpu.planning.compare_report import CompareReport, Recommendation, RunRow

    report = CompareReport("t", [], "ok", Recommendation(None, None, "none"))
    with pytest.raises(ValueError, match=r"compare: writing the report to 'nosuch://\*\*\*@bucket/c' failed: "
                                         r"Unrecognized filesystem type in URI: nosuch://\*\*\*@bucket/c") as info:
        _write_report(report, "nosuch://AKIA:SECRET@bucket/c")
    assert "SECRET" not in str(info.value)
    # pyarrow's original (which holds the secret) is not printed as a chained cause
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "SECRET" in str(info.value.__context__) and "During handling" not in "".join(
        traceback.format_exception(info.value))

    def failing_fit(cfg, stream=None):
        raise RuntimeError(f"cannot reach {cfg.storage_path}/{cfg.name}")

    row = RunRow("ddp", "ddp", "1 worker", config=TrainConfig(use_gpu=False, num_workers=1), num_processes=1)
    with caplog.at_level("WARNING"):
        _run(row, 1438, 2, 0, "s3://AKIA:SECRET@bucket/runs", None, failing_fit)
    assert row.status == "failed" and row.reason == "RuntimeError: cannot reach s3://***@bucket/runs/ddp"
    assert "s3://***@bucket" in caplog.text and "SECRET" not in caplog.text


class _Started(Exception):
    """Raised where an attempt would start its processes: what it did before is what the test reads."""


def test_a_killed_drivers_temporary_checkpoints_are_pruned_under_our_lock_only(tmp_path, caplog, monkeypatch):
    import time
    import socket

    from types import SimpleNamespace

    from raytrain_mgpu.transports import attempt as attempt_driver
    from raytrain_mgpu.transports.actor_group import group
    from raytrain_mgpu.transports.actor_group import runner
    from raytrain_mgpu.engine import loop as engine
    from raytrain_mgpu.checkpointing.run_folder import RunFolder
    from raytrain_mgpu.strategies.plan import build_plan
    from raytrain_mgpu.transports.local import run_in_process

    cfg = TrainConfig(storage_path=str(tmp_path), name="r", use_gpu=False, num_workers=2)
    run = tmp_path / "r"
    done = run / "checkpoint_epoch000001"
    ckpt_format.write_checkpoint(str(done), meta={"model": cfg.model, "strategy": cfg.strategy, "epoch": 1,
                                                  "step": 22}, history=[])
    leftovers = [run / ".tmp-checkpoint_epoch000002-0123456789ab", run / ".tmp-checkpoint_epoch000002-ba9876543210"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "model-stage0.pt").write_bytes(b"half")
    # another live driver holds the lock (our parent process stands in for it): its save may be in flight
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                             "heartbeat": time.time()}))
    with caplog.at_level("WARNING"):
        assert remove_stale_temporaries(RunFolder.of(cfg)) == []
    assert all(f.is_dir() for f in leftovers) and f"pid {os.getppid()}" in caplog.text
    (run / LOCK_FILE).unlink()
    lock = RunLock.acquire(str(run))  # our own lock, as fit holds it
    try:
        with caplog.at_level("INFO"):
            assert remove_stale_temporaries(RunFolder.of(cfg)) == sorted(f.name for f in leftovers)
        assert "removed 2 temporary checkpoint folder(s) left by a stopped driver" in caplog.text
        assert not any(f.exists() for f in leftovers) and (done / ckpt_format.META_FILE).is_file()
        assert RunFolder.of(cfg).state().checkpoint == str(done)

        def started(*args, **kwargs):
            raise _Started()

        # The start of every attempt prunes (the one attempt driver, transports/attempt.py): the pipeline's (before
        # its actor group) and the in-process runner's (before its engine), so a failed attempt's half-written
        # checkpoint never outlives the restart. The pipeline's progress channel: a stand-in (no Ray here).
        monkeypatch.setattr(group, "StageGroup", started)
        monkeypatch.setattr(engine, "Engine", started)
        monkeypatch.setattr(attempt_driver, "ProgressSink", SimpleNamespace(open=lambda: SimpleNamespace(
            close=lambda: None, drain=SimpleNamespace(remote=lambda: []))))
        pipe = cfg.replace(strategy="pipeline", num_stages=2)
        for attempt in (lambda: attempt_driver.drive(runner.ActorGroupCarrier(pipe, build_plan(pipe), None)),
                        lambda: run_in_process(cfg, build_plan(cfg), None)):
            leftovers[0].mkdir()
            with pytest.raises(_Started):
                attempt()
            assert not leftovers[0].exists()
    finally:
        lock.release()


# ----------------------------------------------------------------------------- through fit

# One worker: fit trains it in this process (runner="auto"); the run folder's lock and the resume check are
# fit's own, before it picks a runner, so they hold for a run through Ray alike.
TINY_FIT = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=1, max_steps=2,
                optimizer="sgd", lr=0.1, num_workers=1, use_gpu=False)


def _snapshot(folder) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def locked_then_trained(tmp_path_factory):
    """The module's one fit: refused while another live driver holds the run folder, run once that
    driver is gone. Returns ``(cfg, owner pid, the refusal, checkpoints written while refused, the
    owner's exit code, the result)``; the finished run folder is also what the resume check refuses to mix."""
    import subprocess
    import sys

    from raytrain_mgpu import api

    storage = str(tmp_path_factory.mktemp("locked") / "results")
    cfg = TrainConfig(**TINY_FIT, storage_path=storage, name="locked")
    run_path = f"{storage}/locked"
    holder = ("import sys\nfrom raytrain_mgpu.driver.runlock import RunLock\nlock = RunLock.acquire(sys.argv[1])\n"
              "print('locked', flush=True)\nsys.stdin.readline()\nlock.release()\n")
    owner = subprocess.Popen([sys.executable, "-c", holder, run_path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    refused = None
    try:
        assert owner.stdout.readline().strip() == "locked"
        try:
            api.fit(cfg)
        except ValueError as error:
            refused = error
        checkpoints_while_refused = [p.name for p in Path(run_path).iterdir() if p.name.startswith("checkpoint")]
    finally:
        owner.communicate("\n", timeout=60)  # the owner releases its lock and exits
    return cfg, owner.pid, refused, checkpoints_while_refused, owner.returncode, api.fit(cfg)


def test_fit_refuses_a_changed_resume_before_ray_and_leaves_the_run_folder_alone(locked_then_trained, monkeypatch):
    from raytrain_mgpu import api

    cfg, *_, result = locked_then_trained
    assert result.checkpoint_path is not None
    run = Path(result.path)
    before = _snapshot(run)
    assert "run.json" in before and any(name.startswith("checkpoint") for name in before)

    def no_ray(*args, **kwargs):
        raise AssertionError("fit connected to Ray before refusing the resume")

    monkeypatch.setattr(api, "connect", no_ray)
    # runner="ray": this fit would start Ray, and must refuse before it does
    with pytest.raises(ValueError, match=r"run folder .*/locked' holds checkpoints trained with batch_size=64, but "
                                         r"this run has batch_size=32; trained with optimizer='sgd', but this run has "
                                         r"optimizer='adamw': resuming would mix two runs. Use another `name`"):
        api.fit(cfg.replace(optimizer="adamw", batch_size=32, runner="ray"))
    assert _snapshot(run) == before  # same files, same bytes, same mtimes (the lock came and went)


def test_fit_is_refused_while_another_live_driver_holds_the_run_and_runs_once_it_is_gone(locked_then_trained):
    import socket

    _, owner_pid, refused, checkpoints_while_refused, owner_returncode, result = locked_then_trained
    assert isinstance(refused, ValueError), refused
    assert re.search(rf"run folder '.*/locked' is in use by another driver \(host "
                     rf"{re.escape(socket.gethostname())}, pid {owner_pid}, .*another `name`", str(refused)), refused
    assert checkpoints_while_refused == []
    assert owner_returncode == 0
    assert result.checkpoint_path is not None and result.metrics["step"] == 2
    assert not os.path.exists(f"{result.path}/{LOCK_FILE}")
