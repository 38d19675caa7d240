"""The pipeline actor group on the shared Ray instance: train, step checkpoints, a restart, resume.

Few runs on purpose: each actor group costs seconds to start on a small machine. One run, read by the tests
below, trains on a storage URI with step checkpoints; its last stage is killed inside epoch 2, the group
restarts from the step checkpoint, inside the epoch, and the run ends with the weights and epoch rows of an
undisturbed run computed in this process (``tests/_pipeline_reference.py``); then the same name is resumed
through ``fit``. Its first stage reads with a loader worker and a seeded user transform (it must still train
the weights of one process reading without workers). ``ddp_pipeline`` restarting after a stage dies (each
replica's share, the order it reads, emulated GPUs) is ``tests/test_pipeline_step_checkpoints.py``'s run.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from raytrain_mgpu.checkpointing.files import load_model_state, load_train_state, read_meta
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.models import build_model
from raytrain_mgpu.transports.actor_group.runner import run_pipeline
from raytrain_mgpu.checkpointing.contents import PARTIALS
from _pipeline_reference import train_pipeline, train_unsplit

pytestmark = pytest.mark.ray

MLP = dict(model="mlp", dataset="synthetic", input_shape=[12], num_classes=5, num_samples=72,
           model_kwargs={"widths": [24, 24, 24]}, batch_size=24, num_microbatches=4, optimizer="sgd", lr=0.1,
           seed=5, use_gpu=False, num_workers=1)  # 3 steps per epoch
EVERY = 2  # step checkpoints after global steps 2 and 4 (3 and 6 end an epoch: the epoch's own is written)
EPOCH_KEYS = {"epoch", "step", "lr", "train_loss", "test_loss", "test_accuracy", "samples_per_s", "step_time_s",
              "data_wait_share", "peak_memory_bytes", "attempt", "stage_step_time_s", "bubble_fraction",
              "ideal_bubble_fraction", "bytes_between_stages_per_step", "partition"}


class Reporter:
    """What ``fit``'s ``RunEvents`` gets from the run (the pipeline's driver pumps every rank's events into it)."""

    def __init__(self):
        self.epochs, self.steps, self.checkpoints, self.banners = [], [], [], []

    def epoch(self, metrics):
        self.epochs.append(metrics)

    def step(self, step, total, epoch=0):
        self.steps.append((step, total, epoch))

    def checkpoint(self, path):
        self.checkpoints.append(path)

    def banner(self, line):
        self.banners.append(line)

    def scalars(self, step, values):
        pass


def assert_same_weights(path: str, cfg: TrainConfig) -> None:
    """The run's checkpoint against the pipeline's arithmetic done in this process, reading without loader
    workers (bit for bit), and against the unsplit model (micro-batches sum in another order: close)."""
    model = build_model(cfg.model, tuple(cfg.input_shape), cfg.num_classes, cfg.model_kwargs)
    model.load_state_dict(load_model_state(path))  # strict: the stage parts make the whole model
    got = model.state_dict()
    want, _ = train_pipeline(cfg.replace(loader_workers=0))
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    for key, value in train_unsplit(cfg).items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """One pipeline run read by the tests below (each run through Ray costs an actor group's start-up):
    2 epochs through ``run_pipeline`` on a ``file://`` storage URI with a step checkpoint every 2 steps, its
    first stage reading with a loader worker and a seeded user transform, its last stage killed at the second
    step of epoch 2 (the restart resumes from the URI, at the step checkpoint after step 4); then the same name
    resumed to 3 epochs through ``fit`` (without step checkpoints).

    file:// goes through pyarrow.fs.FileSystem.from_uri, as s3:// and gs:// do: the stage actors write
    their parts, and rank 0 the meta, through the run folder's filesystem.
    """
    import raytrain_mgpu as rtm

    root = tmp_path_factory.mktemp("pipe")
    (root / "probe").mkdir()
    # The last stage dies at the second step of epoch 2 (after 4 steps), once the step checkpoint of step 4 is
    # complete (tests/_pipe_probe.py: the MLP and a parameter-free last block; inactive outside Ray actors).
    dies = dict(model="_pipe_probe:mlp_whose_last_stage_dies", model_kwargs={
        **MLP["model_kwargs"], "probe": str(root / "probe"), "after_steps": 4, "microbatches": MLP["num_microbatches"],
        "run_dir": f"{root}/results/pipe", "checkpoint_step": 4})
    cfg = TrainConfig(**{**MLP, **dies}, strategy="pipeline", num_stages=2, schedule="1f1b", epochs=2, max_failures=1,
                      storage_path=f"file://{root}/results", name="pipe", loader_workers=1,
                      train_transform="test_transforms:noise", checkpoint_every_n_steps=EVERY)
    reporter = Reporter()
    first = run_pipeline(cfg, None, reporter)
    assert (root / "probe" / "died").exists()
    run = root / "results" / "pipe"
    # what the first run left (num_checkpoints_to_keep=2: the resume below prunes the step checkpoint)
    kept = {p.name: (json.loads((p / "meta.json").read_text()), load_train_state(str(p)))
            for p in run.glob("checkpoint*")}
    longer = cfg.replace(epochs=3, checkpoint_every_n_steps=None)
    resumed = rtm.fit(longer)  # the same name and storage: resumes after epoch 2 with the optimizer state
    return SimpleNamespace(cfg=cfg, reporter=reporter, first=first, kept=kept, longer=longer, resumed=resumed,
                           root=root, run=run)


def test_pipeline_trains_checkpoints_and_resumes(runs):
    outcome, reporter = runs.first, runs.reporter
    assert [m["epoch"] for m in outcome.history] == [1, 2] and reporter.epochs == outcome.history
    metrics = outcome.history[-1]
    assert EPOCH_KEYS <= metrics.keys()
    # the progress line's steps (rank 0 sends at most one every 0.5 s): of 3 an epoch, up to epoch 2
    assert metrics["step"] == 6 and reporter.steps[-1][1:] == (3, 2)
    assert all(1 <= step <= total == 3 for step, total, _ in reporter.steps)
    # The MLP's 5 blocks split 3 + 2 by parameters; the fixture's parameter-free last block joins the last stage.
    assert metrics["partition"] == [3, 3] and len(metrics["peak_memory_bytes"]) == 2
    assert metrics["ideal_bubble_fraction"] == pytest.approx(1 / 5)
    assert 0 <= metrics["bubble_fraction"] < 1 and metrics["test_accuracy"] is not None
    # 4 micro-batches x 6 rows x 24 floats x 4 bytes, forward and back, per step
    assert metrics["bytes_between_stages_per_step"] == 2 * 4 * 6 * 24 * 4
    assert outcome.checkpoint_path == f"file://{runs.run}/checkpoint_epoch000002"
    assert outcome.startup and outcome.startup["first_step"] >= outcome.startup["entered"]  # rank 0's start-up
    folder = runs.run / "checkpoint_epoch000002"  # kept after the resume (num_checkpoints_to_keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "history.json", "meta.json", "model-stage0.pt", "model-stage1.pt", "train_state-stage0.pt",
        "train_state-stage1.pt", "train_state.pt"]  # the stages' parts and the run's common train state
    assert not list(folder.parent.glob(".tmp*"))
    meta = read_meta(str(folder))
    assert meta["partition"] == [3, 3] and meta["input_shape"] == [12] and meta["num_classes"] == 5
    assert_same_weights(str(folder), runs.cfg)

    # resumed after epoch 2 with the optimizer state (attempt 1 was the restart after the kill)
    assert [m["epoch"] for m in runs.resumed.history] == [1, 2, 3]
    assert [m["attempt"] for m in runs.resumed.history] == [0, 1, 2]
    assert_same_weights(str(runs.run / "checkpoint_epoch000003"), runs.longer)
    assert {"worker_group_s", "setup_s", "first_step_s"} <= runs.resumed.startup.keys()


def test_a_stage_killed_mid_epoch_resumes_at_the_step_checkpoint_and_continues_the_epochs_sums(runs):
    # The restart resumed inside epoch 2 from the step checkpoint attempt 0 wrote after step 4 (its
    # first step): one step trained twice, not the whole epoch.
    meta, train_state = runs.kept["checkpoint_epoch000001_step000000004"]
    assert (meta["epoch"], meta["step"], meta["step_in_epoch"], meta["attempt"]) == (1, 4, 1, 0)
    assert "resuming at step 4 (1/3 steps of epoch 2 done)" in runs.reporter.banners, runs.reporter.banners
    # every rank's sums of epoch 2 so far: the last stage counted its step's 24 targets, the first stage none
    assert [int(part["totals"][2]) for part in train_state[PARTIALS]] == [0, 24]
    assert sorted(runs.kept) == ["checkpoint_epoch000001_step000000004", "checkpoint_epoch000002"]
    # The epoch rows of an undisturbed run: epoch 2's sums went on from the step checkpoint's.
    _, undisturbed = train_pipeline(runs.cfg.replace(loader_workers=0))
    for got_row, want_row in zip(runs.first.history, undisturbed, strict=True):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert math.isclose(got_row[key], want_row[key], rel_tol=1e-9), key
    assert runs.reporter.checkpoints[-1] == runs.first.checkpoint_path  # announced once published


def test_pipeline_checkpoints_to_a_storage_uri_and_resumes_from_it(runs, monkeypatch, capsys):
    import raytrain_mgpu as rtm
    from raytrain_mgpu import api

    assert [m["attempt"] for m in runs.first.history] == [0, 1]  # epoch 2 ran again, restored from the URI
    result = runs.resumed
    assert result.checkpoint_path == f"file://{runs.root}/results/pipe/checkpoint_epoch000003"
    assert sorted(p.name for p in runs.run.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_epoch000002", "checkpoint_epoch000003", "goodput.json", "history.parquet", "run.json"]
    model = result.load_model()  # from the URI
    assert set(model.state_dict()) == set(load_model_state(str(runs.run / "checkpoint_epoch000003")))

    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("a finished run started Ray"))
    again = rtm.fit(runs.longer)
    assert again.history == result.history and again.checkpoint_path == result.checkpoint_path
    assert "is already finished (epoch 3, step 9)" in capsys.readouterr().out


def test_not_enough_cpus_for_the_stages_names_the_cluster(ray_session, storage):
    cfg = TrainConfig(**MLP, strategy="pipeline", num_stages=6, schedule="gpipe", storage_path=storage)
    with pytest.raises(ValueError, match=r"strategy='pipeline' needs 6 CPU \(1 per stage actor x 1 replica\(s\) x "
                                         r"num_stages=6\), but the Ray cluster has 4 CPU. Lower num_stages"):
        run_pipeline(cfg, None, Reporter())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-stage pipeline needs 2 CUDA GPUs (one per stage)")
def test_pipeline_on_gpus(ray_session, storage):
    cfg = TrainConfig(**{**MLP, "use_gpu": True}, strategy="pipeline", num_stages=2, epochs=1, storage_path=storage)
    outcome = run_pipeline(cfg, None, Reporter())
    assert all(peak > 0 for peak in outcome.history[-1]["peak_memory_bytes"])
