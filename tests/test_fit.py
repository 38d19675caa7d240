"""Data-parallel training through the public API on a shared Ray instance (CPU, gloo)."""

from __future__ import annotations

import re
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.cli import main
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.data.convert import convert_to_parquet
from raytrain_mgpu.models import build_model
from raytrain_mgpu.planning.auto import RESUMING

pytestmark = pytest.mark.ray

# An MLP without BatchNorm or dropout: runs with the same global batch must agree exactly.
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd", lr=0.1, seed=3,
           use_gpu=False)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_workers_equal_one_and_resume_continues_exactly(ray_session, storage, monkeypatch):
    """Also the Ray Train runner's callbacks and loggers across a resume (tests/test_callbacks.py's
    protocol; tests/test_loggers.py's CSV file: the events through the progress channel reach the loggers,
    which need no extra; every logger's files across a resume are tests/test_loggers.py's, in-process), and
    ``strategy="auto"`` (tests/test_auto.py's rules): the same two fits carry them; a third call is answered
    from the finished run's folder."""
    from _reference import evaluate, train_one_worker
    from test_callbacks import Recorder, assert_events_in_order
    from test_loggers import assert_csv_logged
    from test_ray_ingest import actors_started

    # Reference: one worker, three epochs in one go, in this process (what a 1-worker fit trains:
    # tests/test_loaders.py), evaluated as fit evaluates.
    one_fields = dict(MLP, num_workers=1, epochs=3)
    w_one, _, _, one_history = train_one_worker(one_fields)
    one_test_loss = evaluate(one_fields, w_one)["test_loss"]
    # Two workers with accumulation, stopped after two epochs, then resumed for the third.
    first_events, resumed_events = Recorder(), Recorder()
    managers = actors_started(ray_session, "DatasetManager")
    two_cfg = rtm.TrainConfig(**MLP, strategy="auto", num_workers=2, grad_accum_steps=2, epochs=2, name="two",
                              storage_path=storage, log_every_n_steps=2, loggers=["csv"])
    started = time.perf_counter()
    first = rtm.fit(two_cfg.replace(callbacks=[first_events]))
    first_s = time.perf_counter() - started
    mailboxes = actors_started(ray_session, "_Mailbox")  # the driver's progress mailbox (driver/progress.py)
    assert [h["epoch"] for h in first.history] == [1, 2]
    started = time.perf_counter()
    resumed = rtm.fit(two_cfg.replace(epochs=3, callbacks=[resumed_events]))
    resume_s = time.perf_counter() - started
    # A loader run starts no Ray Data actor (transports/ray_train/driver.torch_trainer_class; a ray_data run does: test_ray_ingest.py).
    assert actors_started(ray_session, "DatasetManager") == managers
    # The resumed run's events (resumed_events below) came through the first run's mailbox, on a channel of its own.
    assert actors_started(ray_session, "_Mailbox") == mailboxes

    # Resume trained only the third epoch and kept the history before it.
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3]
    assert [h["attempt"] for h in resumed.history] == [0, 0, 1]
    assert resumed.history[:2] == first.history
    assert resumed.metrics["step"] == one_history[-1]["step"] == 3 * (1438 // 64)

    # Same samples per global step => same weights, whatever the worker count.
    w_two = _weights(resumed.load_model())
    assert w_two.keys() == w_one.keys()
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5)
    # Evaluation covers the whole test split on both.
    assert resumed.metrics["test_loss"] == pytest.approx(one_test_loss, rel=1e-4)

    # Metrics, history file, per-device memory.
    m = resumed.metrics
    for key in ("epoch", "step", "train_loss", "test_loss", "test_accuracy", "samples_per_s",
                "step_time_s", "data_wait_share", "peak_memory_bytes"):
        assert key in m, key
    assert len(m["peak_memory_bytes"]) == 2 and min(m["peak_memory_bytes"]) > 10 * 2**20
    assert m["samples_per_s"] > 0 and 0 <= m["data_wait_share"] < 1
    # Where each epoch's time went (tests/test_epoch_times.py): throughput is training throughput, the
    # epoch's checkpoint and evaluation apart; the parts of the first fit's epochs fit in its wall time.
    for row in resumed.history:
        assert row["samples_per_s"] * row["training_s"] == pytest.approx(1408)  # 22 steps of 64
        assert row["checkpoint_s"] > 0 and (row["eval_s"] > 0) == (row["test_loss"] is not None)
    assert sum(row["training_s"] + row["checkpoint_s"] + row["eval_s"] for row in first.history) < first_s
    table = pq.read_table(f"{resumed.path}/history.parquet")
    assert table.num_rows == 3 and table.column("epoch").to_pylist() == [1, 2, 3]

    # The callbacks' events: the first fit from scratch, the resume from its last step, each in order.
    start = first_events.events[0][1]
    assert start.resumed is False and (start.start_epoch, start.start_step) == (0, 0)
    assert start.config["name"] == "two" and start.path == first.path
    assert_events_in_order(first_events, first, [1, 2])
    scalars = [what for kind, what in first_events.events if kind == "step"]
    assert scalars and {"train/loss", "train/lr"} <= set(scalars[0][1])
    assert first.config.callbacks == []  # objects are not part of the recorded config
    start = resumed_events.events[0][1]
    assert start.resumed is True and (start.start_epoch, start.start_step) == (2, first.metrics["step"])
    assert_events_in_order(resumed_events, resumed, [3])  # only the third epoch
    assert all(what[0] > first.metrics["step"] for kind, what in resumed_events.events if kind == "step")
    # The logger's file: every epoch row, the step scalars every 2 steps, no step twice.
    assert_csv_logged(resumed.path, resumed.history, steps_per_log=2)

    # strategy="auto" chose ddp over both workers for this small model, recorded it in every row, and
    # kept it on resume; the finished auto run is answered from its folder (layout read back), no Ray.
    assert first.config.strategy == resumed.config.strategy == "ddp" and resumed.config.num_workers == 2
    reasons = table.column("auto_reason").to_pylist()  # each row: the reason of the call that trained it
    assert reasons[0] == reasons[1] and reasons[0].startswith("ddp over all 2") and reasons[2] == RESUMING
    assert table.column("auto_strategy").to_pylist() == ["ddp"] * 3
    _refuse_ray(monkeypatch)
    started = time.perf_counter()
    again = rtm.fit(two_cfg.replace(epochs=3))
    # A fraction of the resumed run (a worker group's start and an epoch), timed here, so a slower machine
    # slows both alike; Ray refused above is the check that nothing is trained.
    assert time.perf_counter() - started < resume_s / 4, resume_s
    assert again.config.strategy == "ddp" and again.history == resumed.history
    assert again.checkpoint_path == resumed.checkpoint_path


def _refuse_ray(monkeypatch):
    """Any attempt to start or use Ray fails the test (the shared instance is already up)."""
    import ray

    from raytrain_mgpu import api

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run started Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(api, "connect", refuse)


@pytest.mark.quick  # the quick tier's Ray Train run: the README's main job, then its answer from the folder
def test_cli_default_run_learns_digits_and_is_then_answered_from_its_folder_without_ray(
        ray_session, storage, monkeypatch, capsys):
    import time

    from ray._private import state

    from raytrain_mgpu.transports.preemption import WATCHER_ENV

    def watchers_started() -> int:  # alive or dead, from the GCS's actor table (as tests/test_ray_ingest.py)
        return sum(actor["ActorClassName"].endswith("PreemptionWatcher") for actor in state.actors().values())

    # The README's main job, with a temporary storage path: lenet on digits, ddp, 2 workers (a machine without a
    # GPU: the shared instance's emulated ones refused); Ray Train's preemption watcher left to fit, as a user has it
    # (the shared instance turns it off for every test).
    monkeypatch.delenv(WATCHER_ENV, raising=False)
    watchers = watchers_started()
    start = time.perf_counter()
    assert main(["train", "--storage-path", storage, "--no-use-gpu"]) == 0
    run_s = time.perf_counter() - start
    # On a Ray this process started, no node is drained for preemption: the watcher, an actor process
    # starting beside the first steps, never ran (checkpointing/preemption.py).
    assert watchers_started() == watchers
    out = capsys.readouterr().out
    assert "global batch 128 = 2 replica(s) x 64 x 1 accumulation step(s)" in out
    epoch_lines = [line for line in out.splitlines() if line.startswith("epoch")]
    assert len(epoch_lines) == rtm.TrainConfig().epochs
    assert "samples/s" in epoch_lines[-1] and "mem/device" in epoch_lines[-1]
    accuracy = float(out.split("test_accuracy ")[-1].split(",")[0])
    assert accuracy > 0.9
    # The closing line says where the time to the first step went (TrainResult.startup): the parts add up
    # to it (to the printed rounding), and it is within the run.
    done = re.search(r"done in (\d+) s \(first step after ([\d.]+) s: checks ([\d.]+), Ray ([\d.]+), worker group "
                     r"([\d.]+), data and model ([\d.]+)\): test_accuracy", out)
    assert done, out
    first, *parts = (float(v) for v in done.groups()[1:])
    assert sum(parts) == pytest.approx(first, abs=0.25) and 0 < first < run_s and parts[2] > 0, done.group(0)

    # The same run again, from Python: answered from its folder, Ray refused.
    _refuse_ray(monkeypatch)
    start = time.perf_counter()
    again = rtm.fit(rtm.TrainConfig(storage_path=storage, use_gpu=False))
    elapsed = time.perf_counter() - start
    # Ray refused above is the real check. The time says that nothing else is done instead: a
    # fraction of the run it answers for, timed here, so a slower machine slows both alike.
    assert elapsed < run_s / 4, (elapsed, run_s)
    steps = rtm.TrainConfig().epochs * (1438 // 128)
    assert [row["epoch"] for row in again.history] == list(range(1, rtm.TrainConfig().epochs + 1))
    assert again.metrics["step"] == steps and again.metrics["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)
    assert [row["workers"] for row in again.history] == [2] * len(again.history)  # each row records its workers
    out = capsys.readouterr().out
    assert out.count(f"is already finished (epoch {rtm.TrainConfig().epochs}, step {steps}); nothing to train. "
                     "Raise epochs") == 1, out
    print(f"answered in {elapsed:.2f} s; the run took {run_s:.1f} s")
    assert again.load_model().state_dict().keys() == build_model("lenet", (1, 8, 8), 10, {}).state_dict().keys()


def test_user_model_from_own_folder_trains_on_parquet(ray_session, storage, tmp_path, monkeypatch):
    # Digits written as Parquet shards: the workers read it through pyarrow, each only its rows.
    parquet = tmp_path / "digits-parquet"
    convert_to_parquet(rtm.TrainConfig().data, str(parquet))
    folder = tmp_path / "userproj"
    folder.mkdir()
    (folder / "my_models.py").write_text(textwrap.dedent("""
        from torch import nn
        def tiny(input_shape, num_classes, hidden=16):
            return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
    """))
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    cfg = rtm.TrainConfig(model="my_models:tiny", model_kwargs={"hidden": 8}, num_workers=2, use_gpu=False, epochs=2,
                          dataset="parquet", data_root=str(parquet), name="user", storage_path=storage)
    result = rtm.fit(cfg)
    assert result.load_model()[1].out_features == 8
    assert result.metrics["test_accuracy"] > 0.5  # learnt from the Parquet copy of digits
    # The same run name with another model must not resume silently.
    with pytest.raises(ValueError, match=r"trained with model='my_models:tiny', but this run has model='lenet'"):
        rtm.fit(cfg.replace(model="lenet", model_kwargs={}))
    sys.modules.pop("my_models", None)


def test_cluster_checks_fail_before_scheduling(ray_session, storage):
    # The shared instance emulates 4 GPUs (conftest); "use_gpu=True on a cluster without GPU"
    # is checked against a fake node list in test_autoscaler.py.
    with pytest.raises(ValueError, match=r"needs 8 x \{'CPU': 1\}.*cannot place \(node 0: 4 CPU, 4 GPU\)"):
        rtm.fit(rtm.TrainConfig(num_workers=8, use_gpu=False, storage_path=storage))
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module' \(ModuleNotFoundError"):
        rtm.fit(rtm.TrainConfig(model="no_such_module:build", use_gpu=False, storage_path=storage))


def test_cli_pipeline_job_config_trains_resumes_and_loads(ray_session, storage, capsys):
    # The CPU pipeline job (2 stage actors): 2 epochs, then the same run to 3 epochs resumes.
    args = ["train", "--config", "jobs/configs/mlp_digits_pipeline_cpu.yaml", "--storage-path", storage,
            "--name", "pipe-cli"]
    assert main([*args, "--epochs", "2"]) == 0
    first = capsys.readouterr().out
    assert [line.split()[1] for line in first.splitlines() if line.startswith("epoch")] == ["1/2", "2/2"]
    assert main([*args, "--epochs", "3"]) == 0
    second = capsys.readouterr().out
    assert [line.split()[1] for line in second.splitlines() if line.startswith("epoch")] == ["3/3"]

    # The stage parts reassemble into the plain model, which learned the digits.
    cfg = rtm.TrainConfig.from_yaml("jobs/configs/mlp_digits_pipeline_cpu.yaml")
    result = rtm.fit(cfg.replace(epochs=3, name="pipe-cli", storage_path=storage))  # done: nothing to train
    assert [h["attempt"] for h in result.history] == [0, 0, 1] and result.history[-1]["partition"] == [3, 2]
    model = result.load_model()
    test = build_datasets(cfg.data).test
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(result.metrics["test_accuracy"], abs=1e-6) and accuracy > 0.9


@pytest.mark.quick  # two small actors on the shared Ray
def test_the_runs_of_one_driver_share_its_progress_mailbox_on_channels_of_their_own(ray_session):
    from raytrain_mgpu.driver.progress import ProgressSink

    ray = ray_session
    first, second = ProgressSink.open(), ProgressSink.open()
    assert first.mailbox == second.mailbox and first.channel != second.channel  # one actor for both runs
    first.put.remote("epoch", 1)
    second.put.remote("epoch", 2)
    assert ray.get(first.drain.remote()) == [("epoch", 1)] and ray.get(second.drain.remote()) == [("epoch", 2)]
    first.close()
    first.put.remote("epoch", 3)  # a killed run's rank 0, late: dropped, nobody would drain it
    assert ray.get(first.drain.remote()) == [] and ray.get(second.drain.remote()) == []
    second.close()
    ray.kill(second.mailbox)  # a mailbox that died is replaced by the next run
    deadline = time.monotonic() + 120
    while True:  # until it is dead: the kill is asynchronous
        try:
            ray.get(second.mailbox.drain.remote(second.channel), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed mailbox still answers"
        time.sleep(0.1)
    third = ProgressSink.open()
    assert third.mailbox != second.mailbox
    third.put.remote("notice", "hello")
    assert ray.get(third.drain.remote()) == [("notice", "hello")]
    third.close()


@pytest.mark.quick  # one small actor on the shared Ray
def test_a_workers_events_are_in_the_mailbox_when_its_reporter_is_flushed(ray_session, tmp_path):
    """The run's end (``Transport.finish``) flushes rank 0's reporter: the driver's last drain, which is not
    ordered with a worker's sends, then finds the last checkpoint's announcement. Here a mailbox that takes a
    while over each event marks it received in a file: flush returns only after that."""
    from raytrain_mgpu.driver.progress import ProgressSink, WorkerReporter

    @ray_session.remote(num_cpus=0)
    class SlowMailbox:
        def put(self, channel, kind, payload):
            time.sleep(1.0)
            with open(tmp_path / "received", "a") as f:
                f.write(f"{kind} {payload}\n")

    reporter = WorkerReporter(ProgressSink(SlowMailbox.remote(), "run"))
    reporter.epoch(2)
    reporter.checkpoint("checkpoint_epoch000002")
    reporter.flush()
    assert (tmp_path / "received").read_text() == "epoch 2\ncheckpoint checkpoint_epoch000002\n"
    reporter.flush()  # nothing in flight: back at once
