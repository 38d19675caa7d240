"""`raytrain-mgpu plot`: training curves from run folders (no Ray: the folders are written here
through RunFolder, with history rows built by run_state.epoch_row like the runners build them)."""

from __future__ import annotations

import json
import logging

import pytest

from raytrain_mgpu import plot
from raytrain_mgpu.cli import main
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing.files import HISTORY_FILE as CHECKPOINT_HISTORY_FILE
from raytrain_mgpu.checkpointing.files import META_FILE
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.engine.run_state import RunState, checkpoint_meta, epoch_row

STEPS_PER_EPOCH = 11


def _row(epoch: int, evaluated: bool = True, **extra) -> dict:
    """Epoch ``epoch`` (1-based) as the runners write it; the loss falls, the accuracy rises."""
    state = RunState(epoch=epoch, step=epoch * STEPS_PER_EPOCH)
    row = epoch_row(epoch=epoch - 1, state=state, lr=0.02, loss_sum=2000.0 / epoch, correct=600 + 50 * epoch,
                    samples=1000, elapsed_s=1.5, steps=STEPS_PER_EPOCH, data_wait_share=0.05,
                    peak_memory_bytes=[1 << 30, 1 << 30],
                    devices={"devices_per_rank": [["cpu"], ["cpu"]], "backend": "gloo", "gpu_ids_per_rank": [[], []]},
                    **extra)
    if evaluated:
        row.update(test_loss=1.8 / epoch, test_accuracy=0.55 + 0.05 * epoch)
    return row


def _run(tmp_path, name: str, epochs: int, **row_options) -> str:
    folder = RunFolder(str(tmp_path / name))
    folder.write_history([_row(e, **row_options) for e in range(1, epochs + 1)])
    return folder.uri


def _checkpoint(run: str, epoch: int, epochs: int, **fields) -> None:
    """A checkpoint after ``epoch`` of a run started with ``epochs`` (and ``fields``), as a runner leaves it."""
    folder = RunFolder(run)
    state = RunState(epoch=epoch, step=epoch * STEPS_PER_EPOCH, history=[_row(e) for e in range(1, epoch + 1)])
    cfg = TrainConfig(epochs=epochs, storage_path=run.rsplit("/", 1)[0], name=run.rsplit("/", 1)[1], **fields)
    tmp = folder.temporary(f"checkpoint_epoch{epoch:06d}")
    for name, value in ((CHECKPOINT_HISTORY_FILE, state.history),
                        (META_FILE, checkpoint_meta(cfg, state, {"input_shape": [1, 8, 8], "num_classes": 10}))):
        with folder.fs.open_output_stream(f"{tmp}/{name}") as f:
            f.write(json.dumps(value).encode())
    folder.publish(tmp, f"checkpoint_epoch{epoch:06d}")


def _labels(ax) -> list:
    return sorted(line.get_label() for line in ax.lines)


def test_two_runs_draw_one_line_per_run_and_split_against_epoch_and_step(tmp_path):
    runs = plot.read_runs([_run(tmp_path, "demo", 4), _run(tmp_path, "demo_dpb", 3)])
    fig = plot.draw_runs(runs)
    (loss_epoch, loss_step), (acc_epoch, acc_step) = fig.axes[:2], fig.axes[2:]
    assert _labels(loss_epoch) == _labels(loss_step) == [
        "demo test_loss", "demo train_loss", "demo_dpb test_loss", "demo_dpb train_loss"]
    assert _labels(acc_epoch) == _labels(acc_step) == [
        "demo test_accuracy", "demo train_accuracy", "demo_dpb test_accuracy", "demo_dpb train_accuracy"]
    by_label = {line.get_label(): line for line in loss_epoch.lines}
    assert list(by_label["demo train_loss"].get_xdata()) == [1, 2, 3, 4]
    assert list(by_label["demo train_loss"].get_ydata()) == pytest.approx([2.0, 1.0, 2 / 3, 0.5])
    by_label = {line.get_label(): line for line in acc_step.lines}
    assert list(by_label["demo_dpb test_accuracy"].get_xdata()) == [11, 22, 33]  # the rows' `step`
    assert by_label["demo train_accuracy"].get_color() != by_label["demo_dpb train_accuracy"].get_color()


def test_png_has_the_figure_size_and_goes_into_the_first_run(tmp_path):
    from matplotlib.image import imread

    first, second = _run(tmp_path, "a", 3), _run(tmp_path, "b", 2)
    out = plot.plot_runs([first, second])
    assert out == f"{first}/{plot.CURVES_FILE}"
    width, height = (round(v * plot.DPI) for v in plot.FIGSIZE)
    assert imread(out).shape == (height, width, 4) == (750, 1200, 4)
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_uri_run_gets_its_png_in_its_folder_and_says_where(tmp_path):
    _run(tmp_path, "remote", 2)
    out = plot.plot_runs([f"file://{tmp_path}/remote"])
    assert out == f"file://{tmp_path}/remote/curves.png"
    assert (tmp_path / "remote" / "curves.png").stat().st_size > 10_000


def test_a_column_a_run_lacks_is_skipped_with_one_log_line(tmp_path, caplog):
    with_eval = _run(tmp_path, "with_eval", 3)
    without = RunFolder(str(tmp_path / "no_eval"))  # e.g. a run whose rows never carry test_* keys
    without.write_history([{k: v for k, v in _row(e).items() if not k.startswith("test_")} for e in (1, 2)])
    with caplog.at_level(logging.WARNING, logger="raytrain_mgpu.plot"):
        fig = plot.draw_runs(plot.read_runs([with_eval, without.uri]))
    assert _labels(fig.axes[0]) == ["no_eval train_loss", "with_eval test_loss", "with_eval train_loss"]
    skipped = [r.getMessage() for r in caplog.records]
    assert skipped == ["run no_eval: no test_loss in its history, not drawn",
                       "run no_eval: no test_accuracy in its history, not drawn"]


def test_a_validation_split_draws_its_own_line_beside_train_and_test(tmp_path):
    plain = _run(tmp_path, "plain", 2)
    held_out = RunFolder(str(tmp_path / "held_out"))  # val_fraction: val_* on every epoch, test_* at the last
    held_out.write_history([{**_row(e), "val_loss": 1.0 / e, "val_accuracy": 0.5 + e / 10} for e in (1, 2)])
    fig = plot.draw_runs(plot.read_runs([plain, held_out.uri]))
    assert "held_out val_loss" in _labels(fig.axes[0]) and "held_out val_accuracy" in _labels(fig.axes[2])
    assert "plain val_loss" not in _labels(fig.axes[0])  # a run without one has no line (a log line says so)
    by_label = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(by_label["held_out val_loss"].get_ydata()) == [1.0, 0.5]


def test_metric_picks_the_lower_panels_and_an_unknown_one_names_the_columns(tmp_path):
    runs = plot.read_runs([_run(tmp_path, "a", 2), _run(tmp_path, "b", 2)])
    assert _labels(plot.draw_runs(runs, metric="lr").axes[2]) == ["a lr", "b lr"]
    assert _labels(plot.draw_runs(runs, metric="accuracy").axes[3]) == [
        "a test_accuracy", "a train_accuracy", "b test_accuracy", "b train_accuracy"]
    with pytest.raises(ValueError, match=r"metric 'bleu' is in no run's history \(a, b\); the numeric columns "
                                         r"there are: .*data_wait_share, epoch, lr, samples_per_s, step, "
                                         r"step_time_s, test_accuracy, test_loss, .*--metric"):
        plot.draw_runs(runs, metric="bleu")
    with pytest.raises(ValueError, match="metric 'backend' .* columns"):  # a column, but not a number
        plot.draw_runs(runs, metric="backend")


def test_a_folder_without_history_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"run '.*nothing' has no history yet \(no history.parquet, no checkpoint\)"):
        plot.plot_runs([str(tmp_path / "nothing")])


def test_a_running_run_is_read_from_its_newest_checkpoint(tmp_path):
    # fit writes history.parquet when it returns; until then the checkpoints carry the history,
    # and a resume that extends a finished run goes past its old history.parquet.
    run = _run(tmp_path, "resumed", 2)
    _checkpoint(run, 3, epochs=5)
    assert [row["epoch"] for row in plot.read_runs([run])["resumed"]] == [1, 2, 3]


def test_live_redraws_while_the_history_grows_until_the_run_is_finished(tmp_path, monkeypatch):
    run = str(tmp_path / "live")
    _checkpoint(run, 1, epochs=2)
    drawn, sleeps = [], []
    draw = plot.draw_runs

    def spy(runs, metric=None, _logged=None):
        fig = draw(runs, metric, _logged)
        drawn.append(len(fig.axes[0].lines[0].get_xdata()))  # points of live train_loss per epoch
        return fig

    def next_epoch(seconds):  # the run trains between two redraws: its last epoch and its history.parquet
        assert not sleeps, "slept again after the redraw that saw the run finished"
        sleeps.append(seconds)
        _checkpoint(run, 2, epochs=2)
        RunFolder(run).write_history([_row(1), _row(2)])

    monkeypatch.setattr(plot, "draw_runs", spy)
    out = plot.watch_runs([run], every_s=0.5, sleep=next_epoch)
    assert drawn == [1, 2] and sleeps == [0.5]  # stopped after the redraw that saw the run finished
    assert out == f"{run}/curves.png" and (tmp_path / "live" / "curves.png").exists()
    with pytest.raises(ValueError, match="every_s=0: .* > 0"):
        plot.watch_runs([run], every_s=0)


def test_live_stops_on_ctrl_c_and_keeps_the_last_png(tmp_path):
    run = str(tmp_path / "stuck")
    _checkpoint(run, 1, epochs=5)  # never finishes

    def interrupt(seconds):
        raise KeyboardInterrupt

    assert plot.watch_runs([run], every_s=1, sleep=interrupt) == f"{run}/curves.png"
    assert (tmp_path / "stuck" / "curves.png").exists()


def test_cli_plot_writes_the_png(tmp_path, capsys):
    first, second = _run(tmp_path, "a", 2), _run(tmp_path, "b", 2)
    out = tmp_path / "pictures" / "curves.png"
    assert main(["plot", first, second, "--out", str(out), "--metric", "samples_per_s"]) == 0
    assert out.stat().st_size > 10_000 and f"curves: {out}" in capsys.readouterr().out
    assert main(["plot", first, "--metric", "nope"]) == 2
    assert "raytrain-mgpu: error: metric 'nope' is in no run's history (a)" in capsys.readouterr().err


def test_live_sees_a_run_stopped_early_as_finished(tmp_path):
    from raytrain_mgpu.plot import _finished

    run = str(tmp_path / "stopped")
    # test_loss falls every epoch, so with mode="max" epoch 1 stays best: patience 1 stops after epoch 2
    _checkpoint(run, 2, 5, monitor="test_loss", mode="max", early_stopping_patience=1)
    assert _finished(run)
    _checkpoint(str(tmp_path / "going"), 2, 5, monitor="test_loss", mode="min", early_stopping_patience=1)
    assert not _finished(str(tmp_path / "going"))  # still improving: 3 of 5 epochs to go
