"""The goodput ledger (``driver/goodput.py``): where a run's wall time went, by kind, across its attempts.

The arithmetic from synthetic attempt records and history rows; a run in this process (no failure, then a failure
after step 35); and one Ray Train run failed once at step 36's forward, whose ledger is read back from its folder.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.driver.goodput import KINDS, LEDGER_FILE, Ledger, describe, read_ledger, summarize

MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd", lr=0.1,
           seed=3, use_gpu=False, epochs=2)  # digits: 22 steps an epoch of 64


def _adds_up(ledger: dict, within: float = 0.05, floor_s: float = 0.0) -> None:
    """The kinds add up to the wall time within ``within`` of it, never above it; ``floor_s``: what no kind holds
    (each epoch's end: in this process the epoch's line, loggers and callbacks run in the training thread) may be
    that much, most of a run of a third of a second on a busy machine."""
    total = sum(ledger[kind] for kind in KINDS)
    assert all(ledger[kind] >= 0 for kind in KINDS), ledger
    assert total <= ledger["wall"] * 1.01 + 0.005, (total, ledger)
    assert ledger["wall"] - total <= max(within * ledger["wall"], floor_s), (total, ledger)


def _rows() -> list:
    """Two epochs of 22 one-second steps (a tenth of each waiting for data), 1 s of checkpoint and 1 s of evaluation
    each; the second epoch's row holds the 8 steps its first attempt kept in the step-30 checkpoint."""
    row = dict(training_s=22.0, data_wait_share=0.1, checkpoint_s=1.0, eval_s=1.0)
    return [dict(row, epoch=1, step=22, attempt=0), dict(row, epoch=2, step=44, attempt=1)]


def _failed_once(ledger: Ledger, controller: bool = False) -> None:
    """The timeline of :func:`_rows`, started at 0: first step at 10; epoch 1 ends at 34; steps 23-35 by 47, then a
    failure, detected at 49; the next attempt starts there, steps from 53 (from the step-30 checkpoint), ends at 69.
    ``controller``: as Ray Train's controller reports it (no driver loop: the attempts begin with rank 0's start-up)."""
    if not controller:
        ledger.begin()
    ledger.event("startup", {"entered": 5.0, "first_step": 10.0, "resumed_from": None})
    for step in range(1, 36):
        ledger.event("step", ((step - 1) % 22 + 1, 22, (step - 1) // 22 + 1))
    ledger.event("checkpoint", "checkpoint_epoch000001")
    for _ in range(3):  # steps 10, 20, 30
        ledger.event("checkpoint", "step")
    ledger.event("reached", {"step": 35, "at": 47.0, "finished": 47.5})
    if controller:
        ledger.event("failed", 49.0)
    else:
        ledger.end(failed=True, now=49.0)
        ledger.begin(now=49.0)
    ledger.event("startup", {"entered": 51.0, "first_step": 53.0, "resumed_from": "checkpoint_epoch000001_step30"})
    for step in range(31, 45):
        ledger.event("step", ((step - 1) % 22 + 1, 22, (step - 1) // 22 + 1))
    ledger.event("checkpoint", "step-40")
    ledger.event("checkpoint", "checkpoint_epoch000002")
    ledger.event("reached", {"step": 44, "at": 67.0, "finished": 69.0})
    if not controller:
        ledger.end(failed=False, now=70.0)
    ledger.close(now=71.0)


@pytest.mark.parametrize("controller", [False, True], ids=["attempt_loop", "ray_train_controller"])
def test_the_kinds_of_a_run_failed_once_add_up_to_its_wall_time_and_redone_is_the_steps_trained_twice(controller):
    ledger = Ledger(started=0.0)
    _failed_once(ledger, controller)
    got = ledger.summary(_rows())
    want = {"productive": 39.6, "data_wait": 4.4, "checkpoint": 2.0, "eval": 2.0, "redone": 5.0,  # steps 31-35, 1 s
            "startup": 10.0 + 4.0, "restart": 49.0 - 47.0, "wall": 69.0}  # wall: to rank 0's end, not the driver's
    assert {key: got[key] for key in want} == pytest.approx(want)
    assert sum(got[kind] for kind in KINDS) == pytest.approx(got["wall"])
    assert got["redone_steps"] == 5 and got["restarts"] == 1 and got["saves"] == 6
    assert got["step_s"] == pytest.approx(1.0) and got["startup_s"] == pytest.approx(10.0)
    assert got["restart_s"] == pytest.approx(53.0 - 47.0)  # from the last step to the next attempt's first
    assert got["checkpoint_s"] == pytest.approx(2.0 / 6) and got["interval_s"] == pytest.approx(51.0 / 6)
    assert "redone 5 s (7.2 %)" in describe(got) and describe({}) == ""


def test_a_run_without_failure_has_nothing_redone_and_a_resume_by_a_new_fit_counts_its_steps_trained_twice(tmp_path):
    rows = _rows()
    one = {"start": 0.0, "end": 60.0, "saves": 2, "attempts": [
        {"start": 0.0, "first_step": 10.0, "resumed": 0, "reached": 44, "reached_at": 58.0, "end": 60.0}]}
    got = summarize([one], rows)
    assert got["redone"] == 0 and got["restart"] == 0 and got["restarts"] == 0 and got["restart_s"] is None
    assert got["wall"] == 60.0 and got["startup"] == 10.0
    # a driver killed after step 35 (no end recorded), and a second fit resuming from step 30: 5 steps redone
    killed = {"start": 0.0, "end": None, "saves": 4, "attempts": [
        {"start": 0.0, "first_step": 10.0, "resumed": 0, "reached": 35, "reached_at": 47.0, "end": None}]}
    second = {"start": 100.0, "end": 125.0, "saves": 2, "attempts": [
        {"start": 100.0, "first_step": 104.0, "resumed": 30, "reached": 44, "reached_at": 123.0, "end": 125.0}]}
    got = summarize([killed, second], rows)
    assert got["redone_steps"] == 5 and got["restarts"] == 0
    assert got["wall"] == pytest.approx(47.0 + 25.0) and got["startup"] == pytest.approx(14.0)


def test_the_ledger_is_written_after_each_attempt_and_read_back_from_the_folder_without_ray(tmp_path):
    folder = RunFolder(str(tmp_path / "run"))
    ledger = Ledger(folder, started=0.0)
    ledger.begin()
    ledger.event("startup", {"entered": 5.0, "first_step": 10.0, "resumed_from": None})
    ledger.event("step", (1, 22, 1))
    ledger.end(failed=True, now=12.0)  # a driver killed now leaves this much
    assert folder.read_json(folder.join(LEDGER_FILE))["sessions"][0]["attempts"][0]["end"] == 12.0
    with pytest.raises(FileNotFoundError, match="has no goodput.json"):
        read_ledger(str(tmp_path / "elsewhere"))
    again = Ledger(folder, started=100.0)  # a second fit on the run: its attempts after the first one's
    assert [session["start"] for session in again.sessions] == [0.0, 100.0]
    folder = RunFolder(str(tmp_path / "other"))
    ledger = Ledger(folder, started=0.0)
    _failed_once(ledger)
    folder.write_history(_rows())
    assert read_ledger(folder.uri) == ledger.summary(_rows())


# ----------------------------------------------------------------------------- runs


def _fit(storage: str, name: str, **fields) -> rtm.TrainResult:
    return rtm.fit(rtm.TrainConfig(**{**MLP, **fields}, storage_path=storage, name=name), stream=io.StringIO())


def test_an_in_process_run_without_failure_has_nothing_redone_nor_restarted_and_its_kinds_add_up(tmp_path):
    result = _fit(str(tmp_path), "local", runner="local", num_workers=1, loggers=["csv"])
    got = result.goodput
    assert got["redone"] == 0 and got["restart"] == 0 and got["restarts"] == 0 and got["restart_s"] is None
    _adds_up(got, floor_s=0.2)
    assert got["productive"] > 0 and got["startup"] > 0 and got["saves"] == 2 and got["step_s"] > 0
    assert got["startup_s"] == pytest.approx(result.startup["first_step_s"], abs=0.05)
    assert read_ledger(result.path) == pytest.approx(got)
    logged = {name: float(value) for step, _, name, value in csv.reader(open(Path(result.path) / "metrics.csv"))
              if name.startswith("goodput/")}  # the loggers' scalars at the last step
    assert logged == pytest.approx({f"goodput/{kind}_s": got[kind] for kind in (*KINDS, "wall")})


def test_an_in_process_run_failed_after_step_35_redoes_the_steps_after_its_step_30_checkpoint(tmp_path):
    from _failing_models import fault_once_after_step

    with fault_once_after_step(35):
        result = _fit(str(tmp_path), "local-failed", runner="local", num_workers=1, checkpoint_every_n_steps=10,
                      max_failures=1)
    got = result.goodput
    # the fault is raised in step 35's end (the engine's step hook), so rank 0 last ended step 34: steps 31-34 are
    # redone, and the step the failure cut short counts as restart
    assert got["redone_steps"] == 4 and got["redone"] == pytest.approx(4 * got["step_s"])
    assert got["restarts"] == 1 and got["restart"] > 0 and got["restart_s"] > got["restart"]
    _adds_up(got, floor_s=0.2)
    assert read_ledger(result.path) == pytest.approx(got)


@pytest.mark.ray
@pytest.mark.slow
def test_a_ray_train_run_failed_once_at_step_36_redoes_5_steps_and_its_folder_gives_the_same_ledger(
        ray_session, storage, tmp_path):
    """Two CPU workers; rank 0 raises in step 36's forward (its 36th), after steps 1-35; the controller restarts
    the group from the step-30 checkpoint: steps 31-35 are trained twice."""
    probe = Path(tmp_path) / "probe"
    probe.mkdir()
    result = _fit(storage, "goodput-ray", runner="ray", num_workers=2, strategy="ddp",
                  model="_failing_models:failing", model_kwargs={"probe": str(probe),
                                                                 "faults": [{"what": "raise", "rank": 0, "at": 36}]},
                  checkpoint_every_n_steps=10, max_failures=1)
    got = result.goodput
    print("ledger of the Ray Train run failed once:", got)
    assert [(row["epoch"], row["attempt"]) for row in result.history] == [(1, 0), (2, 1)]
    assert got["restarts"] == 1 and got["restart"] > 0 and got["redone_steps"] == 5
    assert got["redone"] > 0 and math.isclose(got["redone"], 5 * got["step_s"])
    _adds_up(got)
    assert read_ledger(result.path) == pytest.approx(got)
