"""The best checkpoint and early stopping (``monitor``, ``mode``, ``keep_best``,
``early_stopping_patience``): the rule on histories and run folders built by hand, the run folder's
transport keeping the last checkpoints and a copy of the best, then one fit through each Ray transport
(Ray Train's workers, the pipeline's actor group) that stops early and keeps the best epoch's weights.
(When an epoch is evaluated and when a run stops is the engine's, in-process: tests/test_engine.py.)"""

from __future__ import annotations

import sys

from pathlib import Path

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu import api
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.run_folder import BEST_CHECKPOINT, RunFolder
from raytrain_mgpu.engine.run_state import RunState, best_row, checkpoint_meta, stops_early


def _rows(*test_losses, key="test_loss"):
    """History rows: None = an epoch without evaluation (its test_* keys are None)."""
    rows = []
    for epoch, value in enumerate(test_losses, start=1):
        rows.append({"epoch": epoch, "train_loss": 1.0, "test_loss": value if key == "test_loss" else
                     (None if value is None else 0.5), key: value})
    return rows


# ----------------------------------------------------------------------------- the rule


def test_the_best_epoch_is_the_first_strictly_best_measured_one():
    history = _rows(0.9, None, 0.5, 0.5, 0.7)
    assert best_row(history, "test_loss", "min")["epoch"] == 3  # a tie does not take the place
    assert best_row(history, "test_loss", "max")["epoch"] == 1
    assert best_row(_rows(None, None), "test_loss", "min") is None
    assert best_row(_rows(float("nan"), 0.8, float("nan")), "test_loss", "min")["epoch"] == 2  # NaN never wins
    accuracy = _rows(0.5, 0.9, 0.8, key="test_accuracy")
    assert best_row(accuracy, "test_accuracy", "max")["epoch"] == 2


def test_patience_counts_measured_epochs_after_the_best():
    cfg = TrainConfig(monitor="test_loss", early_stopping_patience=2)
    assert not stops_early(_rows(0.9, 0.5, 0.6), cfg)
    assert stops_early(_rows(0.9, 0.5, 0.6, 0.55), cfg)  # better than 0.6, not than the best
    assert not stops_early(_rows(0.9, 0.5, 0.6, None, None), cfg)  # epochs without evaluation do not count
    assert stops_early(_rows(0.9, 0.5, float("nan"), float("nan")), cfg)  # NaN counts: it did not improve
    assert not stops_early(_rows(0.9, 0.5, 0.6, 0.4), cfg)  # improved: the count starts again
    assert not stops_early(_rows(0.9, 0.5, 0.6, 0.7), TrainConfig(monitor="test_loss"))  # no patience: never
    assert stops_early(_rows(0.9, 0.95, 0.99), TrainConfig(monitor="test_loss", mode="max",
                                                           early_stopping_patience=1)) is False
    assert stops_early(_rows(0.9, 0.85), TrainConfig(monitor="test_loss", mode="max", early_stopping_patience=1))


def test_a_monitor_missing_from_an_evaluated_row_names_the_keys():
    rows = _rows(0.9, 0.5)
    for row in rows:
        row.pop("test_accuracy", None)
    with pytest.raises(ValueError, match=r"monitor='test_accuracy' is not in the history of epoch 1 \(keys: .*test_loss"):
        best_row(rows, "test_accuracy", "max")


def test_a_run_stopped_early_is_finished_until_patience_is_raised():
    cfg = TrainConfig(monitor="test_loss", early_stopping_patience=2, epochs=10)
    state = RunState(epoch=4, step=40, history=_rows(0.9, 0.5, 0.6, 0.7))
    assert state.finished(cfg)
    assert not state.finished(cfg.replace(early_stopping_patience=3))  # trains on from epoch 5
    assert not state.finished(cfg.replace(monitor=None, early_stopping_patience=None, keep_best=False))
    meta = checkpoint_meta(cfg, state, {"input_shape": [4], "num_classes": 2})
    assert meta["stopped_early"] is True
    assert meta["best"] == {"monitor": "test_loss", "mode": "min", "epoch": 2, "value": 0.5}
    assert "best" not in checkpoint_meta(TrainConfig(), state, {})  # no monitor, no record


@pytest.mark.parametrize("changes, message", [
    (dict(keep_best=True), r"keep_best=True: needs monitor.*Set monitor, e\.g\. monitor='test_loss'"),
    (dict(early_stopping_patience=3), r"early_stopping_patience=3: needs monitor"),
    (dict(monitor="test_loss", early_stopping_patience=0), r"early_stopping_patience=0: must be a positive integer"),
    (dict(monitor="val_loss"), r"monitor='val_loss': is not a history key of this run \(train_loss, "
                               r"train_accuracy, test_loss, test_accuracy\)"),
    (dict(monitor="test_loss", mode="lowest"), r"mode='lowest': is not one of \['auto', 'min', 'max'\]"),
    (dict(monitor="test_loss", keep_best="yes"), r"keep_best='yes': must be true or false"),
    (dict(monitor="test_loss", epochs=3, eval_every_epochs=5),
     r"monitor='test_loss': is measured on evaluated epochs only, and eval_every_epochs=5 > epochs=3.*"
     r"Set eval_every_epochs to 1"),
])
def test_config_checks_name_the_field_and_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_monitor_accepts_train_keys_and_max_mode():
    cfg = TrainConfig(monitor="train_accuracy", mode="max", keep_best=True, early_stopping_patience=1,
                      epochs=3, eval_every_epochs=5)  # train_* is measured every epoch
    assert (cfg.monitor, cfg.mode, cfg.keep_best, cfg.early_stopping_patience) == ("train_accuracy", "max", True, 1)


# ----------------------------------------------------------------------------- the run folder


def _checkpoint(folder: Path, name: str, cfg: TrainConfig, history: list, weight: float = 0.0) -> Path:
    state = RunState(epoch=len(history), step=10 * len(history), history=history)
    ckpt_format.write_checkpoint(str(folder / name), meta=checkpoint_meta(cfg, state, {}), history=history,
                                 model_state={"w": torch.full((2,), weight)})
    return folder / name


def test_a_folder_transport_keeps_the_last_n_and_a_copy_of_the_best(tmp_path):
    """The pipeline's and the in-process runner's checkpoints (``checkpointing/store.FolderStore``): each
    published, all but the newest ``num_checkpoints_to_keep`` deleted, a new best's model copied aside."""
    from raytrain_mgpu.checkpointing.contents import Commit, checkpoint_name
    from raytrain_mgpu.checkpointing.store import FolderStore

    cfg = TrainConfig(monitor="test_loss", keep_best=True, num_checkpoints_to_keep=2, storage_path=str(tmp_path),
                      name="run")
    store, folder = FolderStore(cfg, 0, "attempt0"), RunFolder.of(cfg)
    losses = [0.9, 0.4, 0.6, 0.7, 0.8]
    for epoch in range(1, len(losses) + 1):
        history = _rows(*losses[:epoch])
        state = RunState(epoch=epoch, step=10 * epoch, history=history)
        name = checkpoint_name(epoch)
        directory = store.begin(name, history[-1], step=False, final=epoch == len(losses), sharded=False)
        ckpt_format.write_checkpoint(directory, meta=None, history=history,
                                     model_state={"w": torch.full((2,), float(epoch))})
        is_best = best_row(history, "test_loss", "min") is history[-1]
        store.commit(Commit(name, directory, history[-1], checkpoint_meta(cfg, state, {}), is_best, None, None,
                                False, epoch == len(losses)))
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000004", "checkpoint_epoch000005"]
    best = folder.best_checkpoint()
    assert best.name == BEST_CHECKPOINT and best.uri == str(tmp_path / "run" / BEST_CHECKPOINT)
    assert best.meta["epoch"] == 2 and sorted(p.name for p in Path(best.path).iterdir()) == [
        "history.json", "meta.json", "model.pt"]
    assert torch.equal(ckpt_format.load_model_state(best.path)["w"], torch.full((2,), 2.0))
    assert folder.newest_checkpoint().name == "checkpoint_epoch000005"  # a resume starts from the last
    assert not list((tmp_path / "run").glob(".tmp*"))


def test_the_best_is_a_copy_of_the_model_meta_and_history(tmp_path):
    cfg = TrainConfig(monitor="test_accuracy", mode="max", keep_best=True)
    history = _rows(0.5, 0.9, key="test_accuracy")
    local = _checkpoint(tmp_path / "local", "ckpt", cfg, history, weight=7.0)
    (local / "train_state.pt").write_bytes(b"not copied")
    folder = RunFolder(str(tmp_path / "run"))
    assert folder.best_checkpoint() is None  # no checkpoint yet
    copied = folder.save_best(str(local))
    assert copied.name == BEST_CHECKPOINT and sorted(p.name for p in Path(copied.path).iterdir()) == [
        "history.json", "meta.json", "model.pt"]
    # the checkpoint of a later epoch names epoch 2 as the best: the copy is found
    _checkpoint(tmp_path / "run", "checkpoint_epoch000003", cfg,
                history + _rows(0.5, 0.9, 0.8, key="test_accuracy")[2:])
    best = folder.best_checkpoint()
    assert best.name == BEST_CHECKPOINT and best.meta["epoch"] == 2
    assert torch.equal(ckpt_format.load_model_state(best.path)["w"], torch.full((2,), 7.0))
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000003"]  # never resumed from
    # a temporary copy left by a killed rank 0 is removed with the checkpoint temporaries
    (tmp_path / "run" / f".tmp-{BEST_CHECKPOINT}-0123456789ab").mkdir()
    assert folder.remove_temporaries() == [f".tmp-{BEST_CHECKPOINT}-0123456789ab"]


def test_a_copy_of_another_epoch_is_not_the_best(tmp_path):
    # killed between the copy and the report: the resumed run's best is an epoch the copy does not hold
    cfg = TrainConfig(monitor="test_loss", keep_best=True, num_checkpoints_to_keep=1)
    folder = RunFolder(str(tmp_path / "run"))
    folder.save_best(str(_checkpoint(tmp_path / "local", "ckpt", cfg, _rows(0.9, 0.3))))
    _checkpoint(tmp_path / "run", "checkpoint_epoch000003", cfg, _rows(0.9, 0.5, 0.6))
    assert folder.best_checkpoint() is None


def test_train_result_needs_keep_best_for_the_best_model(tmp_path):
    cfg = TrainConfig(model="mlp", dataset="digits", storage_path=str(tmp_path), name="r")
    result = api.TrainResult(cfg, [], None, str(tmp_path / "r"))
    assert result.best_checkpoint_path is None
    with pytest.raises(ValueError, match=r"has no best checkpoint: it is kept with keep_best=True and monitor set "
                                         r"\(monitor=None, keep_best=False\)"):
        result.load_model(best=True)


# ----------------------------------------------------------------------------- on Ray

# A test loss that falls, then rises, on every run: SGD's LR warms up to a value too high for
# this MLP (lr 0.8 reached in epoch 5), so the best epoch is an early one, never the last.
DIVERGING = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd",
                 lr=0.8, warmup_epochs=5, seed=3, epochs=6, use_gpu=False)


def _loss(model, cfg: TrainConfig, split: str) -> float:
    """``model``'s mean cross-entropy over ``cfg``'s ``split`` (``val`` or ``test``), computed here."""
    from raytrain_mgpu.data import build_datasets

    data = getattr(build_datasets(cfg.data), split)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(data, batch_size=256):
            loss_sum += torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
            count += len(y)
    return loss_sum / count


def _refuse_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run started Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(api, "connect", refuse)


def _check_stopped_early(result, patience: int, epochs: int) -> int:
    """The run stopped ``patience`` evaluated epochs after its best val_loss, before ``epochs``, and read the test
    split after that last epoch only; returns the best epoch."""
    losses = [row["val_loss"] for row in result.history]
    best_epoch = losses.index(min(losses)) + 1
    assert all(loss is not None for loss in losses)  # eval_every_epochs=1
    assert 1 < best_epoch and len(result.history) == best_epoch + patience < epochs, losses  # neither first nor last
    assert [row["test_loss"] is not None for row in result.history] == [False] * (len(losses) - 1) + [True]
    meta = ckpt_format.read_meta(result.checkpoint_path)
    assert meta["stopped_early"] is True and meta["epoch"] == len(result.history)
    assert meta["best"] == {"monitor": "val_loss", "mode": "min", "epoch": best_epoch, "value": min(losses)}
    return best_epoch


@pytest.mark.ray
@pytest.mark.slow
def test_ray_train_keeps_the_best_besides_the_last_and_stops_early(ray_session, storage, monkeypatch):
    # Early stopping and the best checkpoint chosen on a validation split held out of the training split
    cfg = rtm.TrainConfig(**DIVERGING, num_workers=2, val_fraction=0.2, monitor="val_loss", keep_best=True,
                          num_checkpoints_to_keep=1, early_stopping_patience=2, storage_path=storage, name="best-ddp")
    result = rtm.fit(cfg)
    best_epoch = _check_stopped_early(result, patience=2, epochs=cfg.epochs)
    folder = RunFolder(result.path)
    assert len(folder.checkpoints()) == 1  # Ray Train keeps the last one ...
    assert result.best_checkpoint_path == str(Path(result.path) / BEST_CHECKPOINT)  # ... and the best is a copy
    assert ckpt_format.read_meta(result.best_checkpoint_path)["epoch"] == best_epoch
    # The best model's validation loss is the best epoch's; the last model's test loss the last epoch's.
    assert _loss(result.load_model(best=True), cfg, "val") == pytest.approx(result.history[best_epoch - 1]["val_loss"],
                                                                           rel=1e-4)
    assert _loss(result.load_model(), cfg, "test") == pytest.approx(result.history[-1]["test_loss"], rel=1e-4)

    _refuse_ray(monkeypatch)  # stopped early = finished: answered from the folder
    again = rtm.fit(cfg)
    assert again.history == result.history and again.best_checkpoint_path == result.best_checkpoint_path


@pytest.mark.ray
def test_the_pipeline_stops_early_and_keeps_a_copy_of_the_best(ray_session, storage, monkeypatch, capsys):
    cfg = rtm.TrainConfig(**DIVERGING, strategy="pipeline", num_stages=2, num_microbatches=4, val_fraction=0.2,
                          monitor="val_loss", keep_best=True, num_checkpoints_to_keep=1, early_stopping_patience=2,
                          storage_path=storage, name="best-pipe")
    result = rtm.fit(cfg)
    best_epoch = _check_stopped_early(result, patience=2, epochs=cfg.epochs)
    names = [c.name for c in RunFolder(result.path).checkpoints()]
    assert names == [f"checkpoint_epoch{len(result.history):06d}"]  # the last one ...
    assert result.best_checkpoint_path == str(Path(result.path) / BEST_CHECKPOINT)  # ... and a copy of the best
    assert ckpt_format.read_meta(result.best_checkpoint_path)["epoch"] == best_epoch
    assert sorted(p.name for p in Path(result.best_checkpoint_path).iterdir()) == [
        "history.json", "meta.json", "model-stage0.pt", "model-stage1.pt"]  # every stage's part, no train state
    assert _loss(result.load_model(best=True), cfg, "val") == pytest.approx(result.history[best_epoch - 1]["val_loss"],
                                                                           rel=1e-4)
    assert _loss(result.load_model(), cfg, "test") == pytest.approx(result.history[-1]["test_loss"], rel=1e-4)

    _refuse_ray(monkeypatch)
    capsys.readouterr()
    again = rtm.fit(cfg, stream=sys.stdout)
    assert again.history == result.history and again.best_checkpoint_path == result.best_checkpoint_path
    assert "nothing to train. stopped early: val_loss did not improve for early_stopping_patience=2 evaluated " \
           "epoch(s). Raise early_stopping_patience to train it further" in capsys.readouterr().out
