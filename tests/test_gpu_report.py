"""``raytrain-mgpu gpu-report``: the layouts it asks for are valid and its rows are its arithmetic over the
fits' histories; the fits it asks for are the strategies' emulated fits, which other tests run."""

from __future__ import annotations

import pytest
import ray
import torch

from raytrain_mgpu.bench import gpu_report
from raytrain_mgpu.engine.devices import EMULATE_ENV
from raytrain_mgpu.strategies import get_strategy
from raytrain_mgpu.strategies.plan import build_plan


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_every_layout_is_a_valid_config_that_fits_the_gpus(gpus, tmp_path):
    for name in gpu_report.STRATEGIES:
        if name in ("ddp_mp", "ddp_pipeline") and gpus < 2:
            continue
        cfg = gpu_report._strategy_config(name, gpus, gpu_report.QUICK, str(tmp_path))  # validates on construction
        per_worker = cfg.num_stages if name in ("pipeline", "ddp_pipeline") else (
            cfg.gpus_per_worker if name in ("dp", "dp_balanced", "mp", "ddp_mp", "ddp2") else 1)
        assert 1 <= cfg.num_workers * per_worker <= gpus, (name, gpus)
        assert cfg.use_gpu and cfg.num_classes == gpu_report.QUICK.wide_classes
    if gpus >= 2:
        for schedule in gpu_report.SCHEDULES:  # the model splits into every schedule's parts (before Ray)
            cfg = gpu_report._strategy_config("pipeline", gpus, gpu_report.QUICK, str(tmp_path), schedule)
            get_strategy("pipeline").check_model(cfg, cfg.input_shape, cfg.num_classes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_gpus_or_emulation_the_report_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"no CUDA device and {EMULATE_ENV} is not set.*{EMULATE_ENV}=4"):
        gpu_report.run_report()
    monkeypatch.setenv(EMULATE_ENV, "2")
    with pytest.raises(ValueError, match=r"--only nope: unknown section"):
        gpu_report.run_report(sections=("nope",))


def test_the_gpu_tests_row_runs_the_checkouts_tests():
    # The command runs `pytest -m gpu` from CHECKOUT; it pointed one folder too deep (raytrain_mgpu/)
    # until the first GPU run was prepared, so the row said "no tests/ folder" on every machine.
    assert (gpu_report.CHECKOUT / "tests" / "test_gpu_report.py").is_file()
    assert (gpu_report.CHECKOUT / "raytrain_mgpu" / "bench" / "gpu_report.py").is_file()


def test_rows_format_as_readme_table_rows():
    row = gpu_report.Row("what it is", "1.5x", "2 x H100")
    assert gpu_report.format_rows([row]) == "| what it is | 1.5x | `raytrain-mgpu gpu-report` | 2 x H100 |"


def test_the_strategy_section_asks_a_valid_fit_of_every_strategy_and_reports_it(monkeypatch):
    """``run_report``'s strategy section on 4 emulated GPUs: every registered strategy gets a row, each
    config it asks for is a layout the runners accept (the plan), and each row is the report's arithmetic
    over a known history (fit faked: 12.5 ms a step, two devices of 1 and 3 GiB). Each strategy's own
    emulated fit, its row built from it by ``strategy_row``: tests/test_strategies.py (dp, dp_balanced, mp,
    ddp_mp, fsdp); the other emulated fits: tests/test_emulation.py (ddp, ddp2), tests/test_pipeline_nccl.py
    (pipeline, ddp_pipeline)."""
    monkeypatch.setenv(EMULATE_ENV, "4")
    asked = []

    def fake_fit(cfg):
        plan = build_plan(cfg)
        asked.append((cfg, plan))
        row = {"step": 2, "step_time_s": 0.0125, "peak_memory_bytes": [1 << 30, 3 << 30]}
        return [row, row]

    monkeypatch.setattr(gpu_report, "_fit", fake_fit)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as when connected: the report starts no Ray
    shown = []
    rows = gpu_report.run_report(sections=("strategies",), quick=True, on_row=shown.append)
    assert shown == rows and all(r.machine.startswith("EMULATED") for r in rows)
    assert [cfg.strategy for cfg, _ in asked] == list(gpu_report.STRATEGIES)
    assert "not run" not in gpu_report.format_rows(rows)
    for (cfg, plan), row in zip(asked, rows):
        assert row.what.startswith(f"strategy `{cfg.strategy}`, use_gpu=True: {cfg.num_workers} worker(s)")
        assert row.figure == ("finished 2 steps, 12.5 ms a step; peak memory per device 1.00/3.00 GiB "
                              "(max/min 3.00)"), row
        assert cfg.use_gpu and plan.num_processes * plan.devices_per_worker <= 4, cfg.strategy
        assert (cfg.num_samples // cfg.batch_size) == gpu_report.QUICK.strategy_steps
    # With one GPU the strategies that need two say so instead of failing the report.
    one = gpu_report.strategy_rows(1, gpu_report.QUICK, "/tmp/unused", "EMULATED")
    assert {r.what.split("`")[1] for r in one if "not run: needs 2 GPUs" in r.figure} == {"ddp_mp", "ddp_pipeline"}


def test_the_schedule_and_d2l_sections_fit_valid_configs_and_compute_their_ratios(monkeypatch):
    """The other sections' fits are configs the strategy section (and the pipeline and model-zoo tests)
    already train; here each config they build is checked valid and the figures are the report's arithmetic
    over known histories (fits faked: 10 ms a step, 640 or 1280 samples/s)."""
    monkeypatch.setenv(EMULATE_ENV, "4")
    asked = []

    def fake_fit(cfg):
        build_plan(cfg)  # a layout the cluster check and the runners accept
        asked.append(cfg)
        rate = 1280.0 if cfg.precision != "32" or cfg.num_workers == 2 else 640.0
        return [{"step": 4, "step_time_s": 0.01, "samples_per_s": rate, "peak_memory_bytes": [1 << 30]}] * 2

    monkeypatch.setattr(gpu_report, "_fit", fake_fit)
    monkeypatch.setattr(gpu_report, "plain_loop_seconds_per_epoch", lambda cfg: 0.02)
    rows = gpu_report.schedule_rows(4, gpu_report.QUICK, "/tmp/unused", "EMULATED") + \
        gpu_report.d2l_rows(2, gpu_report.QUICK, "/tmp/unused", "EMULATED")
    text = gpu_report.format_rows(rows)
    assert [cfg.schedule for cfg in asked[:3]] == list(gpu_report.SCHEDULES)
    for schedule in gpu_report.SCHEDULES:
        assert any(f"pipeline `{schedule}`" in r.what and "finished 4 steps, 10.0 ms a step" in r.figure for r in rows)
    d2l = asked[3:]
    assert [(c.model, c.num_workers, c.precision) for c in d2l] == [
        ("resnet18", 1, "32"), ("resnet18", 1, "16-mixed"), ("resnet18", 1, "bf16-mixed"), ("resnet18", 2, "32")]
    # 256 samples in batches of 64: 4 steps of 10 ms an epoch; the plain loop 0.02 s: fit 0.50x its speed
    assert "0.0 s/epoch, 640 images/s; plain PyTorch loop 0.0 s/epoch (fit 0.50x its speed" in text
    assert "1,280 vs 640 images/s: 2.00x" in text and "2.00x one GPU" in text


def test_the_scale_section_asks_fsdp_with_and_without_each_option_and_reports_the_ratios(monkeypatch):
    """Issue 26's rows (``--only scale``) on 4 emulated GPUs: a plain sharded transformer LM, the same with
    ``cpu_offload`` and with ``activation_checkpointing``, each a config the runners accept, and rows that are
    the report's arithmetic over known histories (fit faked): the peak and the step time against the plain
    run's, and the checkpoints' stall of every epoch but the last (uploaded before fit returns)."""
    monkeypatch.setenv(EMULATE_ENV, "4")
    asked = []

    def fake_fit(cfg):
        build_plan(cfg)  # a layout the runners accept
        asked.append(cfg)
        peak, step = (1 << 30, 0.02) if cfg.cpu_offload or cfg.activation_checkpointing else (4 << 30, 0.01)
        rows = [{"step": k, "step_time_s": step, "training_s": 0.5, "checkpoint_s": 0.05,
                 "peak_memory_bytes": [peak, peak // 2]} for k in (2, 4, 6)]
        rows[-1]["checkpoint_s"] = 9.0  # the last one: uploaded synchronously, not what an epoch pays
        return rows

    monkeypatch.setattr(gpu_report, "_fit", fake_fit)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    rows = gpu_report.run_report(sections=("scale",), quick=True)
    assert [(c.strategy, c.num_workers, c.cpu_offload, c.activation_checkpointing) for c in asked] == [
        ("fsdp", 4, False, 0), ("fsdp", 4, True, 0), ("fsdp", 4, False, 1)]
    assert len({c.name for c in asked}) == 3  # each run its own folder
    assert [r.what.rsplit(": ", 1)[1] for r in rows] == [
        "cpu_offload=True vs without", "activation_checkpointing=1 vs without",
        "each epoch's checkpoint (sharded, each rank its own shards), the last one left out"]
    for row in rows[:2]:
        assert row.figure == "peak memory per device 1.00 vs 4.00 GiB (0.25x); 20.0 vs 10.0 ms a step (2.00x)"
    assert rows[2].figure == "training stood still 50 ms an epoch (10.0 % of its 0.50 s in steps)"
    assert all(r.machine.startswith("EMULATED") for r in rows)


def test_the_startup_section_measures_before_any_ray_of_its_own_and_reads_as_ratios(monkeypatch):
    """bench-startup's measurement, faked here (three fresh processes, ~30 s): its variants start Rays of
    their own, so a Ray the report started for an earlier section is shut down first."""
    from raytrain_mgpu.bench import startup

    monkeypatch.setenv(EMULATE_ENV, "4")
    up = {"ray": False}
    monkeypatch.setattr(ray, "is_initialized", lambda: up["ray"])
    monkeypatch.setattr(ray, "init", lambda **kwargs: up.update(ray=True))
    monkeypatch.setattr(ray, "shutdown", lambda: up.update(ray=False))
    monkeypatch.setitem(gpu_report.SECTIONS, "strategies", lambda *args: [])  # an earlier section through Ray
    asked = []

    def fake_run(fields, workers, rounds=1):
        asked.append((fields, workers, up["ray"]))
        return {("fit, in-process", 1): [1.0], ("fit, Ray Train", 1): [9.0], ("ray train", 1): [10.0]}

    monkeypatch.setattr(startup, "run", fake_run)
    (row,) = gpu_report.run_report(sections=("strategies", "startup"), quick=True)
    assert asked == [(dict(startup.FIELDS, use_gpu=False), [1], False)]  # the CPU under emulation; no Ray up
    assert row.what == "start-up: seconds to the first step, 1 worker, lenet on digits"
    assert row.figure == ("`fit` in-process 1.0 s (0.10x), `fit` through Ray Train 9.0 s (0.90x); "
                          "a hand-written `TorchTrainer` loop 10.0 s")
    assert row.command == "raytrain-mgpu bench-startup --num-workers 1"
    # On a GPU machine: one GPU worker, and the command says so.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (row,) = gpu_report.startup_rows("1 x GPU")
    assert asked[-1][0]["use_gpu"] is True and row.command.endswith("--num-workers 1 --use-gpu")
    assert row.what == "start-up: seconds to the first step, 1 worker on 1 GPU, lenet on digits"
