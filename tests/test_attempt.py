"""The one attempt driver (``transports/attempt.py``), with stand-in carriers in this process (no Ray): the result
read one way from the run folder, the cleanup before every attempt, a callback's error, the failure made whole.
Its preemption budget: tests/test_preemption.py; its carriers through Ray: tests/test_fit.py,
tests/test_pipeline_faults.py, tests/test_goodput.py."""

from __future__ import annotations

import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.transports.attempt import Carrier, drive
from raytrain_mgpu.transports.retry import Verdict


class Printer:
    """Stands in for ``fit``'s ``RunEvents``: the epoch rows it was given."""

    def __init__(self):
        self.rows = []

    def epoch(self, row: dict) -> None:
        self.rows.append(row)


class Rows(Carrier):
    """Rank 0 in this process: each attempt reports ``rows`` (an attempt before the last fails after its rows)."""

    in_process, what = True, "test attempt"

    def __init__(self, cfg, events, rows, failures: int = 0, latest=...):
        super().__init__(cfg, None, events)
        self.rows, self.failures, self.registered, self.attempts = rows, failures, latest, []

    def start(self, sink, attempt: int) -> None:
        self.sink = sink
        self.attempts.append(attempt)

    def wait(self) -> None:
        for row in self.rows:
            self.sink.put.remote("epoch", row)
        if len(self.attempts) <= self.failures:
            raise ConnectionResetError("connection reset by peer")

    def judge(self, exc: BaseException) -> Verdict:
        return Verdict(True, "a lost peer")

    def latest(self):
        return self.registered


def _checkpoint(run, epoch: int) -> str:
    path = run / f"checkpoint_epoch{epoch:06d}"
    ckpt_format.write_checkpoint(str(path), meta={"epoch": epoch, "step": 10 * epoch},
                                 history=[{"epoch": e, "train_loss": 1.0 / e} for e in range(1, epoch + 1)])
    return str(path)


def test_the_result_is_the_newest_checkpoints_history_then_the_rows_trained_after_it(tmp_path):
    """One way for every carrier: the checkpoint's ``history.json``, then the last attempt's rows after it (epochs 3
    and 4: trained, their weights not finite, no checkpoint); a row an earlier attempt sent is replaced."""
    cfg = TrainConfig(storage_path=str(tmp_path), name="r", max_failures=1)
    _checkpoint(tmp_path / "r", 1)
    newest = _checkpoint(tmp_path / "r", 2)
    printer = Printer()
    rows = [{"epoch": e, "train_loss": float(e)} for e in (2, 3, 4)]
    result = drive(Rows(cfg, printer, rows, failures=1))
    assert result.checkpoint_path == newest
    assert [row["epoch"] for row in result.history] == [1, 2, 3, 4]
    assert result.history[1] == {"epoch": 2, "train_loss": 0.5}  # the checkpoint's own row, not the one sent again
    assert result.history[2:] == rows[1:] and len(printer.rows) == 6  # every row shown, both attempts


def test_a_carriers_own_latest_checkpoint_decides_among_the_folders(tmp_path):
    """Ray Train's latest (its path) is the run's last checkpoint, even where a later one sits in the folder
    unregistered (an upload a killed save left); with none registered and none published, no checkpoint."""
    cfg = TrainConfig(storage_path=str(tmp_path), name="r")
    registered = _checkpoint(tmp_path / "r", 1)
    _checkpoint(tmp_path / "r", 2)
    result = drive(Rows(cfg, Printer(), [], latest=registered))
    assert result.checkpoint_path == registered and [row["epoch"] for row in result.history] == [1]
    assert drive(Rows(cfg, Printer(), [], latest=None)) == ([], None, None)


def test_every_attempt_starts_after_the_cleanup_and_a_failure_is_raised_whole(tmp_path):
    """A failed attempt's temporary checkpoint folder is gone before the next starts; the run's failure carries
    where its checkpoints are (``retry.whole_failure``)."""
    cfg = TrainConfig(storage_path=str(tmp_path), name="r", max_failures=1)
    leftover = tmp_path / "r" / ".tmp-checkpoint_epoch000001-0123456789ab"
    seen = []

    class Leaves(Rows):
        def start(self, sink, attempt):
            seen.append(leftover.exists())
            leftover.mkdir(parents=True)  # what a killed save leaves
            super().start(sink, attempt)

    with pytest.raises(ConnectionResetError) as failed:
        drive(Leaves(cfg, Printer(), [], failures=2))
    assert seen == [False, False]  # removed before the restart
    assert any("training run 'r' failed" in note for note in failed.value.__notes__)
