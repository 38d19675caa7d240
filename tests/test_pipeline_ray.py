"""The pipeline actor group on the shared Ray instance: train, checkpoint, resume, restart.

Few runs on purpose: each actor group costs seconds to start on a small machine. One run, read by two
tests, trains on a storage URI, is killed and restarted, then resumed through ``fit``; its first stage
reads with a loader worker and a seeded user transform (it must still train the weights of one process
reading without workers). ``ddp_pipeline`` restarting after a stage dies is
``tests/test_pipeline_step_checkpoints.py``'s killed ``[ddp_pipeline]`` run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raytrain_mgpu.runtime.checkpoint import load_model_state, read_meta
from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.models import build_model
from raytrain_mgpu.pipeline.runner import run_pipeline
from _pipeline_reference import train_unsplit

pytestmark = pytest.mark.ray

MLP = dict(model="mlp", dataset="synthetic", input_shape=[12], num_classes=5, num_samples=72,
           model_kwargs={"widths": [24, 24, 24]}, batch_size=24, num_microbatches=4, optimizer="sgd", lr=0.1,
           seed=5)  # 3 steps per epoch
EPOCH_KEYS = {"epoch", "step", "lr", "train_loss", "test_loss", "test_accuracy", "samples_per_s", "step_time_s",
              "data_wait_share", "peak_memory_bytes", "attempt", "stage_step_time_s", "bubble_fraction",
              "ideal_bubble_fraction", "bytes_between_stages_per_step", "partition"}


class Reporter:
    def __init__(self):
        self.epochs, self.steps = [], []

    def epoch(self, metrics):
        self.epochs.append(metrics)

    def step(self, step, total, epoch=0):
        self.steps.append((step, total, epoch))


def assert_same_weights(path: str, cfg: TrainConfig) -> None:
    """The run's checkpoint against the unsplit model trained in this process for ``cfg.epochs``
    (micro-batches sum in another order: close, not equal)."""
    model = build_model(cfg.model, tuple(cfg.input_shape), cfg.num_classes, cfg.model_kwargs)
    model.load_state_dict(load_model_state(path))  # strict: the stage parts make the whole model
    for key, value in train_unsplit(cfg).items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """One pipeline run read by the two tests below (each run through Ray costs an actor group's start-up):
    2 epochs through ``run_pipeline`` on a ``file://`` storage URI, its first stage reading with a loader
    worker and a seeded user transform, its last stage killed at the second step of epoch 2 (the restart
    resumes from the URI); then the same name resumed to 3 epochs through ``fit``.

    file:// goes through pyarrow.fs.FileSystem.from_uri, as s3:// and gs:// do: the stage actors write
    their parts and the driver its meta through the run folder's filesystem.
    """
    import raytrain_mgpu as rtm

    root = tmp_path_factory.mktemp("pipe")
    (root / "probe").mkdir()
    # The last stage dies at the second step of epoch 2 (after 4 steps), once epoch 1's checkpoint (step 3) is
    # complete (tests/_pipe_probe.py: the MLP and a parameter-free last block; inactive outside Ray actors).
    dies = dict(model="_pipe_probe:mlp_whose_last_stage_dies", model_kwargs={
        **MLP["model_kwargs"], "probe": str(root / "probe"), "after_steps": 4, "microbatches": MLP["num_microbatches"],
        "run_dir": f"{root}/results/pipe", "checkpoint_step": 3})
    cfg = TrainConfig(**{**MLP, **dies}, strategy="pipeline", num_stages=2, schedule="1f1b", epochs=2, max_failures=1,
                      storage_path=f"file://{root}/results", name="pipe", loader_workers=1,
                      train_transform="test_transforms:noise")
    reporter = Reporter()
    first = run_pipeline(cfg, reporter)
    assert (root / "probe" / "died").exists()
    longer = cfg.replace(epochs=3)
    resumed = rtm.fit(longer)  # the same name and storage: resumes after epoch 2 with the optimizer state
    return SimpleNamespace(cfg=cfg, reporter=reporter, first=first, longer=longer, resumed=resumed,
                           root=root, run=root / "results" / "pipe")


def test_pipeline_trains_checkpoints_and_resumes(runs):
    outcome, reporter = runs.first, runs.reporter
    assert [m["epoch"] for m in outcome.history] == [1, 2] and reporter.epochs == outcome.history
    metrics = outcome.history[-1]
    assert EPOCH_KEYS <= metrics.keys()
    assert metrics["step"] == 6 and reporter.steps[-1] == (3, 3, 2)
    # The MLP's 5 blocks split 3 + 2 by parameters; the fixture's parameter-free last block joins the last stage.
    assert metrics["partition"] == [3, 3] and len(metrics["peak_memory_bytes"]) == 2
    assert metrics["ideal_bubble_fraction"] == pytest.approx(1 / 5)
    assert 0 <= metrics["bubble_fraction"] < 1 and metrics["test_accuracy"] is not None
    # 4 micro-batches x 6 rows x 24 floats x 4 bytes, forward and back, per step
    assert metrics["bytes_between_stages_per_step"] == 2 * 4 * 6 * 24 * 4
    assert outcome.checkpoint_path == f"file://{runs.run}/checkpoint_epoch000002"
    folder = runs.run / "checkpoint_epoch000002"  # kept after the resume (num_checkpoints_to_keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "history.json", "meta.json", "model-stage0.pt", "model-stage1.pt", "train_state-stage0.pt",
        "train_state-stage1.pt"]
    assert not list(folder.parent.glob(".tmp*"))
    meta = read_meta(str(folder))
    assert meta["partition"] == [3, 3] and meta["input_shape"] == [12] and meta["num_classes"] == 5
    assert_same_weights(str(folder), runs.cfg)

    # resumed after epoch 2 with the optimizer state (attempt 1 was the restart after the kill)
    assert [m["epoch"] for m in runs.resumed.history] == [1, 2, 3]
    assert [m["attempt"] for m in runs.resumed.history] == [0, 1, 2]
    assert_same_weights(str(runs.run / "checkpoint_epoch000003"), runs.longer)


def test_pipeline_checkpoints_to_a_storage_uri_and_resumes_from_it(runs, monkeypatch, capsys):
    import raytrain_mgpu as rtm
    from raytrain_mgpu import api

    assert [m["attempt"] for m in runs.first.history] == [0, 1]  # epoch 2 ran again, restored from the URI
    result = runs.resumed
    assert result.checkpoint_path == f"file://{runs.root}/results/pipe/checkpoint_epoch000003"
    assert sorted(p.name for p in runs.run.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_epoch000002", "checkpoint_epoch000003", "history.parquet", "run.json"]
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
        run_pipeline(cfg, Reporter())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-stage pipeline needs 2 CUDA GPUs (one per stage)")
def test_pipeline_on_gpus(ray_session, storage):
    cfg = TrainConfig(**MLP, strategy="pipeline", num_stages=2, use_gpu=True, epochs=1, storage_path=storage)
    outcome = run_pipeline(cfg, Reporter())
    assert all(peak > 0 for peak in outcome.history[-1]["peak_memory_bytes"])
