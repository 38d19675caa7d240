"""Features of the step loop that live in the engine alone and reach every runner with no runner code: the
gradient norm's epoch column, time-based step checkpoints, evaluation every N steps; a resumed pipeline run that
restores every random generator it saved (CUDA's too, through the functions every runner uses) and ends with the
uninterrupted run's weights; fp16's overflows and ``on_nonfinite="skip"`` skip a step on every stage of a pipeline
alike when one stage's gradients are not finite.

Each runs in a data-parallel run (the in-process runner: the engine a Ray Train worker runs) and in a 2-stage
pipeline (the stages as local processes, tests/_pipeline_local.py: the engine a stage actor runs). No Ray.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

import raytrain_mgpu as rtm
from _pipeline_local import LocalRun, run_local
from raytrain_mgpu.driver.callbacks import Callback

# 12 steps an epoch of 24 samples, 2 micro-batches: the check of checkpoint_every_n_minutes comes at step 10
PIPE = dict(model="mlp", dataset="synthetic", input_shape=[12], num_classes=5, num_samples=288,
            model_kwargs={"widths": [24, 24]}, batch_size=24, num_microbatches=2, strategy="pipeline", num_stages=2,
            cpus_per_worker=1, epochs=1, use_gpu=False, num_workers=1)
DP = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=1,
          use_gpu=False)  # 22 steps


class Scalars(Callback):
    """The per-step scalars the driver received."""

    def __init__(self):
        self.seen: list = []

    def on_step(self, step, scalars):
        self.seen.append((step, scalars))


def _in_process(storage: str, **fields) -> tuple:
    scalars = Scalars()
    cfg = rtm.TrainConfig(**{**DP, **fields, "num_workers": 1, "runner": "local", "storage_path": storage,
                             "callbacks": [scalars]})
    return rtm.fit(cfg, stream=io.StringIO()), scalars.seen


def _pipeline(num_steps: int = 12, **fields):
    (result,) = run_local([LocalRun(rtm.TrainConfig(**{**PIPE, **fields}), num_steps, record=True)])
    return result


def test_the_gradient_norms_column_reaches_both_runners(tmp_path):
    """``grad_norm``: the epoch's mean of the norm clipping computes (the global norm: over every stage)."""
    result, _ = _in_process(str(tmp_path), grad_clip_norm=1.0)
    assert result.history[0]["grad_norm"] > 0
    unclipped, _ = _in_process(str(tmp_path / "plain"))
    assert "grad_norm" not in unclipped.history[0]  # no norm computed, no column (and no cost)
    stages = _pipeline(grad_clip_norm=1.0)
    rows = [stats["history"][-1] for stats in stages.stats]
    assert rows[0]["grad_norm"] > 0 and rows[0]["grad_norm"] == rows[1]["grad_norm"]  # one norm for the whole model


def test_a_time_based_step_checkpoint_reaches_both_runners(tmp_path):
    """``checkpoint_every_n_minutes``: the ranks compare their clocks at the preemption check's steps (10, 20, ...)
    and write a step checkpoint there when any says it is due (here at once: a tiny interval)."""
    _in_process(str(tmp_path), checkpoint_every_n_minutes=1e-9, num_checkpoints_to_keep=10)
    assert (tmp_path / "mlp-digits-ddp" / "checkpoint_epoch000000_step000000020").is_dir()
    assert not (tmp_path / "mlp-digits-ddp" / "checkpoint_epoch000000_step000000015").exists()
    stages = _pipeline(checkpoint_every_n_minutes=1e-9, num_checkpoints_to_keep=10)
    run = Path(stages.stats[0]["storage"]) / "local"
    assert (run / "checkpoint_epoch000000_step000000010").is_dir(), sorted(p.name for p in run.iterdir())
    nothing = _pipeline(num_checkpoints_to_keep=10)
    assert not list((Path(nothing.stats[0]["storage"]) / "local").glob("*_step*"))


def test_evaluation_every_n_steps_reaches_both_runners(tmp_path):
    """``eval_every_n_steps``: the test split's loss and accuracy as per-step scalars at steps N, 2N, ..."""
    result, seen = _in_process(str(tmp_path), eval_every_n_steps=5)
    at = [(step, round(values["test/loss"], 6)) for step, values in seen if "test/loss" in values]
    assert [step for step, _ in at] == [5, 10, 15, 20] and "test/accuracy" in dict(seen)[20]
    assert result.history[0]["eval_s"] > 0
    stages = _pipeline(eval_every_n_steps=5)
    events = [payload for stats in stages.stats for kind, payload in stats["events"] if kind == "scalars"]
    assert sorted(step for step, values in events if "test/loss" in values) == [5, 10]


def _fake_cuda_generators(rank: int) -> None:
    """In a stage's process: CUDA 'available' with one generator, whose state is a rank's own bytes; what restore
    sets is written to ``$RNG_LOG/rank{rank}`` (the functions every runner saves and restores through)."""
    log = Path(os.environ["RNG_LOG"]) / f"rank{rank}"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_rng_state_all = lambda: [torch.tensor([rank, 7, 7], dtype=torch.uint8)]
    torch.cuda.set_rng_state_all = lambda states: log.write_text(",".join(str(v) for v in states[0].tolist()))


LM = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=24, num_samples=72,
          model_kwargs={"num_layers": 2, "hidden": 16, "num_heads": 2, "dropout": 0.3}, batch_size=24,
          num_microbatches=2, strategy="pipeline", num_stages=2, cpus_per_worker=1, epochs=1, optimizer="sgd",
          use_gpu=False, num_workers=1)


def test_a_resumed_pipeline_restores_every_generator_and_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    """3 steps an epoch; dropout draws from each stage's stream. Stopped after epoch 1 and resumed to epoch 2 equals
    2 epochs at once, bit for bit; each stage's saved CUDA generator (faked here) came back to that stage."""
    monkeypatch.setenv("RNG_LOG", str(tmp_path))
    cfg = rtm.TrainConfig(**LM)
    storage = str(tmp_path / "runs")
    run_local([LocalRun(cfg, 3, storage=storage, prepare=_fake_cuda_generators)])
    assert not list(tmp_path.glob("rank*"))  # a new run restores nothing
    (resumed,) = run_local([LocalRun(cfg, 6, storage=storage, prepare=_fake_cuda_generators)])
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["0,7,7", "1,7,7"]
    (straight,) = run_local([LocalRun(cfg, 6)])
    assert [row["step"] for row in resumed.stats[0]["history"]] == [3, 6]
    for key, value in straight.model_state.items():
        assert torch.equal(resumed.model_state[key], value), key
    (other,) = run_local([LocalRun(cfg.replace(seed=1), 6)])  # the equality above is not trivial
    assert not all(torch.equal(other.model_state[k], v) for k, v in straight.model_state.items())


@pytest.mark.parametrize("fields", [dict(checkpoint_every_n_minutes=0), dict(profile_steps=(3, 2)),
                                    dict(on_nonfinite="drop"), dict(eval_every_n_steps=0)])
def test_the_features_fields_are_checked_before_anything_runs(fields):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{next(iter(fields))}="):
        rtm.TrainConfig(**fields)


# ----------------------------------------------------------------------------- seeing why: traces, FLOPs, MFU


def _profiled_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    engine = make_engine({**DP, "profile_steps": (3, 5), "storage_path": out, "name": "profiled"}, rank=rank,
                         world=world, setup=False)
    engine.run()
    torch.save(engine.state.history, f"{out}/history{rank}.pt")


def test_a_two_rank_run_writes_a_trace_per_rank_and_an_mfu_column(tmp_path):
    import json

    import _forkserver
    _forkserver.start_gloo_ranks(_profiled_rank, (str(tmp_path),))
    traces = sorted((tmp_path / "profiled" / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    steps = {event["name"] for event in json.loads(traces[0].read_text())["traceEvents"]
             if event.get("name", "").startswith("ProfilerStep#")}
    assert {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"} <= steps
    (row,) = torch.load(tmp_path / "history0.pt", weights_only=False)
    # the MLP (64 -> 16 -> 10) on the global batch of 64 a step: each layer's forward 2 x in x out a sample, its
    # backward twice that, less the first layer's input gradient that nothing needs
    assert row["flops_per_step"] == 64 * (4 * 64 * 16 + 6 * 16 * 10)
    assert row["mfu"] is None  # a CPU has no peak in the table


def test_mfu_is_the_steps_flops_over_the_devices_peak(tmp_path, monkeypatch):
    monkeypatch.setattr("raytrain_mgpu.engine.flops.peak_flops_per_s", lambda device, precision: 1e9)
    result, _ = _in_process(str(tmp_path))
    row = result.history[0]
    assert row["mfu"] == pytest.approx(row["flops_per_step"] * row["step"] / row["training_s"] / 1e9)


# ----------------------------------------------------------------------------- fp16 in a pipeline


def _overflow_on_stage_0_at_step_2(rank: int) -> None:
    """In a stage's process: stage 0's gradients overflow at step 2 only (its own: the last stage's are finite);
    every optimizer step's 'did the weights move' and the scale after it go to ``$FP16_LOG/rank{rank}``."""
    from raytrain_mgpu.pipeline.steps import PipelineSteps
    from raytrain_mgpu.engine.step import OptimizerStep

    log = Path(os.environ["FP16_LOG"]) / f"rank{rank}"
    train_step, end_step, steps = PipelineSteps.train_step, OptimizerStep.__call__, []

    def poisoned(self, *args):
        train_step(self, *args)
        steps.append(1)
        if rank == 0 and len(steps) == 2:
            for p in self.params:
                p.grad.fill_(float("inf"))

    def recorded(self, step):
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        out = end_step(self, step)
        moved = any(not torch.equal(a, p) for a, p in zip(before, params))
        with open(log, "a") as f:
            f.write(f"{step} {moved} {self.scaler.get_scale()}\n")
        return out

    PipelineSteps.train_step, OptimizerStep.__call__ = poisoned, recorded


def test_fp16_in_a_pipeline_skips_a_step_every_stage_alike_when_one_stage_overflows(tmp_path, monkeypatch):
    """``16-mixed`` on a 2-stage pipeline (emulated GPUs: the grad scaler on CPU): the last stage scales its loss,
    each stage unscales its own gradients, and the stages agree on an overflow any of them saw: step 2's stage-0
    overflow skips step 2 on both stages and halves both scales, so they stay equal."""
    from raytrain_mgpu.engine.devices import EMULATE_ENV

    monkeypatch.setenv(EMULATE_ENV, "2")
    monkeypatch.setenv("FP16_LOG", str(tmp_path))
    cfg = rtm.TrainConfig(**{**PIPE, "precision": "16-mixed", "use_gpu": True, "optimizer": "sgd"})
    run_local([LocalRun(cfg, 4, prepare=_overflow_on_stage_0_at_step_2)])
    logs = [[line.split() for line in (tmp_path / f"rank{r}").read_text().splitlines()] for r in (0, 1)]
    assert logs[0] == logs[1]  # the same verdict and scale on both stages, step by step
    assert [(step, moved) for step, moved, _ in logs[0]] == [("1", "True"), ("2", "False"), ("3", "True"),
                                                               ("4", "True")]
    scales = [float(scale) for *_, scale in logs[0]]
    assert scales[1] == scales[0] / 2


def test_fp16_in_a_pipeline_trains_with_a_stage_that_has_no_parameters(monkeypatch):
    """Stage 0 holds only the MLP's Flatten: it has no gradients to check for an overflow, yet the stages' agreement
    is a collective it must take part in (else stage 1 waits forever), and its scaler must record the verdict."""
    from raytrain_mgpu.engine.devices import EMULATE_ENV

    monkeypatch.setenv(EMULATE_ENV, "2")
    from raytrain_mgpu.models import build_model

    cfg = rtm.TrainConfig(**{**PIPE, "precision": "16-mixed", "use_gpu": True, "optimizer": "sgd",
                             "balance": [1, 3]})
    result, = run_local([LocalRun(cfg, 3)])
    assert result.partition.params[0] == 0 and result.partition.params[1] > 0
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model, (12,), 5, cfg.model_kwargs).state_dict()
    assert all(torch.isfinite(value).all() for value in result.model_state.values())
    assert any(not torch.equal(initial[key], value) for key, value in result.model_state.items())  # it trained


# ----------------------------------------------------------------------------- on_nonfinite="skip" in a pipeline

NAN_AT = 3  # the optimizer step whose gradients turn NaN on stage 0 alone


def _probe_steps(rank: int, mode: str) -> None:
    """In a stage's process: each optimizer step's 'did this stage's weights move' to ``$SKIP_LOG/{mode}-rank{rank}``.
    ``mode="nan"``: stage 0's gradients are NaN at step NAN_AT (stage 1's finite, as when stage 0's own backward
    overflows); ``"drop"``: every stage's gradients are dropped before that step's optimizer (a run without it)."""
    from raytrain_mgpu.engine.step import OptimizerStep

    log = Path(os.environ["SKIP_LOG"]) / f"{mode}-rank{rank}"
    end_step = OptimizerStep.__dict__.get("unprobed", OptimizerStep.__call__)  # a later run in this process
    OptimizerStep.unprobed = end_step

    def probed(self, step):
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if step == NAN_AT and mode == "nan" and rank == 0:
            for p in params:
                p.grad.fill_(float("nan"))
        if step == NAN_AT and mode == "drop":
            for p in params:
                p.grad = None
        before = [p.detach().clone() for p in params]
        out = end_step(self, step)
        with open(log, "a") as f:
            f.write(f"{step} {any(not torch.equal(a, p) for a, p in zip(before, params))}\n")
        return out

    OptimizerStep.__call__ = probed


def test_skip_in_a_pipeline_skips_a_step_on_every_stage_when_one_stages_gradients_are_nan(tmp_path, monkeypatch):
    """``on_nonfinite="skip"`` on a 2-stage pipeline: stage 0's NaN gradients at step 3 make the global norm NaN, so
    both stages skip step 3 (stage 1's finite gradients too) and train on; the weights are those of the same run
    without step 3's update."""
    import functools

    monkeypatch.setenv("SKIP_LOG", str(tmp_path))
    cfg = rtm.TrainConfig(**{**PIPE, "optimizer": "sgd", "momentum": 0.9})
    skipped, dropped = run_local([
        LocalRun(cfg.replace(on_nonfinite="skip"), 6, prepare=functools.partial(_probe_steps, mode="nan")),
        LocalRun(cfg, 6, prepare=functools.partial(_probe_steps, mode="drop"))])
    logs = [(tmp_path / f"nan-rank{r}").read_text().split() for r in (0, 1)]
    assert logs[0] == logs[1] == [word for step in range(1, 7) for word in (str(step), str(step != NAN_AT))]
    assert [stats["history"][-1]["skipped_steps"] for stats in skipped.stats] == [1, 1]
    assert all(torch.isfinite(value).all() for value in skipped.model_state.values())
    assert skipped.model_state.keys() == dropped.model_state.keys()
    for key, value in dropped.model_state.items():
        assert torch.equal(skipped.model_state[key], value), key


def test_the_runs_end_flushes_rank_0s_events_after_the_last(monkeypatch, tmp_path):
    """``Transport.finish`` flushes rank 0's reporter, once, after its last events (the checkpoint's
    announcement, then the last step reached, for the goodput ledger): the driver's last drain then finds them
    (tests/test_fit.py: what the flush waits for)."""
    from _engine import RecordingSink, make_engine
    from raytrain_mgpu.driver.progress import WorkerReporter

    sink, flushed = RecordingSink(), []
    monkeypatch.setattr(WorkerReporter, "flush", lambda self, timeout_s=0.0: flushed.append(len(sink.events)))
    make_engine({**DP, "storage_path": str(tmp_path), "name": "flushed"}, sink=sink, setup=False).run()
    assert [kind for kind, _ in sink.events[-2:]] == ["checkpoint", "reached"] and flushed == [len(sink.events)]


def test_rank_0_tells_the_driver_the_checkpoint_it_resumed_from(tmp_path):
    """In its start-up event (the Ray Train driver then knows a last checkpoint no save of this fit registered)."""
    from _engine import RecordingSink, make_engine

    fields = {**DP, "storage_path": str(tmp_path), "name": "resumed"}
    first, again = RecordingSink(), RecordingSink()
    make_engine({**fields, "epochs": 1}, sink=first, setup=False).run()
    make_engine({**fields, "epochs": 2}, sink=again, setup=False).run()
    assert first.of("startup")[0]["resumed_from"] is None
    assert again.of("startup")[0]["resumed_from"].rstrip("/").endswith("checkpoint_epoch000001")
