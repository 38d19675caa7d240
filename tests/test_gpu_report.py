"""``raytrain-mgpu gpu-report``: the layouts it asks for are valid, and under emulation every part runs."""

from __future__ import annotations

import re

import pytest
import torch

from _emulation_checks import check_devices

from raytrain_mgpu import api
from raytrain_mgpu.bench import gpu_report
from raytrain_mgpu.models import build_model
from raytrain_mgpu.runtime.devices import EMULATE_ENV
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


def test_rows_format_as_readme_table_rows():
    row = gpu_report.Row("what it is", "1.5x", "2 x H100")
    assert gpu_report.format_rows([row]) == "| what it is | 1.5x | `raytrain-mgpu gpu-report` | 2 x H100 |"


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated run; on GPUs run the command itself")
def test_the_strategy_section_runs_every_strategy_under_emulation(ray_session, monkeypatch):
    """Each strategy with use_gpu=True on the session's 4 emulated GPUs, through the report's own fits: it
    finishes, rows name emulation, and each Ray Train run recorded the devices Ray gave it (its fit, kept).
    This is the suite's one emulated fit of every strategy."""
    fits = []
    real_fit = api.fit

    def recording_fit(cfg, stream=None):  # keeps what the report's temporary storage will not
        result = real_fit(cfg, stream=stream)
        fits.append((cfg, result.history[-1], set(result.load_model().state_dict())))
        return result

    monkeypatch.setattr(api, "fit", recording_fit)
    rows = gpu_report.run_report(sections=("strategies",), quick=True)
    assert "not run" not in gpu_report.format_rows(rows)
    for name in gpu_report.STRATEGIES:
        row = next(r for r in rows if r.what.startswith(f"strategy `{name}`"))
        steps = int(re.search(r"finished (\d+) steps", row.figure).group(1))
        assert steps == gpu_report.QUICK.strategy_steps, row
    assert all(r.machine.startswith("EMULATED") for r in rows)

    checked = set()
    for cfg, last, saved_keys in fits:
        # The checkpoint is the plain model's, whatever the strategy wrapped, split or sharded.
        assert saved_keys == set(build_model(cfg.model, cfg.input_shape, cfg.num_classes, cfg.model_kwargs)
                                 .state_dict()), cfg.strategy
        plan = build_plan(cfg)
        if plan.runner != "train_workers":  # the pipeline's stage actors: tests/test_pipeline_nccl.py
            continue
        check_devices(last, plan.num_processes, plan.devices_per_worker)
        assert len(last["peak_memory_bytes"]) == plan.num_processes * plan.devices_per_worker
        checked.add(cfg.strategy)
    ray_train = {name for name in gpu_report.STRATEGIES if get_strategy(name).runner == "train_workers"}
    assert checked == ray_train and {"ddp", "fsdp", "ddp_mp", "dp", "dp_balanced", "mp", "ddp2"} <= checked


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
