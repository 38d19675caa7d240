"""The step profiler (raytrain_mgpu/engine/profiling.py) on a tiny CPU loop: which steps a trace holds,
one file per rank, a run that ends inside the window, a window never reached. No GPU, no Ray."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raytrain_mgpu.engine.profiling import StepProfiler


def _train(profiler: StepProfiler, steps: int, start: int = 0) -> None:
    """A tiny loop that calls the profiler as the engine does: after every optimizer step, then close()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start + 1, start + steps + 1):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        profiler.after_step(step)
    profiler.close()


def _traces(folder) -> list:
    return sorted(name for name in os.listdir(folder) if name.endswith(".pt.trace.json")) if folder.exists() else []


def _profiled_steps(path) -> set:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the steps' operators are in it
    return {int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")}


def test_a_window_inside_the_run_writes_one_trace_per_rank_holding_its_steps(tmp_path):
    out = tmp_path / "profile"
    for rank in (0, 1):
        profiler = StepProfiler(str(out), rank, first_step=2, last_step=4, device_type="cpu")
        _train(profiler, steps=6)
        assert profiler.trace_path == str(out / _traces(out)[rank])
    names = _traces(out)
    assert [name.split(".")[0] for name in names] == ["rank0", "rank1"]  # tensorboard_trace_handler's names
    for name in names:
        assert _profiled_steps(out / name) == {2, 3, 4}  # step 1 was the warm-up: not kept


def test_a_run_that_ends_inside_the_window_is_written_by_close(tmp_path):
    profiler = StepProfiler(str(tmp_path), 0, first_step=4, last_step=10, device_type="cpu")
    _train(profiler, steps=6)
    (name,) = _traces(tmp_path)
    # Steps 4-6, and the span that step 6's end opened for step 7: what the run did until close()
    assert _profiled_steps(tmp_path / name) == {4, 5, 6, 7}


@pytest.mark.parametrize("first, last", [(10, 12), (7, 8), (6, 8)])  # (6, 8): the run ends in the warm-up step
def test_a_window_never_reached_writes_nothing(tmp_path, first, last):
    profiler = StepProfiler(str(tmp_path / "never"), 0, first_step=first, last_step=last, device_type="cpu")
    _train(profiler, steps=5)
    assert profiler.trace_path is None and not (tmp_path / "never").exists()


def test_a_window_from_the_first_step_starts_when_built(tmp_path):
    profiler = StepProfiler(str(tmp_path), 0, first_step=1, last_step=2, device_type="cpu")
    _train(profiler, steps=3)
    (name,) = _traces(tmp_path)
    assert _profiled_steps(tmp_path / name) == {1, 2}


@pytest.mark.parametrize("current_step, expected", [(3, {4}), (1, {2, 3, 4}), (4, None), (9, None)])
def test_a_resumed_run_profiles_what_is_left_of_the_window(tmp_path, current_step, expected):
    profiler = StepProfiler(str(tmp_path), 0, first_step=2, last_step=4, device_type="cpu", current_step=current_step)
    _train(profiler, steps=4 - current_step if current_step < 4 else 2, start=current_step)  # to the window's end
    traces = _traces(tmp_path)
    assert (_profiled_steps(tmp_path / traces[0]) if traces else None) == expected


def test_outside_the_window_a_step_does_not_reach_the_profiler(tmp_path, monkeypatch):
    built = []
    real = torch.profiler.profile

    def counting(*args, **kwargs):
        built.append(len(calls))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.profiler, "profile", counting)
    profiler = StepProfiler(str(tmp_path), 0, first_step=50, last_step=50, device_type="cpu")
    calls = []
    for step in range(1, 49):
        calls.append(step)
        profiler.after_step(step)
    assert built == [48] and profiler._profile is not None  # built after step 48: step 49 is the warm-up
    profiler.close()


@pytest.mark.parametrize("first, last", [(0, 3), (5, 4), (2.0, 3)])
def test_a_window_that_is_not_two_ordered_steps_is_refused(tmp_path, first, last):
    with pytest.raises(ValueError, match=r"profile_steps=.*1 <= first <= last"):
        StepProfiler(str(tmp_path), 0, first, last, "cpu")
