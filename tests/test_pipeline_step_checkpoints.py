"""The pipeline's step checkpoints: written by the engine's saver on every stage actor and published in the run
folder by its store (``checkpointing/contents.py``, ``checkpointing/store.FolderStore``).

Unit tests: a checkpoint is published only once every rank's part is in, ``meta.json`` last (until then it
is no resume point); a failed write raises at the save and publishes nothing; every rank's partial epoch sums
survive the train state exactly, each rank resuming its own; the names sort by age.

Ray run (the shared instance, its emulated GPUs): a ``ddp_pipeline`` of 2 replicas (GPipe) whose last stage
dies in the middle of epoch 2 resumes at the last step checkpoint, inside the epoch, on the epoch's own sample
order, and ends with the weights and epoch rows of an undisturbed run computed in this process
(``tests/_pipeline_reference.py``), each stage actor on its own GPU. The plain ``pipeline``'s killed run, with
its step checkpoints, is ``tests/test_pipeline_ray.py``'s.

The pipeline's earlier background upload (and its stall test) is gone: a checkpoint is written synchronously,
as every transport writes it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.contents import PARTIALS, Commit, checkpoint_name
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.engine.run_state import RunState, checkpoint_meta
from raytrain_mgpu.checkpointing.store import FolderStore
from _pipeline_reference import train_pipeline, train_unsplit

PIPE = dict(model="mlp", model_kwargs={"widths": [32, 32]}, dataset="_pipe_probe:digits", strategy="pipeline",
            num_stages=2, num_microbatches=4, schedule="1f1b", batch_size=64, optimizer="sgd", lr=0.1, seed=3,
            epochs=2)  # no BatchNorm or dropout: runs that see the same batches agree exactly
STEPS_PER_EPOCH = 1438 // 64   # 22: digits' train split at batch 64
EVERY = 5                      # step checkpoints at global steps 5, 10, 15, 20, 25, 30, 35, 40
FAIL_AT = 33                   # the last stage dies at the start of global step 33 (epoch 2's 12th step)
CPU = torch.device("cpu")


class _Reporter:
    """A run's events as ``fit``'s ``RunEvents`` gets them (the checkpoints announced, the driver's lines)."""

    def __init__(self):
        self.checkpoints, self.banners = [], []

    def checkpoint(self, path):
        self.checkpoints.append(path)

    def banner(self, line):
        self.banners.append(line)

    def epoch(self, metrics):
        pass

    def step(self, step, total, epoch=0):
        pass

    def scalars(self, step, values):
        pass


# ---------------------------------------------------------------------- unit tests


def test_a_step_checkpoint_is_no_resume_point_until_every_part_is_written_then_meta_json_last(tmp_path, monkeypatch):
    """Two ranks (threads) of one attempt write their parts into one temporary folder; rank 0 publishes it once
    both are in (the barrier), ``meta.json`` written last."""
    cfg = rtm.TrainConfig(**dict(PIPE, dataset="digits"), storage_path=str(tmp_path), name="run",
                          checkpoint_every_n_steps=EVERY, num_checkpoints_to_keep=5)
    barrier, reporter, folder = threading.Barrier(2, timeout=30), _Reporter(), RunFolder.of(cfg)
    ranks = [FolderStore(cfg, 0, "attempt0", reporter, barrier=barrier.wait),
             FolderStore(cfg, 1, "attempt0", barrier=barrier.wait)]
    present_at_meta = []
    write = ckpt_format.write_checkpoint

    def recording(directory, **kwargs):
        if kwargs.get("meta") is not None:
            present_at_meta.append(sorted(p.name for p in Path(directory).iterdir()))
        return write(directory, **kwargs)

    monkeypatch.setattr(ckpt_format, "write_checkpoint", recording)
    name = checkpoint_name(1, 30)
    state = RunState(epoch=1, step=30, step_in_epoch=8, history=[{"epoch": 1, "step": 22}])
    meta = checkpoint_meta(cfg, state, {"input_shape": [1, 8, 8], "num_classes": 10}, step_in_epoch=8, partition=[3, 1])
    directories = [rank.begin(name, {"step": 30}, step=True, final=False, sharded=False) for rank in ranks]
    assert directories[0] == directories[1] and Path(directories[0]).name == f".tmp-{name}-attempt0"
    ckpt_format.write_files(directories[1], {"model-stage1.pt": {"w1": torch.ones(2)}, "train_state-stage1.pt": {}})
    rank1 = threading.Thread(target=ranks[1].commit, args=(Commit(name, directories[1], {}, None, False, None, None,
                                                                  True, False),))
    rank1.start()  # its part is in: it waits for rank 0's at the barrier
    ckpt_format.write_files(directories[0], {"model-stage0.pt": {"w0": torch.ones(2)}, "train_state-stage0.pt": {},
                                             "train_state.pt": {PARTIALS: [None, None]}})
    write(directories[0], meta=None, history=state.history)
    deadline = time.monotonic() + 10
    while barrier.n_waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Every part is written, nobody has committed all of it: no meta.json, so a resume starts fresh, not from it.
    assert barrier.n_waiting == 1 and rank1.is_alive()
    assert folder.state().checkpoint is None and folder.checkpoints() == []
    assert present_at_meta == [] and reporter.checkpoints == []
    ranks[0].commit(Commit(name, directories[0], {}, meta, False, None, None, True, False))
    rank1.join(timeout=10)
    assert present_at_meta == [["history.json", "model-stage0.pt", "model-stage1.pt", "train_state-stage0.pt",
                                "train_state-stage1.pt", "train_state.pt"]]  # every part before meta.json
    path = str(tmp_path / "run" / name)
    assert reporter.checkpoints == [path] and not Path(directories[0]).exists()  # renamed into place
    resumed = folder.state()
    assert (resumed.epoch, resumed.step, resumed.step_in_epoch, resumed.checkpoint) == (1, 30, 8, path)
    assert resumed.meta["partition"] == [3, 1] and resumed.meta["published"] is True
    assert set(ckpt_format.load_model_state(path)) == {"w0", "w1"}  # the stages' parts make the model


def test_a_failed_write_raises_at_the_save_and_publishes_nothing(tmp_path, monkeypatch):
    """Written synchronously by the engine's saver: the save itself fails, nothing is published, and the next
    attempt removes the half-written folder."""
    from _engine import make_engine

    threads = torch.get_num_threads()
    try:
        engine = make_engine(dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64,
                                  checkpoint_every_n_steps=EVERY), storage=str(tmp_path))
    finally:
        torch.set_num_threads(threads)

    def refused(directory, files):
        Path(directory, "model.pt").write_bytes(b"half")
        raise OSError("the storage refused model.pt")

    monkeypatch.setattr(ckpt_format, "write_files", refused)
    engine.state.step = engine.state.step_in_epoch = EVERY
    with pytest.raises(OSError, match=rf"writing checkpoint {checkpoint_name(0, EVERY)} into .* failed \(the storage "
                                      r"refused model.pt\); the previous checkpoint is intact"):
        engine.checkpoints.saver.save({"epoch": 0, "step": EVERY, "step_in_epoch": EVERY}, partial={"totals": torch.zeros(4)})
    folder = RunFolder.of(engine.cfg)
    assert folder.checkpoints() == [] and folder.state().checkpoint is None
    assert folder.remove_temporaries() == [f".tmp-{checkpoint_name(0, EVERY)}-test"]


def test_every_ranks_partial_epoch_sums_survive_the_train_state_exactly_and_each_rank_resumes_its_own(tmp_path):
    """2 stages x 2 replicas: the last stages (ranks 1 and 3) measure their replica's loss and metrics; a step
    checkpoint keeps every rank's sums in ``train_state.pt``, in rank order, and a rank resumes its own."""
    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.engine.loop import _own_partials
    from raytrain_mgpu.engine.metrics import EpochMeter

    generator = torch.Generator().manual_seed(0)
    batches = {rank: [(torch.randn(n, 10, generator=generator), torch.randint(0, 10, (n,), generator=generator))
                      for n in (4, 6, 5)] for rank in (1, 3)}
    whole, first, rest = ({rank: EpochMeter(CPU, Objective()) for rank in range(4)} for _ in range(3))
    for rank, replica_batches in batches.items():
        for i, (outputs, y) in enumerate(replica_batches):
            loss = torch.nn.functional.cross_entropy(outputs, y)
            whole[rank].add(loss, outputs, y)
            (first if i == 0 else rest)[rank].add(loss, outputs, y)
    for rank in range(4):
        first[rank].data_wait_s, first[rank].checkpoint_s = 0.1 * rank + 0.2, 0.3
    ckpt_format.write_files(str(tmp_path), {"train_state.pt": {PARTIALS: [first[rank].partial() for rank in range(4)]}})
    saved = ckpt_format.load_train_state(str(tmp_path))[PARTIALS]  # weights_only, as a resume reads it
    for rank in range(4):
        resumed = EpochMeter(CPU, Objective())
        resumed.resume(_own_partials(saved, SimpleNamespace(world_rank=rank, world_size=4)))
        for outputs, y in batches.get(rank, [])[1:]:
            resumed.add(torch.nn.functional.cross_entropy(outputs, y), outputs, y)
        assert torch.equal(resumed.totals, whole[rank].totals), rank  # bit for bit, this rank's own
        assert (resumed.data_wait_s, resumed.checkpoint_s) == (0.1 * rank + 0.2, 0.3)
    assert [int(part["totals"][2]) for part in saved] == [0, 4, 0, 4]  # samples: only the last stages count


def test_checkpoint_names_sort_by_age():
    names = [checkpoint_name(1), checkpoint_name(1, 30), checkpoint_name(1, 35), checkpoint_name(2),
             checkpoint_name(2, 45), checkpoint_name(10)]
    assert sorted(names) == names


def test_pipeline_strategies_take_step_checkpoints_also_with_ray_data():
    rtm.TrainConfig(**dict(PIPE, dataset="digits"), checkpoint_every_n_steps=EVERY)
    rtm.TrainConfig(strategy="pipeline", num_stages=2, dataset="parquet", data_root="/nonexistent",
                    ingest="ray_data", checkpoint_every_n_steps=5)  # the stream resumes at its step (engine/stream.py)


# ---------------------------------------------------------------------- Ray run


def _lines(path: Path) -> list:
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


@pytest.mark.slow  # a pipeline run of 2 replicas with a restart, the undisturbed run in this process
@pytest.mark.timeout(600)
def test_a_stage_killed_mid_epoch_resumes_at_the_last_step_checkpoint_and_ends_like_an_undisturbed_run(
        ray_session, tmp_path):
    from raytrain_mgpu.transports.actor_group.runner import run_pipeline

    if ray_session.cluster_resources().get("GPU", 0) < 4:
        pytest.fail("the shared ray_session must emulate at least 4 GPUs (RAYTRAIN_MGPU_EMULATE_GPUS)")
    replicas = 2  # ddp_pipeline: each replica's own share of the epoch and its own partial sums
    probe = tmp_path / "probe"
    probe.mkdir()
    storage = str(tmp_path / "results")
    # A last stage dies after FAIL_AT steps (one replica's: once per probe dir), once the step checkpoint before
    # them is complete (tests/_pipe_probe.py); in this process (the references) the same model trains undisturbed.
    dies = dict(model="_pipe_probe:mlp_whose_last_stage_dies", model_kwargs={
        **PIPE["model_kwargs"], "probe": str(probe), "after_steps": FAIL_AT, "microbatches": PIPE["num_microbatches"],
        "run_dir": f"{storage}/killed", "checkpoint_step": FAIL_AT - FAIL_AT % EVERY})
    # use_gpu=True on the shared instance's emulated GPUs: this run is also the pipeline runner's emulated
    # fit (NCCL's semantics on gloo, computed on CPU: the same numbers); was test_pipeline_nccl's own fit.
    pipe = {**PIPE, "strategy": "ddp_pipeline", "num_workers": replicas, "schedule": "gpipe", **dies, "use_gpu": True}
    killed_cfg = rtm.TrainConfig(**pipe, data_root=str(probe), checkpoint_every_n_steps=EVERY, max_failures=1,
                                 num_checkpoints_to_keep=20, storage_path=storage, name="killed")
    reporter = _Reporter()
    killed = run_pipeline(killed_cfg, None, reporter)
    assert (probe / "died").exists()
    # The undisturbed run, computed in this process: tests/_pipeline_reference.py does the stages' arithmetic
    # in their order, bit for bit a Ray run's.
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
    assert len(killed.history[-1]["peak_memory_bytes"]) == 2 * replicas  # every stage actor of every replica
    # The epoch's row: its samples/s is of the time in steps; the step checkpoints' pauses and the epoch's own
    # are its checkpoint time, the evaluation its eval time.
    first_row = killed.history[0]
    assert first_row["samples_per_s"] * first_row["training_s"] == pytest.approx(STEPS_PER_EPOCH * 64)
    assert first_row["checkpoint_s"] > 0 and first_row["eval_s"] > 0
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
    assert "resuming at step 30 (8/22 steps of epoch 2 done)" in reporter.banners, reporter.banners
    # Its train state holds every rank's sums of epoch 2 so far, in rank order: each replica's last stage
    # (global ranks 1 and 3) counted its replica's 8 steps x 32 rows; the first stages count none.
    partials = ckpt_format.load_train_state(str(run / "checkpoint_epoch000001_step000000030"))[PARTIALS]
    assert [int(part["totals"][2]) for part in partials] == [0, 8 * 32, 0, 8 * 32]
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
