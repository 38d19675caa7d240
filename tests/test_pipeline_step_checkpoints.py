"""The pipeline runner's step checkpoints and background upload (``pipeline/checkpoints.py``).

Unit tests: the background writer (one job at a time, a failure raised at the next save or the
end), the driver's saver (``meta.json`` last: a checkpoint whose parts are still uploading is no
resume point), the snapshot (a copy: training goes on in place), the names (they sort by age).

Ray runs (the shared instance, its emulated GPUs): a 2-stage pipeline (and a ``ddp_pipeline`` of 2
replicas, GPipe) whose last stage dies in the middle of epoch 2 resumes at the last step checkpoint,
inside the epoch, on the epoch's own sample order, and ends with the weights and epoch rows of an
undisturbed run computed in this process (``tests/_pipeline_reference.py``), each stage actor on its
own GPU; and the stall per checkpoint on a slow storage with and without the background upload
(printed: ``pytest -s``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.pipeline.checkpoints import (SYNC_UPLOAD_ENV, BackgroundWriter, CheckpointSaver, checkpoint_name,
                                                epoch_partial, resume_sums, snapshot)
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.run_state import RunState
from _pipeline_reference import train_pipeline, train_unsplit

PIPE = dict(model="mlp", model_kwargs={"widths": [32, 32]}, dataset="_pipe_probe:digits", strategy="pipeline",
            num_stages=2, num_microbatches=4, schedule="1f1b", batch_size=64, optimizer="sgd", lr=0.1, seed=3,
            epochs=2)  # no BatchNorm or dropout: runs that see the same batches agree exactly
STEPS_PER_EPOCH = 1438 // 64   # 22: digits' train split at batch 64
EVERY = 5                      # step checkpoints at global steps 5, 10, 15, 20, 25, 30, 35, 40
FAIL_AT = 33                   # the last stage dies at the start of global step 33 (epoch 2's 12th step)


# ---------------------------------------------------------------------- unit tests


def test_the_background_writer_runs_one_job_at_a_time_and_raises_a_failure_at_the_next_submit_or_wait():
    writer, release, order = BackgroundWriter("upload"), threading.Event(), []

    def slow(name):
        order.append(f"{name} starts")
        release.wait(5)
        order.append(f"{name} ends")
        return name

    started = time.perf_counter()
    writer.submit(slow, "first")
    assert time.perf_counter() - started < 1 and not writer.done()  # submit does not wait for it
    threading.Timer(0.2, release.set).start()
    writer.submit(slow, "second")  # waits for the first
    assert writer.wait() == "second" and writer.wait() is None
    assert order == ["first starts", "first ends", "second starts", "second ends"]

    def broken():
        raise OSError("disk full")

    writer.submit(broken)
    with pytest.raises(OSError, match="disk full") as failure:
        writer.submit(slow, "third")  # the failure is raised at the next save...
    assert "raised by the upload, in the background" in failure.value.__notes__[0]
    assert len(order) == 4  # ...which did not start
    writer.submit(broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()  # ...or at the end
    assert writer.wait() is None  # raised once


class _Group:
    """A stand-in for the StageGroup: the stages' parts land when ``release`` is set."""

    def __init__(self, folder: RunFolder, fail: bool = False):
        self.folder, self.fail, self.release, self.saves = folder, fail, threading.Event(), []

    def call(self, method, directory, in_epoch):
        assert method == "save"
        self.saves.append((directory, in_epoch))
        return [{"rank": rank} for rank in range(2)] if in_epoch else [None, None]

    def wait_uploads(self):
        self.release.wait(10)
        if self.fail:
            raise OSError("the storage refused stage 1's part")
        directory = Path(self.saves[-1][0])
        for p in range(2):
            (directory / f"model-stage{p}.pt").write_bytes(b"part")


def _saver(tmp_path, fail=False):
    cfg = rtm.TrainConfig(**dict(PIPE, dataset="digits"), storage_path=str(tmp_path), name="run",
                          checkpoint_every_n_steps=EVERY, num_checkpoints_to_keep=5)
    folder = RunFolder.of(cfg)
    group = _Group(folder, fail)
    return CheckpointSaver(cfg, group, SimpleNamespace(counts=[3, 1]), {"input_shape": [8, 8], "num_classes": 10}), \
        group, folder


class _Reporter:
    def __init__(self):
        self.checkpoints = []

    def checkpoint(self, path):
        self.checkpoints.append(path)

    def epoch(self, metrics):
        pass

    def step(self, step, total, epoch=0):
        pass


def test_a_step_checkpoint_is_no_resume_point_until_every_part_is_written_then_meta_json_last(tmp_path, monkeypatch):
    saver, group, folder = _saver(tmp_path)
    present_at_meta = []
    write = ckpt_format.write_checkpoint

    def recording(directory, **kwargs):
        present_at_meta.append(sorted(p.name for p in Path(directory).iterdir()))
        return write(directory, **kwargs)

    monkeypatch.setattr(ckpt_format, "write_checkpoint", recording)
    reporter = _Reporter()
    state = RunState(epoch=1, step=30, step_in_epoch=8, history=[{"epoch": 1, "step": 22}])
    path = saver.save(state, reporter, epoch_elapsed_s=1.5)
    assert group.saves[0][1] is True  # the stages take their partial epoch sums too
    # Uploading: the temporary folder has no meta.json, so a resume starts fresh, not from it.
    assert folder.state().checkpoint is None and present_at_meta == [] and reporter.checkpoints == []
    assert [p.name for p in (tmp_path / "run").iterdir()][0].startswith(".tmp-checkpoint_epoch000001_step000000030")
    group.release.set()
    saver.finish(reporter)
    assert present_at_meta == [["model-stage0.pt", "model-stage1.pt"]]  # every part before meta.json
    assert reporter.checkpoints == [path] and path.endswith("/run/checkpoint_epoch000001_step000000030")
    resumed = folder.state()
    assert (resumed.epoch, resumed.step, resumed.step_in_epoch) == (1, 30, 8)
    assert resumed.meta["epoch_elapsed_s"] == 1.5 and resumed.meta["partition"] == [3, 1]
    assert resumed.meta["epoch_partial_per_rank"] == [{"rank": 0}, {"rank": 1}]  # every rank's sums, in rank order


def test_a_failed_upload_is_raised_at_the_next_save_and_publishes_nothing(tmp_path):
    saver, group, folder = _saver(tmp_path, fail=True)
    group.release.set()
    state = RunState(epoch=1, step=30, step_in_epoch=8)
    saver.save(state, _Reporter(), epoch_elapsed_s=1.0)  # returns at once: the upload fails later
    state.step, state.step_in_epoch = 35, 13
    with pytest.raises(OSError, match="refused stage 1's part"):
        saver.save(state, _Reporter(), epoch_elapsed_s=2.0)
    assert folder.checkpoints() == [] and folder.state().checkpoint is None
    saver.save(state, _Reporter(), epoch_elapsed_s=2.0)
    with pytest.raises(OSError, match="refused stage 1's part"):
        saver.finish(_Reporter())  # the end waits for the last upload and raises its failure


def test_the_snapshot_is_a_copy_on_cpu_of_the_state():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    layer(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    model_state, train_state = snapshot(layer.state_dict(), optimizer, scheduler)
    before = {k: v.clone() for k, v in model_state.items()}
    momentum = train_state["optimizer"]["state"][0]["momentum_buffer"].clone()
    optimizer.step()  # training goes on in place
    assert not torch.equal(layer.weight, before["weight"])
    assert all(torch.equal(model_state[k], before[k]) for k in before)
    assert torch.equal(train_state["optimizer"]["state"][0]["momentum_buffer"], momentum)


def test_a_ranks_partial_epoch_sums_survive_meta_json_exactly():
    from raytrain_mgpu.objectives import Objective
    from raytrain_mgpu.runtime.metrics import EpochMeter, StageTotals

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 10, generator=generator), torch.randint(0, 10, (n,), generator=generator))
               for n in (4, 6, 5)]
    whole, first, rest = (EpochMeter(torch.device("cpu"), Objective()) for _ in range(3))
    for i, (outputs, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(outputs, y)
        whole.add(loss, outputs, y)
        (first if i == 0 else rest).add(loss, outputs, y)
    totals, resumed = StageTotals(), StageTotals()
    totals.steps, totals.data_wait_s, totals.bytes_sent = 8, 0.1 + 0.2, 4096
    part = json.loads(json.dumps(epoch_partial(totals, first)))  # as meta.json keeps it
    resume_sums(part, resumed, rest)
    assert torch.equal(rest.totals, whole.totals)  # bit for bit: JSON keeps a float64 exactly
    assert (resumed.steps, resumed.data_wait_s, resumed.bytes_sent) == (8, 0.1 + 0.2, 4096)
    assert epoch_partial(totals)["meter"] is None  # a stage that is not the last measures no loss


def test_checkpoint_names_sort_by_age():
    names = [checkpoint_name(1), checkpoint_name(1, 30), checkpoint_name(1, 35), checkpoint_name(2),
             checkpoint_name(2, 45), checkpoint_name(10)]
    assert sorted(names) == names


def test_pipeline_strategies_take_step_checkpoints_but_not_with_ray_data():
    rtm.TrainConfig(**dict(PIPE, dataset="digits"), checkpoint_every_n_steps=EVERY)
    with pytest.raises(ValueError, match=r"checkpoint_every_n_steps=5 with ingest='ray_data': a Ray Data stream"):
        rtm.TrainConfig(strategy="pipeline", num_stages=2, dataset="parquet", data_root="/nonexistent",
                        ingest="ray_data", checkpoint_every_n_steps=5)


# ---------------------------------------------------------------------- Ray runs


def _lines(path: Path) -> list:
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


@pytest.mark.slow  # a pipeline run with a restart, the undisturbed run in this process
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [dict(strategy="pipeline"), dict(strategy="ddp_pipeline", num_workers=2,
                                                                    schedule="gpipe")],
                         ids=["pipeline", "ddp_pipeline"])  # ddp_pipeline: each replica's own partial sums
def test_a_stage_killed_mid_epoch_resumes_at_the_last_step_checkpoint_and_ends_like_an_undisturbed_run(
        ray_session, tmp_path, monkeypatch, layout):
    from raytrain_mgpu.pipeline.runner import run_pipeline

    if ray_session.cluster_resources().get("GPU", 0) < 4:
        pytest.fail("the shared ray_session must emulate at least 4 GPUs (RAYTRAIN_MGPU_EMULATE_GPUS)")
    probe = tmp_path / "probe"
    probe.mkdir()
    storage = str(tmp_path / "results")
    # The last stage dies after FAIL_AT steps, once the step checkpoint before them is complete
    # (tests/_pipe_probe.py); in this process (the references) the same model trains undisturbed.
    dies = dict(model="_pipe_probe:mlp_whose_last_stage_dies", model_kwargs={
        **PIPE["model_kwargs"], "probe": str(probe), "after_steps": FAIL_AT, "microbatches": PIPE["num_microbatches"],
        "run_dir": f"{storage}/killed", "checkpoint_step": FAIL_AT - FAIL_AT % EVERY})
    # use_gpu=True on the shared instance's emulated GPUs: these runs are also the pipeline runners' emulated
    # fits (NCCL's semantics on gloo, computed on CPU: the same numbers); was test_pipeline_nccl's own fit.
    pipe = {**PIPE, **layout, **dies, "use_gpu": True}
    killed_cfg = rtm.TrainConfig(**pipe, data_root=str(probe), checkpoint_every_n_steps=EVERY, max_failures=1,
                                 num_checkpoints_to_keep=20, storage_path=storage, name="killed")
    reporter = _Reporter()
    killed = run_pipeline(killed_cfg, reporter)
    assert (probe / "died").exists()
    # The undisturbed run, computed in this process: tests/_pipeline_reference.py does the stages' arithmetic
    # in their order, bit for bit a Ray run's (checked against one when it replaced a second run through Ray).
    want, undisturbed_history = train_pipeline(rtm.TrainConfig(**pipe))

    # The same weights, bit for bit, and the same epoch rows (the resumed epoch's sums continued).
    got = ckpt_format.load_model_state(killed.checkpoint_path)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    for key, value in train_unsplit(rtm.TrainConfig(**pipe)).items():  # and the unsplit model's, to rounding
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-5, msg=key)
    assert [(h["epoch"], h["step"], h["attempt"]) for h in killed.history] == [
        (1, STEPS_PER_EPOCH, 0), (2, 2 * STEPS_PER_EPOCH, 1)]
    assert len(undisturbed_history) == 2
    for got_row, want_row in zip(killed.history, undisturbed_history):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert math.isclose(got_row[key], want_row[key], rel_tol=1e-9), key
    replicas = layout.get("num_workers", 1)
    assert len(killed.history[-1]["peak_memory_bytes"]) == 2 * replicas  # every stage actor of every replica
    # Emulated GPUs (use_gpu=True): each stage actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES to
    # it), so it is cuda:0 there, as on a real node; that the GPUs differ shows in Ray's ids on the one node.
    last = killed.history[-1]
    assert last["devices_per_rank"] == [["cuda:0"]] * 2 * replicas and last["backend"] == "nccl"
    gpu_ids = [tuple(ids) for ids in last["gpu_ids_per_rank"]]
    assert all(len(ids) == 1 for ids in gpu_ids) and len(set(gpu_ids)) == 2 * replicas, gpu_ids

    # Resumed inside epoch 2 from the step-30 checkpoint (written by attempt 0); the next one is attempt 1's.
    run = Path(storage) / "killed"
    metas = {p.name: json.loads((p / "meta.json").read_text()) for p in run.glob("checkpoint*")}
    step30, step35 = metas["checkpoint_epoch000001_step000000030"], metas["checkpoint_epoch000001_step000000035"]
    assert (step30["attempt"], step30["step_in_epoch"], step35["attempt"]) == (0, 30 - STEPS_PER_EPOCH, 1)
    assert reporter.checkpoints[-1] == killed.checkpoint_path  # on_checkpoint once the last one is published

    # What the first stages read: the restarted ones, exactly the rest of epoch 2 after step 30, in order.
    reads = sorted((_lines(p) for p in probe.glob("indices-*.txt")), key=len, reverse=True)
    assert len(reads) == 2 * replicas and all(len(batch) == 64 // replicas for r in reads for batch in r)
    for second in reads[replicas:]:  # the resumed attempt's: each replica's share (the first attempt's file of
        resumed_at = 2 * STEPS_PER_EPOCH - len(second)  # the same replica is the one whose order matches)
        assert resumed_at == 30
        assert any(second[:len(first) - resumed_at] == first[resumed_at:] for first in reads[:replicas])
    redone = FAIL_AT - resumed_at
    print(f"killed at step {FAIL_AT}, resumed at step {resumed_at}: {redone} steps trained twice (K={EVERY})")
    assert 0 < redone < EVERY


def _stalls(caplog) -> list:
    return [r.checkpoint_stall_s for r in caplog.records if hasattr(r, "checkpoint_stall_s")]


@pytest.mark.slow  # two pipeline runs of a slow dataset: 30-60 s on 2 cores
@pytest.mark.timeout(600)
def test_the_background_upload_stalls_the_stages_only_for_the_snapshot_on_a_slow_storage(
        ray_session, tmp_path, monkeypatch, caplog):
    from raytrain_mgpu.pipeline.runner import run_pipeline

    delay = 0.4  # per part written; a step takes >= 0.2 s (slow_digits), 3 steps between saves
    cfg = rtm.TrainConfig(**dict(PIPE, dataset="_probe_data:slow_digits", epochs=1,
                                 model="_pipe_probe:mlp_on_slow_storage",
                                 model_kwargs={"widths": [32, 32], "write_delay_s": delay}),
                          checkpoint_every_n_steps=3, storage_path=str(tmp_path), name="background")
    caplog.set_level(logging.INFO, logger="raytrain_mgpu.pipeline.checkpoints")
    (row,) = run_pipeline(cfg, _Reporter()).history
    background = _stalls(caplog)
    caplog.clear()
    monkeypatch.setenv(SYNC_UPLOAD_ENV, "1")
    run_pipeline(cfg.replace(name="synchronous"), _Reporter())
    synchronous = _stalls(caplog)
    assert len(background) == len(synchronous) == STEPS_PER_EPOCH // 3 + 1  # 7 step checkpoints and the epoch's
    print(f"stall per checkpoint, {delay} s per part written, 2 stages: background median "
          f"{statistics.median(background):.3f} s (max {max(background):.3f}), synchronous median "
          f"{statistics.median(synchronous):.3f} s (max {max(synchronous):.3f})")
    print("background:", [round(s, 3) for s in background], "synchronous:", [round(s, 3) for s in synchronous])
    assert min(synchronous) >= delay
    assert statistics.median(background) < delay / 4
    # The epoch's row counts those pauses as its checkpoint time, apart from the time in steps that its
    # samples/s is of (tests/test_epoch_times.py for the Ray Train runner).
    # (Each pause the driver times around a step checkpoint holds the logged one; the epoch's own is timed
    # up to handing its history to the writer, just before the logged one ends: a little less, microseconds
    # on an idle machine, 7 ms over 8 checkpoints on a loaded CI run. Without the step checkpoints' pauses
    # the row would hold the epoch's own alone: 46-78 % of the sum in the runs seen.)
    assert 0.9 * sum(background) - 0.005 <= row["checkpoint_s"] <= sum(background) + 0.05, (row, background)
    assert row["samples_per_s"] * row["training_s"] == pytest.approx(STEPS_PER_EPOCH * 64)
    assert row["eval_s"] > 0  # the last epoch is evaluated

