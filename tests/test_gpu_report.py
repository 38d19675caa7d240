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
def test_the_whole_report_runs_under_emulation(ray_session, monkeypatch):
    """Every section on the session's 4 emulated GPUs: each strategy and schedule finishes, rows name
    emulation; and each Ray Train strategy's run recorded the devices Ray gave it (its fit, kept)."""
    fits = []
    real_fit = api.fit

    def recording_fit(cfg, stream=None):  # keeps what the report's temporary storage will not
        result = real_fit(cfg, stream=stream)
        fits.append((cfg, result.history[-1], set(result.load_model().state_dict())))
        return result

    monkeypatch.setattr(api, "fit", recording_fit)
    rows = gpu_report.run_report(sections=("strategies", "schedules", "d2l"), quick=True)
    text = gpu_report.format_rows(rows)
    assert "not run" not in text
    for name in gpu_report.STRATEGIES:
        row = next(r for r in rows if r.what.startswith(f"strategy `{name}`"))
        steps = int(re.search(r"finished (\d+) steps", row.figure).group(1))
        assert steps == gpu_report.QUICK.strategy_steps, row
    for schedule in gpu_report.SCHEDULES:
        assert any(f"pipeline `{schedule}`" in r.what and "finished" in r.figure for r in rows)
    assert any("16-mixed vs fp32" in r.what for r in rows) and any("2 GPUs" in r.what for r in rows)
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
