"""``compare``: memory estimates and the budget batch search (pure), the report (pure), one real run (Ray)."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import raytrain_mgpu as rtm
from raytrain_mgpu.api import compare  # planning.compare's, with each run a fit
from raytrain_mgpu.planning.compare_report import (CHART_FILE, MARKDOWN_FILE, PARQUET_FILE, REFERENCE, CompareReport, RunRow,
                                          check_losses, recommend, summarize_history, write_outputs)
from raytrain_mgpu.config.units import parse_bytes
from raytrain_mgpu.planning.memory import (device_memory, largest_batch, max_batch_within_budget,
                                  profile_model)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- the batch search


@pytest.mark.parametrize("granularity", [1, 2, 3, 8])
@pytest.mark.parametrize("start", [None, 1, 40, 5000])
def test_largest_batch_finds_the_boundary_from_any_start(granularity, start):
    for boundary in (0, 1, 7, 8, 100, 1023, 4096):
        calls = []

        def fits(batch):
            calls.append(batch)
            return batch <= boundary

        assert largest_batch(fits, granularity, start=start) == boundary // granularity * granularity
        assert all(b % granularity == 0 for b in calls)
        assert len(calls) <= 2 * 14 + 2  # doubling plus bisection, not a scan


def test_largest_batch_stops_at_the_limit_and_at_the_resolution():
    assert largest_batch(lambda b: True, 4, limit=1438) == 1436
    calls = []
    found = largest_batch(lambda b: calls.append(b) or b <= 1000, 1, start=512, resolution=1 / 8)
    assert 1000 - 1000 // 8 <= found <= 1000 and len(calls) <= 6


# ----------------------------------------------------------------------------- memory of a known model


def linear_stack() -> nn.Module:
    """16 inputs -> 32 -> 4 outputs, no biases: every byte can be counted by hand."""
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))


PARAMS = 16 * 32 + 32 * 4            # 640 parameters
STATE = PARAMS * 4 * (1 + 1 + 2)     # fp32 weights + gradients + AdamW's two moments = 10,240 bytes
# Per sample, what autograd keeps: the ReLU output (32 floats; the second Linear saves the
# same tensor), the logits (4 floats), log_softmax's output (4 floats), the int64 target,
# and the input itself (16 floats).
ACTIVATIONS, OUTPUT, INPUT = 32 * 4, 4 * 4 + 4 * 4 + 8, 16 * 4
PER_SAMPLE = ACTIVATIONS + OUTPUT + INPUT  # 232 bytes


@pytest.fixture(scope="module")
def stack_profile():
    return profile_model(linear_stack(), (1, 4, 4), optimizer="adamw")


def cfg_for(strategy: str, **kw) -> rtm.TrainConfig:
    base = dict(model="mlp", dataset="synthetic", input_shape=[1, 4, 4], num_classes=4, strategy=strategy,
                num_workers=1, use_gpu=False, batch_size=64)
    return rtm.TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_profile_counts_the_bytes_of_a_linear_stack(device):
    with torch.device(device):
        model = linear_stack()
    profile = profile_model(model, (1, 4, 4), optimizer="adamw")
    assert profile.param_bytes == PARAMS * 4 and profile.state_bytes() == STATE
    assert profile.block_activation_bytes == (0, 0, ACTIVATIONS, 0)  # saved where the ReLU ran
    assert (profile.output_bytes, profile.input_bytes) == (OUTPUT, INPUT)
    assert profile_model(model, (1, 4, 4), optimizer="sgd", momentum=0.0).state_bytes() == PARAMS * 4 * 2


def test_budget_search_finds_the_boundary_by_hand(stack_profile):
    one = cfg_for("ddp")
    assert max_batch_within_budget("ddp", one, stack_profile, STATE + PER_SAMPLE * 100) == 100
    assert max_batch_within_budget("ddp", one, stack_profile, STATE + PER_SAMPLE * 100 - 1) == 99
    # Two workers: each holds the whole state and half of the batch; the batch must be even.
    two = cfg_for("ddp", num_workers=2)
    assert max_batch_within_budget("ddp", two, stack_profile, STATE + PER_SAMPLE // 2 * 101) == 100
    # Accumulation: activations of one micro-batch at a time.
    accum = cfg_for("ddp", grad_accum_steps=4)
    assert max_batch_within_budget("ddp", accum, stack_profile, STATE + PER_SAMPLE * 25) == 100


def test_estimates_show_what_each_strategy_puts_where(stack_profile):
    batch = 64
    dp = [d.at(batch) for d in device_memory("dp", cfg_for("dp", gpus_per_worker=2), stack_profile)]
    balanced = [d.at(batch) for d in device_memory("dp_balanced", cfg_for("dp_balanced", gpus_per_worker=2),
                                                   stack_profile)]
    # DataParallel: device 0 holds the state, the whole input and every device's outputs.
    assert dp[0] == STATE + batch * (ACTIVATIONS // 2 + INPUT + OUTPUT)
    assert dp[1] == PARAMS * 4 + batch * (ACTIVATIONS + INPUT) // 2
    assert balanced[0] == dp[0] - batch * OUTPUT // 2  # outputs stay on their own device
    mp = [d.at(batch) for d in device_memory("mp", cfg_for("mp", gpus_per_worker=2), stack_profile)]
    assert sum(d.fixed for d in device_memory("mp", cfg_for("mp", gpus_per_worker=2), stack_profile)) == STATE
    assert max(mp) < STATE + PER_SAMPLE * batch  # split: no device holds it all
    fsdp = device_memory("fsdp", cfg_for("fsdp", num_workers=4), stack_profile)
    assert fsdp[0].fixed == STATE / 4 + 2 * 32 * 16 * 4  # a quarter, plus the largest block gathered
    gpipe = device_memory("pipeline", cfg_for("pipeline", schedule="gpipe", num_microbatches=4), stack_profile)
    one_f_one_b = device_memory("pipeline", cfg_for("pipeline", num_microbatches=4), stack_profile)
    assert one_f_one_b[-1].per_sample < gpipe[-1].per_sample  # 1F1B keeps fewer micro-batches in flight


def test_a_budget_too_small_for_any_batch_names_the_budget_and_the_need(stack_profile):
    need = STATE + PER_SAMPLE
    with pytest.raises(ValueError, match=rf"memory_budget_bytes=10000 .* too small .* needs {need} bytes"):
        max_batch_within_budget("ddp", cfg_for("ddp"), stack_profile, 10_000)


def test_compare_checks_its_input_before_starting_ray(monkeypatch):
    # Connecting at all would be a failure: the shared test Ray may already be up, so
    # "ray is not initialised" proves nothing; a connect that raises does.
    def connect(*args, **kwargs):
        raise AssertionError("compare connected to Ray before checking its input")

    monkeypatch.setattr("raytrain_mgpu.driver.cluster.connect", connect)
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", use_gpu=False)
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['nope'\]\. Valid names: ddp, ddp2, .*pipeline"):
        compare(cfg, strategies=["ddp", "nope"])
    with pytest.raises(ValueError, match=r"memory_budget_bytes=1000 .* too small for any batch: the smallest "
                                         r"need is \d+ bytes"):
        compare(cfg, strategies=["ddp", "pipeline"], memory_budget_bytes=1000)
    with pytest.raises(ValueError, match="steps=0 must be a positive integer"):
        compare(cfg, steps=0)
    assert parse_bytes("64MiB") == 64 * 2**20 and parse_bytes("8e9") == 8 * 10**9
    for endless in (float("inf"), float("nan")):  # found by test_config_property: OverflowError before
        with pytest.raises(ValueError, match="is not a size"):
            parse_bytes(endless)
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


LM = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=24, num_samples=96,
          model_kwargs={"num_layers": 2, "hidden": 16, "num_heads": 4}, batch_size=8)


def test_compare_lists_fsdp_with_the_tensor_groups_auto_tries_each_with_its_estimate(monkeypatch, tmp_path):
    # The whole of compare but the training: Ray is not connected (a CPU cluster of 4 is read), and each run's
    # `fit` returns one epoch's history at once.
    from types import SimpleNamespace

    from raytrain_mgpu.driver import cluster
    from raytrain_mgpu.planning import compare as planning_compare
    from raytrain_mgpu.planning.auto import ClusterInfo, layout_label, layouts
    from raytrain_mgpu.planning.memory import profile_config

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: False)
    monkeypatch.setattr(cluster, "read_capacity", lambda: cluster.Capacity(({"CPU": 4.0},)))
    trained = []

    def fit(run_cfg, stream=None):
        trained.append(run_cfg)
        return SimpleNamespace(history=[dict(step=run_cfg.max_steps, step_time_s=0.1, samples_per_s=80.0,
                                             peak_memory_bytes=[1] * run_cfg.num_workers, train_loss=3.0,
                                             test_loss=3.0)])

    cfg = rtm.TrainConfig(**LM, num_workers=4, use_gpu=False, storage_path=str(tmp_path))
    report = planning_compare.compare(cfg, strategies=["ddp", "fsdp"], steps=1, warmup_steps=0, fit=fit,
                                      out_dir=str(tmp_path / "out"))
    tensor = ["fsdp, tensor_parallel_size=2", "fsdp, tensor_parallel_size=4"]
    assert [r.label for r in report.measured()] == [REFERENCE, "ddp", "fsdp", *tensor], report.rows
    assert [layout_label("fsdp", v) for v in layouts(cfg, "fsdp", ClusterInfo((4,), False))] == ["fsdp", *tensor]
    rows = {r.label: r for r in report.rows}
    assert [rows[label].layout for label in tensor] == ["4 workers, 2 tensor group(s) of 2",
                                                        "4 workers, 1 tensor group(s) of 4"]
    assert [(c.name, c.strategy, c.num_workers, c.tensor_parallel_size) for c in trained[-2:]] == [
        ("fsdp-tensor_parallel_size-2", "fsdp", 4, 2), ("fsdp-tensor_parallel_size-4", "fsdp", 4, 4)]
    profile = profile_config(cfg)
    peaks = [rows[label].estimated_peak_bytes for label in ("fsdp", *tensor)]
    assert peaks == [max(d.at(8) for d in device_memory("fsdp", rows[label].config, profile))
                     for label in ("fsdp", *tensor)]
    assert len(set(peaks)) == 3  # each layout its own estimate: 1/T of each layer
    assert "fsdp, tensor_parallel_size=4" in report.table()
    # A model without a tensor-parallel plan: its tensor groups are said to be impossible once, with the fix.
    from raytrain_mgpu.planning.compare import _plan

    mlp = rtm.TrainConfig(model="mlp", dataset="synthetic", input_shape=[1, 4, 4], num_classes=4, num_workers=4)
    skipped = [r for r in _plan(mlp, ["fsdp"], ClusterInfo((4,), False)) if r.status == "skipped"]
    assert [r.label for r in skipped] == ["fsdp, tensor_parallel_size=2"]
    assert "model MLP has no tensor-parallel plan" in skipped[0].reason and "tensor_parallel_plan" in skipped[0].reason


def test_compare_skips_tensor_groups_the_clusters_nodes_cannot_hold(monkeypatch):
    # auto's layouts for one node of 2 GPUs, placed on a cluster of two 1-GPU nodes: fsdp over both runs, its
    # tensor group of 2 is skipped with the reason, before Ray is asked for anything.
    from raytrain_mgpu.driver import cluster
    from raytrain_mgpu.planning.auto import ClusterInfo
    from raytrain_mgpu.planning.compare import _plan, _skip_unplaceable

    cfg = rtm.TrainConfig(**LM, use_gpu=True)
    rows = _plan(cfg, ["fsdp"], ClusterInfo((2,), True))
    node = {"CPU": 8.0, "GPU": 1.0}
    _skip_unplaceable(rows, True, cluster.Capacity((node, node)))
    status = {r.label: (r.status, r.reason) for r in rows}
    assert status["fsdp"] == ("ok", "")
    assert status["fsdp, tensor_parallel_size=2"][0] == "skipped"
    assert re.search(r"strategy='fsdp' \(2 workers, 1 tensor group\(s\) of 2\): TrainConfig.tensor_parallel_size=2:"
                     r" .* at most 1 worker", status["fsdp, tensor_parallel_size=2"][1])


# ----------------------------------------------------------------------------- the report (pure)


def test_summary_skips_the_warm_up_epochs():
    history = [dict(step=10, step_time_s=0.5, samples_per_s=100.0, peak_memory_bytes=[5, 9], train_loss=2.0),
               dict(step=20, step_time_s=0.1, samples_per_s=600.0, peak_memory_bytes=[7, 8], train_loss=1.5),
               dict(step=25, step_time_s=0.2, samples_per_s=300.0, peak_memory_bytes=[6, 8], train_loss=1.2,
                    test_loss=1.1)]
    summary = summarize_history(history, warmup_steps=10)
    # 10 steps x 0.1 s at 600/s and 5 steps x 0.2 s at 300/s: 900 samples in 2 s.
    assert summary["samples_per_s"] == pytest.approx(450.0)
    assert summary["step_time_s"] == pytest.approx(2.0 / 15)
    assert summary["peak_memory_bytes"] == [7, 8]
    assert (summary["train_loss"], summary["final_loss"], summary["final_split"]) == (1.2, 1.1, "test")
    # with a validation split the runs are compared on it, and the report says so
    history[-1]["val_loss"] = 1.3
    assert (summarize_history(history, warmup_steps=10)["final_loss"], summarize_history(history, 10)["final_split"]) \
        == (1.3, "val")
    assert (summary["first_loss"], summary["first_steps"]) == (2.0, 10)


def fake_report(first_losses=(2.1, 2.1, 2.1), budget=None) -> CompareReport:
    rows = [RunRow(REFERENCE, "ddp", "1 worker", samples_per_s=1000, peak_memory_bytes=[900 << 20]),
            RunRow("ddp", "ddp", "2 workers", samples_per_s=1800, peak_memory_bytes=[910 << 20, 905 << 20],
                   estimated_peak_bytes=3 << 20, estimated_min_bytes=3 << 20, max_batch=64),
            RunRow("dp", "dp", "1 worker x 2 devices", samples_per_s=900, peak_memory_bytes=[1400 << 20, 700 << 20],
                   estimated_peak_bytes=5 << 20, estimated_min_bytes=2 << 20, max_batch=256),
            RunRow("ddp_mp", "ddp_mp", status="skipped", reason="needs 4 devices")]
    for row, loss, final in zip(rows, first_losses, (0.90, 0.93, 0.91)):
        row.first_loss, row.first_steps, row.train_loss, row.final_loss, row.step_time_s = loss, 11, 1.0, final, 0.01
        row.speedup = row.samples_per_s / 1000
    check = check_losses(rows, True, "")
    return CompareReport("lenet on digits", rows, check, recommend(rows, 128, budget), budget)


def test_losses_that_differ_are_flagged_and_left_out_of_the_recommendation():
    agree = fake_report()
    assert agree.loss_check.startswith("losses agree: 3 runs within 0.0e+00 over the first 11 steps")
    assert "final test losses spread by 3.3e-02 (fp32 rounding)" in agree.loss_check
    assert agree.recommendation.strategy == "ddp" and "1.80x one device" in agree.recommendation.reason
    differ = fake_report(first_losses=(2.1, 2.2, 2.1))
    assert differ.loss_check.startswith("LOSSES DISAGREE over the first 11 steps")
    assert "ddp (2.200000 vs 2.100000, rel. diff 4.8e-02)" in differ.loss_check
    assert [r.loss_agrees for r in differ.rows[:3]] == [True, False, True]
    assert differ.recommendation.label == REFERENCE  # ddp is out; dp is slower than one device
    assert "2.20000 !" in differ.table()
    assert "compounded by AdamW" in check_losses(agree.rows, True, "", optimizer="adamw")
    assert "losses not compared: the model has BatchNorm" in check_losses(differ.rows, False,
                                                                         "the model has BatchNorm (bn1)")


def test_on_cpu_a_one_process_strategy_is_not_recommended_over_one_device():
    rows = fake_report().rows
    rows[2].samples_per_s, rows[2].num_processes = 5000, 1  # dp "beats" everything: noise, on CPU
    cpu = recommend(rows, 128, None, on_gpu=False)
    assert cpu.label == "ddp" and "; left out: dp (one process on CPU: one device's work)" in cpu.reason
    assert recommend(rows, 128, None, on_gpu=True).label == "dp"


def test_budget_rules_out_strategies_whose_batch_does_not_fit():
    report = fake_report(budget=64 << 20)  # ddp fits at most 64 samples: not the configured 128
    assert report.recommendation.label == REFERENCE  # dp fits but is slower than one device
    assert "; left out: ddp (batch 128 does not fit 64 MiB)" in report.recommendation.reason
    assert "max batch @64 MiB" in report.table()


def test_outputs_are_written_and_the_chart_is_a_real_png(tmp_path):
    from matplotlib import image

    report = fake_report(budget=256 << 20)
    paths = write_outputs(report, str(tmp_path))
    assert set(paths) == {"markdown", "parquet", "chart"}
    assert (tmp_path / MARKDOWN_FILE).read_text().count("\n| ") == 4  # header, reference, ddp, dp
    rows = pq.read_table(tmp_path / PARQUET_FILE).to_pylist()
    assert [r["label"] for r in rows] == [REFERENCE, "ddp", "dp", "ddp_mp"] and rows[3]["status"] == "skipped"
    png = (tmp_path / CHART_FILE).read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
    pixels = image.imread(tmp_path / CHART_FILE)
    assert pixels.shape[1] > 1000 and pixels[..., :3].std() > 0.05  # wide, and not a blank canvas


# ----------------------------------------------------------------------------- one real compare (Ray)


@pytest.mark.ray
def test_compare_ddp_and_pipeline_on_lenet_digits(ray_session, tmp_path):
    # One strategy of each Ray runner (Ray Train's ddp, the pipeline's actor group) besides the one-device
    # reference, which trains in this process (the in-process runner): each Ray fit costs ~15 s of start-up here. dp and mp fit through Ray
    # against the plain loop's weights in test_strategies.py
    # (test_each_strategys_fit_ends_with_the_plain_loops_weights), and the report's columns are
    # runner-agnostic (pure tests above).
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", batch_size=128, num_workers=2, use_gpu=False, seed=1,
                          storage_path=str(tmp_path / "runs"))
    report = compare(cfg, strategies=["ddp", "pipeline"], steps=3, warmup_steps=1,
                     memory_budget_bytes=4 * 2**20, out_dir=str(tmp_path / "out"))
    labels = [r.label for r in report.measured()]
    assert labels == [REFERENCE, "ddp", "pipeline"], [(r.label, r.reason) for r in report.rows]
    # Same samples, same initial weights, same maths: the same loss after the same steps.
    assert report.loss_check.startswith("losses agree: 3 runs"), report.loss_check
    assert all(r.loss_agrees for r in report.measured())
    for row in report.measured():
        assert row.samples_per_s > 0 and row.step_time_s > 0 and row.max_batch and row.max_batch >= 128
        assert len(row.peak_memory_bytes) == {"ddp": 2, "pipeline": 2}.get(row.label, 1)
    reference = report.rows[0]
    for row in report.measured()[1:]:  # each speed-up is that run's throughput over the one-device run's
        assert row.speedup == pytest.approx(row.samples_per_s / reference.samples_per_s, rel=1e-9), row.label
    assert report.recommendation.strategy is not None
    table = report.table()
    assert "samples/s" in table and "Recommendation: " in table and "pipeline" in table
    assert pq.read_table(report.paths["parquet"]).num_rows == 3
    png = open(report.paths["chart"], "rb").read()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000


def test_cli_compare_rejects_an_unknown_strategy_before_ray(capsys):
    from raytrain_mgpu.cli import _build_parser, main

    assert "compare" in _build_parser()._subparsers._group_actions[0].choices  # a lost subcommand fails here
    assert main(["compare", "--strategies", "ddp,nope"]) == 2
    assert "unknown name(s) ['nope']. Valid names: ddp, ddp2" in capsys.readouterr().err
