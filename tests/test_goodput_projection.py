"""Projected goodput (``planning/goodput.py``), ``raytrain-mgpu goodput RUN`` and ``checkpoint_every_n_minutes="auto"``.

The closed forms against their seeded simulation; the command on a run folder a quick in-process fit writes (no
Ray); the auto interval's trigger, on a clock set by hand and in a fit; the config's refusals.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.checkpointing.preemption import AUTO_FIRST_INTERVAL_S, PreemptionCheck, SaveClock
from raytrain_mgpu.cli import main
from raytrain_mgpu.planning import goodput, goodput_command

# (checkpoint_s, restart_s, interval_s, mtbf_s): reclaims often enough that a few thousand hours hold thousands
CASES = [(10.0, 120.0, 300.0, 3600.0), (30.0, 300.0, 1800.0, 7200.0), (2.0, 60.0, 100.0, 600.0)]
FIT = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=2, use_gpu=False,
           num_workers=1, runner="local")  # 22 steps an epoch


@pytest.mark.parametrize("notice", [False, True])
@pytest.mark.parametrize("c, d, t, m", CASES)
def test_the_whole_restart_closed_form_agrees_with_its_simulation(c, d, t, m, notice):
    closed = goodput.goodput_restart(c, d, t, m, notice_covers_save=notice)
    simulated = goodput.simulate_restart(c, d, t, m, notice_covers_save=notice, horizon_s=5e6, seed=7)
    assert simulated == pytest.approx(closed, rel=0.02)
    assert closed < t / (t + c)  # reclaims cost something on top of the saves


@pytest.mark.parametrize("c, d, t, m", CASES)
def test_the_replica_group_closed_form_agrees_with_its_simulation(c, d, t, m):
    """A reclaim's loss is the same each time (save where two overlap on one group): the two agree within 0.5 %, so
    the steps the other groups redo (10 s steps here, ~1 % of the goodput) are held too."""
    closed = goodput.goodput_replica_groups(c, d, t, 10.0, m, groups=4)
    simulated = goodput.simulate_replica_groups(c, d, t, 10.0, m, groups=4, horizon_s=5e6, seed=7)
    assert simulated == pytest.approx(closed, rel=0.005)
    assert closed > goodput.goodput_restart(c, d, t, m)  # only a quarter of the job waits for the restart
    assert goodput.goodput_replica_groups(c, d, t, 10.0, m, groups=1) is None  # no peer: a whole restart


def test_young_daly_is_near_the_best_interval_and_a_covering_notice_beats_none():
    c, d, m = 10.0, 120.0, 3600.0
    best = goodput.young_daly_s(c, m)
    assert best == pytest.approx(math.sqrt(2 * c * m))
    at = goodput.goodput_restart(c, d, best, m)
    assert at > goodput.goodput_restart(c, d, best / 2, m) and at > goodput.goodput_restart(c, d, best * 2, m)
    assert goodput.goodput_restart(c, d, best, m, notice_covers_save=True) > at
    m64 = 3600 / (64 * 0.05)
    short = goodput.project(c, d, 0.5, 600.0, gpus=64, reclaims_per_gpu_hour=0.05, notice_s=5.0)  # < a 10 s save
    assert not short["notice_covers_save"] and short["goodput_restart"] == goodput.goodput_restart(c, d, 600.0, m64)
    covering = goodput.project(c, d, 0.5, 600.0, gpus=64, reclaims_per_gpu_hour=0.05, notice_s=120.0)
    assert covering["notice_covers_save"] and covering["goodput_restart"] > short["goodput_restart"]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    storage = tmp_path_factory.mktemp("goodput")
    return rtm.fit(rtm.TrainConfig(**FIT, storage_path=str(storage), name="run")).path


def _goodput(capsys, *argv) -> tuple:
    rc = main(["goodput", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_command_prints_the_ledger_and_the_projection(run_folder, capsys):
    rc, out, _ = _goodput(capsys, run_folder)
    assert rc == 0 and "time by kind" in out and "checkpoint" in out and "per save" in out
    rc, out, _ = _goodput(capsys, run_folder, "--gpus", "64", "--reclaims-per-gpu-hour", "0.05", "--restart-s", "30",
                          "--json")
    p = json.loads(out)
    assert rc == 0 and p["mtbf_s"] == pytest.approx(3600 / (64 * 0.05)) and p["restart_s"] == 30
    assert p["young_daly_s"] == pytest.approx(math.sqrt(2 * p["checkpoint_s"] * p["mtbf_s"]))
    assert p["goodput_restart"] == pytest.approx(goodput.goodput_restart(p["checkpoint_s"], 30, p["interval_s"],
                                                                         p["mtbf_s"]))
    assert 0 < p["goodput_restart"] < 1 and p["replica_groups"] == 8 and p["goodput_replica_groups"] > 0
    rc, out, _ = _goodput(capsys, run_folder, "--gpus", "64", "--reclaims-per-gpu-hour", "0.05", "--restart-s", "30")
    assert "mean time between reclaims  1125 s" in out and "Young-Daly" in out and "replica groups" in out


def test_a_run_that_never_restarted_projects_its_start_up(run_folder, capsys, monkeypatch):
    ledger = {**goodput_command.history_ledger([{"step": 22, "attempt": 0, "training_s": 10.0, "checkpoint_s": 1.0,
                                                 "eval_s": 0.5, "step_time_s": 0.4, "data_wait_share": 0.1}]),
              "startup_s": 12.0, "restart_s": None, "from_history": False}
    monkeypatch.setattr(goodput_command, "read_ledger", lambda run: ledger)
    rc, out, _ = _goodput(capsys, run_folder, "--gpus", "16", "--reclaims-per-gpu-hour", "0.1")
    assert rc == 0 and "12 s (the run never restarted: its first attempt's start-up)" in out
    rc, out, _ = _goodput(capsys, run_folder, "--gpus", "16", "--reclaims-per-gpu-hour", "0.1", "--json")
    assert json.loads(out)["restart_s"] == 12.0


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0", "--reclaims-per-gpu-hour", "0.05"], r"--gpus=0: must be a count of GPUs >= 1"),
    (["--gpus", "8", "--reclaims-per-gpu-hour", "-1"], r"--reclaims-per-gpu-hour=-1.0: must be a finite number > 0"),
    (["--gpus", "8"], r"--gpus and --reclaims-per-gpu-hour go together"),
    (["--gpus", "8", "--reclaims-per-gpu-hour", "0.05", "--notice-s", "-3"], r"--notice-s=-3.0: must be a finite"),
])
def test_bad_values_are_refused_with_exit_status_2(run_folder, capsys, argv, message):
    rc, _, err = _goodput(capsys, run_folder, *argv)
    assert rc == 2
    assert re.search(message, err), err


def test_a_folder_without_history_is_refused(tmp_path, capsys):
    rc, _, err = _goodput(capsys, str(tmp_path))
    assert rc == 2 and "has no history yet" in err and str(tmp_path) in err


# ----------------------------------------------------------------------------- checkpoint_every_n_minutes="auto"


def test_the_auto_interval_is_young_dalys_from_the_measured_stalls():
    """4 devices at 0.5 reclaims per GPU-hour: M = 1800 s; a save that stalled 2 s gives sqrt(2 x 2 x 1800) = 85 s."""
    cfg = rtm.TrainConfig(checkpoint_every_n_minutes="auto", expected_reclaims_per_gpu_hour=0.5)
    clock = SaveClock(num_devices=4)
    check = PreemptionCheck(cfg, every=10, any_rank=lambda seen: seen, since_save=clock)
    assert check.interval_s() == AUTO_FIRST_INTERVAL_S  # no save measured yet
    clock.last = time.monotonic() - (AUTO_FIRST_INTERVAL_S - 60)
    assert not check.after_step(10, 10, 100, save=lambda: None)
    clock.saved(2.0)
    assert check.interval_s() == pytest.approx(math.sqrt(2 * 2.0 * 1800))
    clock.last = time.monotonic() - 80  # 80 s < 85 s: not yet
    assert not check.after_step(20, 20, 100, save=lambda: None)
    clock.last = time.monotonic() - 90
    saved = []
    assert check.after_step(30, 30, 100, save=lambda: saved.append(30)) and saved == [30]


def test_auto_checkpoints_where_young_daly_says_in_a_fit(tmp_path):
    """A reclaim rate so high that Young-Daly's interval is milliseconds: before the first save (the first epoch's
    end) the 10-minute default holds, so no step checkpoint; after it, one at every check (steps 30 and 40)."""
    rtm.fit(rtm.TrainConfig(**FIT, storage_path=str(tmp_path), name="auto", checkpoint_every_n_minutes="auto",
                            expected_reclaims_per_gpu_hour=1e6, num_checkpoints_to_keep=10))
    names = sorted(p.name for p in (tmp_path / "auto").glob("checkpoint_*"))
    assert names == ["checkpoint_epoch000001", "checkpoint_epoch000001_step000000030",
                     "checkpoint_epoch000001_step000000040", "checkpoint_epoch000002"], names


@pytest.mark.parametrize("fields, message", [
    (dict(checkpoint_every_n_minutes="auto"),
     r"checkpoint_every_n_minutes='auto': needs expected_reclaims_per_gpu_hour .* Set expected_reclaims_per_gpu_hour"),
    (dict(expected_reclaims_per_gpu_hour=0.05, checkpoint_every_n_minutes=30),
     r"expected_reclaims_per_gpu_hour=0.05: is read by checkpoint_every_n_minutes='auto' alone \(it is 30\)"),
    (dict(checkpoint_every_n_minutes="auto", expected_reclaims_per_gpu_hour=0),
     r"expected_reclaims_per_gpu_hour=0: must be a finite positive number"),
    (dict(checkpoint_every_n_minutes="often"), r"checkpoint_every_n_minutes='often': must be a positive number of "
                                               r"minutes, 'auto' or None"),
])
def test_the_config_refuses_auto_without_a_rate_and_a_rate_without_auto(fields, message):
    with pytest.raises(ValueError, match=message):
        rtm.TrainConfig(**fields)


def test_the_cli_and_yaml_take_auto(tmp_path):
    from raytrain_mgpu.cli import _build_parser, config_from_args

    args = _build_parser().parse_args(["train", "--checkpoint-every-n-minutes", "auto",
                                       "--expected-reclaims-per-gpu-hour", "0.05"])
    cfg = config_from_args(args)
    assert cfg.checkpoint_every_n_minutes == "auto" and cfg.expected_reclaims_per_gpu_hour == 0.05
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint_every_n_minutes: auto\nexpected_reclaims_per_gpu_hour: 0.05\n")
    assert rtm.TrainConfig.from_yaml(str(path)).checkpoint_every_n_minutes == "auto"
