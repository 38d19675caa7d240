"""The engine every transport runs (``engine/loop.py``): the epochs (``run_epochs``, with stand-in epochs),
and features of the step loop that reach every runner with no runner code: an event in ``STEP_EVENTS``, the
gradient norm's epoch column, time-based step checkpoints, evaluation every N steps; a resumed pipeline restores
every random generator it saved, through the same functions as every runner.

The in-process runner and the pipeline's stages (local processes: tests/_pipeline_local.py) run the same engine
as the Ray Train workers and the pipeline's actors do (tests/test_local_runner.py: the same weights).
"""

from __future__ import annotations

import functools
import os

import raytrain_mgpu as rtm
from raytrain_mgpu.engine import loop as engine
from raytrain_mgpu.engine.loop import run_epochs
from raytrain_mgpu.engine.run_state import RunState


def _run(cfg, state=None, losses=None, steps_per_epoch=10, has_val=False) -> tuple:
    """Run ``cfg``'s epochs; each epoch's evaluated loss (val_loss with a validation split, else test_loss) is
    ``losses[epoch]``. What was called, in order: ``("evaluate", epoch)`` for the test split, ``("val", epoch)``."""
    state = state or RunState()
    calls = []

    def train_epoch(epoch):
        calls.append(("train", epoch))
        state.step += steps_per_epoch
        return {"epoch": epoch + 1, "step": state.step, "test_loss": None}

    def evaluate(split):
        calls.append(("evaluate" if split == "test" else split, state.epoch))
        return {f"{split}_loss": (losses or {}).get(state.epoch - 1, 1.0)}

    def end_epoch(row):
        assert state.history[-1] is row  # recorded before it is checkpointed
        calls.append(("end", row["epoch"], "eval_s" in row))

    run_epochs(cfg, state, train_epoch, evaluate, end_epoch, has_val=has_val)
    return state, calls


def test_epochs_are_evaluated_every_eval_every_epochs_and_at_the_last():
    state, calls = _run(rtm.TrainConfig(epochs=5, eval_every_epochs=2))
    assert calls == [("train", 0), ("end", 1, False), ("train", 1), ("evaluate", 2), ("end", 2, True),
                     ("train", 2), ("end", 3, False), ("train", 3), ("evaluate", 4), ("end", 4, True),
                     ("train", 4), ("evaluate", 5), ("end", 5, True)]
    assert state.epoch == 5 and [row["epoch"] for row in state.history] == [1, 2, 3, 4, 5]


def test_max_steps_makes_its_epoch_the_last_and_evaluated():
    state, calls = _run(rtm.TrainConfig(epochs=5, eval_every_epochs=3, max_steps=20))
    assert calls == [("train", 0), ("end", 1, False), ("train", 1), ("evaluate", 2), ("end", 2, True)]
    assert state.epoch == 2


def test_an_early_stop_is_evaluated_and_ends_the_run():
    # test_loss improves at epoch 1 only; patience 2: epochs 2 and 3 do not improve, the run stops after 3.
    cfg = rtm.TrainConfig(epochs=8, monitor="test_loss", mode="min", early_stopping_patience=2)
    state, calls = _run(cfg, losses={0: 0.5, 1: 0.6, 2: 0.7})
    assert [c for c in calls if c[0] == "train"] == [("train", 0), ("train", 1), ("train", 2)]
    assert calls[-2:] == [("evaluate", 3), ("end", 3, True)]


def test_a_resumed_run_trains_only_the_epochs_left_and_a_finished_one_none():
    resumed = RunState()
    resumed.epoch, resumed.step, resumed.history = 3, 30, [{"epoch": e} for e in (1, 2, 3)]
    state, calls = _run(rtm.TrainConfig(epochs=4), state=resumed)
    assert calls == [("train", 3), ("evaluate", 4), ("end", 4, True)]
    _, calls = _run(rtm.TrainConfig(epochs=4), state=state)
    assert calls == []


def test_with_a_validation_split_epochs_rank_on_it_and_the_test_split_waits_for_the_last():
    cfg = rtm.TrainConfig(epochs=3, val_fraction=0.2, monitor="val_loss")
    _, calls = _run(cfg, has_val=True)
    assert calls == [("train", 0), ("val", 1), ("end", 1, True), ("train", 1), ("val", 2), ("end", 2, True),
                     ("train", 2), ("val", 3), ("evaluate", 3), ("end", 3, True)]
    _, calls = _run(cfg.replace(test_every_epoch=True), has_val=True)  # test read on every evaluated epoch
    assert [c for c in calls if c[0] != "train"] == [("val", 1), ("evaluate", 1), ("end", 1, True), ("val", 2),
                                                      ("evaluate", 2), ("end", 2, True), ("val", 3),
                                                      ("evaluate", 3), ("end", 3, True)]


def test_an_early_stop_on_the_validation_split_is_the_epoch_the_test_split_is_evaluated():
    # val_loss improves at epoch 1 only; patience 2: the run stops after epoch 3, whose test split is read.
    cfg = rtm.TrainConfig(epochs=8, val_fraction=0.2, monitor="val_loss", early_stopping_patience=2)
    state, calls = _run(cfg, losses={0: 0.5, 1: 0.6, 2: 0.7}, has_val=True)
    assert [c for c in calls if c[0] != "train"] == [("val", 1), ("end", 1, True), ("val", 2), ("end", 2, True),
                                                      ("val", 3), ("evaluate", 3), ("end", 3, True)]
    assert [row.get("test_loss") for row in state.history] == [None, None, 0.7]


def record_step(path: str, step: int) -> None:
    """A test-only engine event: which process took which global step."""
    with open(path, "a") as out:
        out.write(f"{os.getpid()} {step}\n")


def _steps_by_process(path) -> dict:
    taken: dict = {}
    for line in path.read_text().splitlines():
        pid, step = line.split()
        taken.setdefault(int(pid), []).append(int(step))
    return taken


def test_an_event_added_to_the_engine_runs_in_both_runners(tmp_path):
    """A new feature of the loop (here an event in ``engine.STEP_EVENTS``) runs in a data-parallel run and in every
    pipeline stage with no code of either: both end each step with ``engine.OptimizerStep``. (The data-parallel
    run is the in-process runner, the stages local processes: the same engine the workers and actors run.)"""
    from _pipeline_local import LocalRun, run_local
    from _reference import train_one_worker

    event = functools.partial(record_step, str(tmp_path / "ray_train"))
    engine.STEP_EVENTS.append(event)
    try:
        train_one_worker(dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=1))
    finally:
        engine.STEP_EVENTS.remove(event)
    assert _steps_by_process(tmp_path / "ray_train") == {os.getpid(): list(range(1, 1438 // 64 + 1))}

    cfg = rtm.TrainConfig(model="mlp", dataset="synthetic", input_shape=[12], num_classes=5, num_samples=72,
                          model_kwargs={"widths": [24, 24]}, batch_size=24, num_microbatches=2, strategy="pipeline",
                          num_stages=2, cpus_per_worker=1, use_gpu=False, num_workers=1)
    run_local([LocalRun(cfg, 4, step_event=functools.partial(record_step, str(tmp_path / "pipeline")))])
    stages = _steps_by_process(tmp_path / "pipeline")
    assert len(stages) == 2 and os.getpid() not in stages  # each stage's own process
    assert list(stages.values()) == [[1, 2, 3, 4]] * 2


def test_a_checkpoint_of_the_pipelines_earlier_layout_still_resumes(tmp_path):
    """Before one engine served every runner, a pipeline checkpoint had no common ``train_state.pt``: each stage's
    part held its optimizer, the LR schedule and its CPU generator, and ``meta.json`` its partial sums. Such a folder
    is read as a resume point: the stage's optimizer and schedule from its part; the generators re-seeded per rank and
    step (their layout is gone), the partial sums of another shape left out (the row counts the rest)."""
    from types import SimpleNamespace

    import torch

    from raytrain_mgpu.checkpointing import files as ckpt_format
    from raytrain_mgpu.checkpointing.contents import read
    from raytrain_mgpu.checkpointing.store import CheckpointSource

    cfg = rtm.TrainConfig(model="mlp", strategy="pipeline", num_stages=2, batch_size=32)
    folder = tmp_path / "checkpoint_epoch000001_step000000030"
    for p in (0, 1):
        ckpt_format.write_checkpoint(str(folder), meta=None, history=None, part=f"-stage{p}",
                                     model_state={f"{p}.weight": torch.full((2, 2), float(p))},
                                     train_state={"optimizer": {"state": {}, "param_groups": [{"p": p}]},
                                                  "scheduler": {"last_epoch": 30}, "torch_rng": torch.get_rng_state()})
    ckpt_format.write_checkpoint(str(folder), history=[{"epoch": 1}], meta={
        "model": "mlp", "strategy": "pipeline", "epoch": 1, "step": 30, "step_in_epoch": 8, "partition": [2, 2],
        "epoch_partial_per_rank": [{"totals": {}, "meter": None}] * 2})
    steps = SimpleNamespace(part="-stage1", build_on_meta=lambda: False)
    restored = read(cfg, CheckpointSource(str(folder), lambda: __import__("contextlib").nullcontext(str(folder))),
                    steps, rank=1)
    assert (restored.state.epoch, restored.state.step, restored.state.step_in_epoch) == (1, 30, 8)
    assert restored.train_state["optimizer"]["param_groups"] == [{"p": 1}]  # this stage's own part
    assert restored.train_state["scheduler"] == {"last_epoch": 30} and "rng_per_rank" not in restored.train_state
    assert restored.train_state["epoch_partial_per_rank"] is None
    assert set(restored.model_state) == {"0.weight", "1.weight"}  # every stage's weights, merged
