"""The benchmarks' arithmetic (pure): ratios are medians of within-round ratios, so a
machine that drifts between rounds does not move them. The benchmarks themselves are
commands (`raytrain-mgpu bench`, `python jobs/benchmark_pipeline.py`), not timed tests."""

from __future__ import annotations

import pytest

from raytrain_mgpu.bench import ddp as bench
from raytrain_mgpu.bench.pipeline import BenchConfig, _summarise, format_report


def test_pipeline_ratios_cancel_a_drifting_machine():
    cfg = BenchConfig(microbatches=8, stages=2, rounds=3)
    rounds = []
    for slowdown in (1.0, 1.5, 2.0):  # the machine gets slower round by round
        rounds.append({"single": 1.0 * slowdown, "ours-1f1b": 0.6 * slowdown, "torchrun-1f1b": 0.66 * slowdown})
    for slowdown in (1.0, 3.0, 1.2):
        rounds.append({"single": 1.0 * slowdown, "naive": 1.2 * slowdown})
    results = _summarise(cfg, {"bench": cfg.__dict__, "schedules": {"1f1b": {"bubble_fraction": 0.12,
                                                                              "partition": [5, 5]}}}, rounds)
    entry = results["schedules"]["1f1b"]
    assert entry["ours_vs_torchrun"] == pytest.approx(1.1)
    assert entry["efficiency"] == pytest.approx(9 / 16 / 0.6)  # ideal share (m+p-1)/(mp) over 0.6
    assert entry["step_s"] == pytest.approx(0.6) and results["single_step_s"] == pytest.approx(1.0)
    assert results["pipelined_speedup"] == pytest.approx(1.2 / 0.6)  # not 1.2 / 0.6 x a drift
    report = format_report(results)
    assert "1.10x" in report and "speed-up over it 2.00x" in report


def test_data_parallel_report_takes_the_median_ratio_and_shows_the_range():
    def runs(label, rates):
        return [bench.Measured(label, rate, startup_s=20.0) for rate in rates]

    fit2 = runs("fit 2", [1000.0, 2000.0, 1500.0])
    torchrun = runs("torchrun 2", [1000.0, 1600.0, 1500.0])  # same drift: ratios 1.0, 1.25, 1.0
    text = bench.report([(fit2, torchrun, 1.0)])
    assert "1.00x  1.00-1.25x  >= 1.0 ok" in text
    assert "1,500" in text  # the median rate of each side


def test_preemption_report_takes_medians_and_the_share_of_one_check_every_n_steps():
    from raytrain_mgpu.bench.preemption import report

    times = {"step": [0.010, 0.020, 0.030], "check": [0.0001, 0.0002, 0.0003],
             "get_preemption_info": [0.001, 0.002, 0.100]}  # one slow outlier call
    text = report(times, every=10)
    assert "step (DDP, mlp 784-256-10, batch 64): 20.00 ms (median)" in text
    assert "the loop's check (no notice): 0.200 ms (median; mean 0.200 ms)" in text
    # 2 ms every 10 steps is 0.2 ms a step: 1% of a 20 ms step
    assert ("get_preemption_info: 2.000 ms (median; mean 34.333 ms); one every 10 steps: 0.2000 ms a step, "
            "1.00% of this step; under 1% for steps over 20.0 ms") in text


def test_checkpoint_report_measures_the_stall_against_the_run_without_saves():
    from raytrain_mgpu.bench.checkpoint import report

    run = lambda save, cycle: [{"save_s": [save], "step_s": [0.1], "cycle_s": [cycle]}]  # noqa: E731
    text = report({"sync": run(5.0, 7.0), "async": run(1.0, 2.5), "none": run(0.0, 1.0)})
    lines = text.splitlines()
    assert lines[2].split()[-1] == "6.00s" and lines[3].split()[-1] == "1.50s"  # cycle minus the no-save cycle
    assert "time in the save 5.0x shorter; stall per checkpoint 4.0x shorter" in text


def test_bench_checkpoint_runs_ray_trains_controller_with_fits_poll(monkeypatch, tmp_path):
    """The stall it measures is fit's: each report waits for the controller's next poll, so the
    bench runs the controller with the poll fit sets (transports/ray_train/faults.controller_poll), read by Ray
    Train from the driver's environment when fit() starts it: checked there."""
    import json
    import os
    from types import SimpleNamespace

    import ray.train.torch

    from raytrain_mgpu.bench import checkpoint as bench_checkpoint
    from raytrain_mgpu.transports.ray_train.faults import FIT_POLL_S, POLL_ENV

    seen = []

    class Trainer:  # TorchTrainer, up to the moment fit() starts the controller
        def __init__(self, fn, train_loop_config, **kwargs):
            self.out = train_loop_config["out"]

        def fit(self):
            seen.append(os.environ.get(POLL_ENV))
            with open(self.out, "w") as f:
                json.dump({"stalls": []}, f)

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    monkeypatch.delenv(POLL_ENV, raising=False)
    args = SimpleNamespace(widths=[8], batch_size=4, saves=2, steps_between=1, threads=1, upload_mb_per_s=0)
    assert bench_checkpoint._run_one("async", args, str(tmp_path / "storage"), str(tmp_path), 0) == {"stalls": []}
    assert seen == [FIT_POLL_S] and POLL_ENV not in os.environ


def test_short_epochs_report_takes_an_epochs_overhead_from_two_run_lengths_and_the_step_checkpoints_share():
    from raytrain_mgpu.bench.short_epochs import VARIANTS, Run, per_epoch_outside_steps, report

    def pair(wall_10, wall_1, training=0.1, checkpoint=None):  # 10 epochs and 1 epoch, 64 x 22 samples each
        return (Run(wall_10, [training] * 10, [1408] * 10, checkpoint and [checkpoint] * 10, [22] * 10),
                Run(wall_1, [training], [1408], checkpoint and [checkpoint], [22]))

    # the hand-written loop: 2.0 s more per extra epoch, 0.1 s of it in steps; fit: 0.2 s more
    hand, ours, steps = pair(40.0, 22.0), pair(12.0, 10.2, checkpoint=0.01), pair(13.0, 11.0, checkpoint=0.02)
    assert per_epoch_outside_steps(*hand) == pytest.approx(1.9) and per_epoch_outside_steps(*ours) == pytest.approx(0.1)
    text = report({VARIANTS[0]: [hand], VARIANTS[1]: [ours], VARIANTS[2]: [steps]})
    fit_line = next(line for line in text.splitlines() if line.startswith("fit "))
    assert fit_line.split()[1:4] == ["12.0", "0.30x", "0.100"]  # wall, its ratio, per epoch outside the steps
    assert fit_line.split()[-1] == "1.00x"  # the same samples/s: 14,080
    # and each round's ratio (one round here; fit, K=10 at 1,408 samples / 0.2 s against 0.1 s)
    slower = pair(13.0, 11.0, training=0.2, checkpoint=0.02)
    assert "samples/s vs ray train, each round: fit 1.00x 1.00x; fit, K=10 1.00x 0.50x" in report(
        {VARIANTS[0]: [hand, hand], VARIANTS[1]: [ours, ours], VARIANTS[2]: [steps, slower]})
    # K=10: 10 x 0.01 s more checkpoint time over 10 x 0.1 s in steps
    assert "step checkpoints every 10 steps: 10.0 % of the steps' time" in text
    # per save: 0.1 s over 2 saves an epoch that are not its last step (steps 10 and 20 of 22) x 10 epochs
    assert "5.0 ms a save against 10 steps of 4.5 ms; against 10 steps of 50 ms (the example target's) 1.0 %" in text


def test_checkpointing_report_puts_the_two_variants_side_by_side():
    from raytrain_mgpu.bench.activation_checkpointing import report

    mib = 2**20
    text = report({0: {"step_s": [0.010, 0.012, 0.011], "held": [200 * mib, 210 * mib], "estimated": 300 * mib},
                   1: {"step_s": [0.014, 0.013, 0.015], "held": [50 * mib], "estimated": 60 * mib}})
    lines = text.splitlines()
    assert lines[2].split() == ["0", "11.0", "205", "300"] and lines[3].split() == ["1", "14.0", "50", "60"]
    assert "step time 1.27x, held for the backward 0.24x, estimate 0.20x" in text
