"""A run started again under its name: a finished one answers from its folder, or refuses settings it
would not use; an unfinished one resumes and names what changed; ``resume="never"``/``"must"``.

All in this process (``runner="local"``, one worker, no Ray): the run folder and its checkpoints are
the ones every runner writes.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu import api
from raytrain_mgpu.cli import main
from raytrain_mgpu.driver.preflight import RUN_RECORD
from raytrain_mgpu.driver.rerun import NOT_TRAINING_FIELDS, training_changes
from raytrain_mgpu.checkpointing.run_folder import RunFolder

TINY = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", runner="local", num_workers=1,
            use_gpu=False, epochs=1, name="run")
STEPS_PER_EPOCH = 1438 // 128  # digits' training split over the default global batch


def _cfg(storage, **fields) -> rtm.TrainConfig:
    return rtm.TrainConfig(**{**TINY, "storage_path": str(storage), **fields})


def _fit(storage, stream=None, **fields) -> rtm.TrainResult:
    return rtm.fit(_cfg(storage, **fields), stream=stream or io.StringIO())


def _refuse_training(monkeypatch):
    """Any runner started fails the test: the answer must come from the folder."""
    monkeypatch.setattr(api, "carrier", lambda *a, **k: pytest.fail("a runner was started"))


def _checkpoints(storage) -> list:
    return [c.name for c in RunFolder(str(Path(storage) / "run")).checkpoints()]


def test_a_finished_run_started_with_another_lr_is_refused_naming_the_change_and_the_fix(tmp_path, monkeypatch):
    first = _fit(tmp_path, lr=0.02)
    before = _checkpoints(tmp_path)
    _refuse_training(monkeypatch)
    with pytest.raises(ValueError, match=rf"run '.*run' is already finished \(epoch 1, step {STEPS_PER_EPOCH}\), and "
                                         r"this config would train it with other settings: lr 0\.02 -> 0\.05\. .*"
                                         r"Use another `name` \(--name\) for a new run with them, or raise epochs "
                                         r"\(or max_steps\) to continue this run with the new values\."):
        _fit(tmp_path, lr=0.05)
    assert _checkpoints(tmp_path) == before and RunFolder(first.path).read_history() == first.history


def test_a_finished_run_started_with_its_own_settings_is_answered_from_its_folder(tmp_path, monkeypatch):
    first = _fit(tmp_path, monitor="test_loss", mode="min")
    _refuse_training(monkeypatch)
    stream = io.StringIO()
    # mode="auto" resolves to min for a loss, and strategy="auto" keeps the layout the run started with:
    # neither is a change against what the run recorded
    again = _fit(tmp_path, stream, monitor="test_loss", mode="auto", strategy="auto")
    assert again.history == first.history and again.checkpoint_path == first.checkpoint_path
    assert f"is already finished (epoch 1, step {STEPS_PER_EPOCH}); nothing to train." in stream.getvalue()


def test_a_finished_run_started_again_with_devices_left_auto_is_answered_from_its_folder(tmp_path, monkeypatch):
    # trained as one CPU worker; "auto" resolves to what this machine has (two CPU workers where there is no
    # GPU), which is the choice of this call, not the user's: the run's own layout stands
    first = _fit(tmp_path)
    _refuse_training(monkeypatch)
    again = _fit(tmp_path, use_gpu="auto", num_workers="auto")
    assert again.history == first.history and again.checkpoint_path == first.checkpoint_path


def test_settings_that_do_not_change_the_training_are_not_differences(tmp_path, monkeypatch):
    first = _fit(tmp_path)
    _refuse_training(monkeypatch)
    watched = dict(verbose=True, loggers=["csv"], log_every_n_steps=5, max_failures=2, stall_timeout_s=30.0,
                   num_checkpoints_to_keep=1, checkpoint_every_n_steps=4, eval_every_epochs=2, loader_workers=1,
                   collective_timeout_s=60.0, placement_timeout_s=30.0)
    for name, value in watched.items():
        assert name in NOT_TRAINING_FIELDS, name
        assert _fit(tmp_path, **{name: value}).history == first.history, name
    assert _checkpoints(tmp_path) == ["checkpoint_epoch000001"]


def test_an_unfinished_run_resumes_with_new_settings_and_says_which(tmp_path):
    _fit(tmp_path, lr=0.02)
    stream = io.StringIO()
    longer = _fit(tmp_path, stream, lr=0.05, precision="bf16-mixed", epochs=2)
    assert [row["epoch"] for row in longer.history] == [1, 2]  # resumed: epoch 1 is the first fit's
    assert [row["lr"] for row in longer.history] == pytest.approx([0.02, 0.05])
    lines = [line for line in stream.getvalue().splitlines() if "settings changed" in line]
    assert lines == [f"raytrain-mgpu: run {tmp_path / 'run'} resumes after epoch 1, step {STEPS_PER_EPOCH} with "
                     f"settings changed since its checkpoint: lr 0.02 -> 0.05, precision '32' -> 'bf16-mixed'; the "
                     f"steps from here use them."]
    # resumed with its own settings: no such line
    stream = io.StringIO()
    _fit(tmp_path, stream, lr=0.05, precision="bf16-mixed", epochs=3)
    assert "settings changed" not in stream.getvalue() and "3/3  step     33" in stream.getvalue()


def test_resume_never_refuses_a_folder_with_a_checkpoint(tmp_path, monkeypatch):
    _fit(tmp_path)
    _fit(tmp_path / "elsewhere", resume="never")  # a new folder: trains
    _refuse_training(monkeypatch)
    with pytest.raises(ValueError, match=r"TrainConfig.resume='never': run folder '.*run' already holds a checkpoint "
                                         rf"\(checkpoint_epoch000001, after epoch 1, step {STEPS_PER_EPOCH}\).*"
                                         r"Use another `name` \(--name\) for a new run, or delete that folder"):
        _fit(tmp_path, resume="never", epochs=2)  # also a run that is not finished
    assert _checkpoints(tmp_path) == ["checkpoint_epoch000001"]


def test_resume_must_refuses_a_folder_without_a_checkpoint(tmp_path, monkeypatch):
    _refuse_training(monkeypatch)
    with pytest.raises(ValueError, match=r"TrainConfig.resume='must': run folder '.*run' holds no checkpoint to "
                                         r"resume from\. Set the `name` and `storage_path` of the run to continue "
                                         r".*or resume='auto'"):
        _fit(tmp_path, resume="must")
    assert not (tmp_path / "run" / RUN_RECORD).exists()  # refused before anything was written


def test_training_changes_skip_what_was_left_auto_and_what_the_strategy_never_reads(tmp_path):
    cfg = _cfg(tmp_path, lr=0.05)
    recorded = {**cfg.to_dict(), "lr": 0.02, "num_stages": 4, "num_workers": 2, "use_gpu": True}
    # num_stages: ddp never reads it; num_workers and use_gpu: changes like lr
    assert [key for key, *_ in training_changes(cfg, recorded)] == ["num_workers", "use_gpu", "lr"]
    left_auto = _cfg(tmp_path, lr=0.05)
    vars(left_auto).update(num_workers="auto", use_gpu="auto")  # as a user leaves them: resolved by fit
    assert training_changes(left_auto, recorded) == [("lr", 0.02, 0.05)]
    # ... or already resolved from "auto" (fit resolves the devices first): named by left_auto
    assert training_changes(cfg, recorded, left_auto=("num_workers", "use_gpu")) == [("lr", 0.02, 0.05)]
    assert training_changes(cfg, {"lr": 0.05}) == []  # a record without a field: not compared
    # mode as it resolves for the monitor: a recorded "auto" ranked a loss by min
    ranked = _cfg(tmp_path, monitor="test_loss", mode="max")
    assert training_changes(ranked, {**ranked.to_dict(), "mode": "auto"}) == [("mode", "min", "max")]
    assert training_changes(ranked, {**ranked.to_dict(), "mode": "max"}) == []


def test_an_option_neither_sides_optimizer_or_schedule_reads_is_not_a_difference(tmp_path):
    adamw = _cfg(tmp_path, optimizer="adamw", momentum=0.5)
    assert training_changes(adamw, {**adamw.to_dict(), "momentum": 0.9}) == []  # adamw never reads momentum
    sgd = _cfg(tmp_path, optimizer="sgd", momentum=0.5)
    assert training_changes(sgd, {**sgd.to_dict(), "momentum": 0.9}) == [("momentum", 0.9, 0.5)]
    # a run moving from sgd to adamw: both the optimizer and its old momentum are named
    assert [key for key, *_ in training_changes(adamw, {**adamw.to_dict(), "optimizer": "sgd", "momentum": 0.9})] \
        == ["optimizer", "momentum"]
    constant = _cfg(tmp_path, lr_step_gamma=0.5)
    assert training_changes(constant, {**constant.to_dict(), "lr_step_gamma": 0.1}) == []  # read by "step" alone


def test_not_training_fields_are_fields():
    assert set(NOT_TRAINING_FIELDS) <= set(rtm.TrainConfig.field_names())
    assert len(set(NOT_TRAINING_FIELDS)) == len(NOT_TRAINING_FIELDS)


def test_the_cli_exits_2_naming_the_change(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: mlp\nmodel_kwargs: {widths: [16]}\ndataset: digits\nrunner: local\nnum_workers: 1\n"
                      "use_gpu: false\nepochs: 1\n")
    args = ["train", "--config", str(config), "--storage-path", str(tmp_path), "--name", "cli"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--lr", "0.05"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrain-mgpu: error: run ") and "lr 0.02 -> 0.05" in err and "--name" in err, err
    assert main([*args, "--resume", "never"]) == 2
    assert "TrainConfig.resume='never'" in capsys.readouterr().err


def test_resume_must_refuses_an_empty_folder_before_ray_with_strategy_auto_too(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("fit connected to Ray before refusing"))
    with pytest.raises(ValueError, match=r"TrainConfig.resume='must': run folder .* holds no checkpoint"):
        _fit(tmp_path, strategy="auto", resume="must", runner="auto")
