"""LR schedules counted in optimizer steps (``optim.lr_factor``, ``optim.build_scheduler``): ``warmup_steps``, the
``linear`` and ``wsd`` decays to ``min_lr``, the user's own scheduler (``lr_schedule=fn(optimizer, total_steps)``),
and the exact resume of a schedule from a step checkpoint.

The factor curves are pure unit tests; the runs train in this process (the in-process runner, one worker: the engine
every Ray Train worker runs), the LR of every step read from the per-step scalar ``train/lr``.
"""

from __future__ import annotations

import re

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.driver.callbacks import Callback
from raytrain_mgpu.engine.optim import build_scheduler, lr_factor

LR = 0.1


def factors(steps_per_epoch: int, epochs: int, **fields) -> list:
    """``lr_factor`` at every step of a run of ``epochs`` x ``steps_per_epoch`` (or ``max_steps``) steps."""
    optim = rtm.TrainConfig(lr=LR, use_gpu=False, epochs=epochs, **fields).optim
    total = epochs * steps_per_epoch if optim.max_steps is None else min(epochs * steps_per_epoch, optim.max_steps)
    return [lr_factor(step, optim, steps_per_epoch, epochs) for step in range(total)]


# ----------------------------------------------------------------------------- the factor curves


def test_warmup_steps_rise_linearly_to_the_peak_whatever_the_epoch_length():
    for steps_per_epoch in (3, 50):
        got = factors(steps_per_epoch, 2, warmup_steps=4)[:6]
        assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert factors(10, 1, warmup_steps=0) == [1.0] * 10  # 0: no warm-up


def test_linear_falls_from_the_peak_after_warmup_to_min_lr_on_the_last_step():
    got = factors(4, 3, lr_schedule="linear", warmup_steps=2, min_lr=0.01)  # 12 steps: peak at 2, floor at 11
    floor = 0.01 / LR
    assert got[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert got[2:] == pytest.approx([floor + (1 - floor) * (1 - k / 9) for k in range(10)])
    assert got[-1] == pytest.approx(floor)


def test_the_total_is_max_steps_where_it_ends_the_run_first():
    got = factors(4, 3, lr_schedule="linear", max_steps=6)  # 6 steps, not 12
    assert got == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def test_wsd_warms_up_holds_the_peak_then_decays_over_its_last_fraction_to_min_lr():
    # 20 steps: warm-up at steps 0-1, stable 2-14, decay over the last 0.25 x 20 = 5 (15-19), min_lr on step 19
    got = factors(10, 2, lr_schedule="wsd", warmup_steps=2, decay_fraction=0.25, min_lr=0.02)
    floor = 0.02 / LR
    assert got[:2] == pytest.approx([0.5, 1.0])
    assert got[2:15] == [1.0] * 13
    assert got[15:] == pytest.approx([floor + (1 - floor) * left for left in (0.8, 0.6, 0.4, 0.2, 0.0)])
    assert factors(10, 2, lr_schedule="wsd")[17:] == pytest.approx([1.0, 0.5, 0.0])  # 0.1 x 20: the last 2 steps


def test_cosine_decays_to_the_min_lr_floor_and_never_below():
    got = factors(10, 3, lr_schedule="cosine", warmup_steps=5, min_lr=0.01)  # 30 steps: 5 to 29 decay
    floor = 0.01 / LR
    assert got[4] == pytest.approx(1.0) and got[5] == pytest.approx(1.0)
    assert got[-1] == pytest.approx(floor) and min(got) == pytest.approx(floor)
    assert all(a >= b for a, b in zip(got[5:], got[6:]))
    assert got[5 + 12] == pytest.approx(floor + (1 - floor) * 0.5)  # half way: half the span above the floor


def test_min_lr_is_absolute_so_it_is_a_factor_of_the_scaled_peak():
    # lr 0.1 scaled x2 by the global batch: the floor 0.01 is 1/20 of the peak 0.2
    got = factors(4, 1, lr_schedule="linear", min_lr=0.01, batch_size=512, base_batch_size=256, lr_scaling="linear")
    assert got[-1] == pytest.approx(0.05)


# ----------------------------------------------------------------------------- the user's scheduler


def one_cycle(optimizer, total_steps):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=total_steps)


def plateau(optimizer, total_steps):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def test_a_user_scheduler_is_called_with_the_optimizer_and_the_runs_total_steps():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    seen = []

    def recording(optimizer, total_steps):
        seen.append((optimizer, total_steps))
        return one_cycle(optimizer, total_steps)

    cfg = rtm.TrainConfig(lr_schedule=recording, use_gpu=False, epochs=3, max_steps=50)
    scheduler = build_scheduler(optimizer, cfg.optim, steps_per_epoch=22, epochs=3)
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) and seen == [(optimizer, 50)]
    with pytest.raises(ValueError, match=r"lr_schedule='test_lr_schedules:plateau': plateau\(optimizer, "
                                         r"total_steps=66\) returned a ReduceLROnPlateau, not a torch.optim"):
        build_scheduler(optimizer, rtm.TrainConfig(lr_schedule=plateau, use_gpu=False, epochs=3).optim, 22, 3)


class StepLRs(Callback):
    """The LR each optimizer step used (``train/lr``, sent every step with ``log_every_n_steps=1``): the last
    value for a step sent twice (steps trained again after a restart)."""

    def __init__(self):
        self.lrs: dict = {}

    def on_step(self, step, scalars):
        self.lrs[step] = scalars["train/lr"]


# No BatchNorm or dropout, so runs that see the same batches agree bit for bit (tests/test_step_checkpoints.py).
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, optimizer="sgd", lr=LR,
           momentum=0.9, seed=3, epochs=2, log_every_n_steps=1)
STEPS = 2 * (1438 // 64)  # 44: 2 epochs of digits' train split at global batch 64


def train(fields: dict) -> tuple:
    """``(weights, {step: lr})`` of a one-worker run in this process."""
    from _reference import train_one_worker

    recorder = StepLRs()
    weights = train_one_worker({**MLP, **fields, "callbacks": [recorder]})[0]
    return weights, recorder.lrs


def test_a_user_scheduler_sets_the_lr_of_every_step():
    _, lrs = train(dict(lr_schedule=one_cycle))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    reference = one_cycle(optimizer, STEPS)
    want = []
    for _ in range(STEPS):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert sorted(lrs) == list(range(1, STEPS + 1))
    assert [lrs[step] for step in range(1, STEPS + 1)] == pytest.approx(want, rel=1e-12)
    assert max(want) == pytest.approx(0.3, rel=0.01) and want[0] < 0.02  # OneCycle's shape, not the config's lr


@pytest.mark.parametrize("schedule", [dict(lr_schedule=one_cycle),
                                      dict(lr_schedule="wsd", warmup_steps=6, decay_fraction=0.5, min_lr=0.001)],
                         ids=["one_cycle", "wsd"])
def test_a_run_stopped_mid_way_resumes_its_schedule_exactly_from_a_step_checkpoint(schedule):
    """A fault after step 35 (the engine's step hook); the restart resumes from the step-30 checkpoint, inside
    epoch 2 and the wsd decay (steps 23-44): the LRs of steps 31-44 and the final weights are the undisturbed
    run's (OneCycleLR also cycles SGD's momentum, which the resume keeps as saved)."""
    from _failing_models import fault_once_after_step

    fields = dict(schedule, checkpoint_every_n_steps=5)
    want_weights, want_lrs = train(fields)
    with fault_once_after_step(35) as steps:
        got_weights, got_lrs = train({**fields, "max_failures": 1})
    assert steps == list(range(1, 36)) + list(range(31, STEPS + 1))  # resumed at step 30
    assert len({want_lrs[step] for step in range(31, STEPS + 1)}) == STEPS - 30  # it moves at every resumed step
    assert got_lrs == want_lrs
    for key in want_weights:
        assert torch.equal(got_weights[key], want_weights[key]), key


# ----------------------------------------------------------------------------- refusals, before anything runs


def wants_warmup(optimizer, total_steps, warmup):
    return one_cycle(optimizer, total_steps)


@pytest.mark.parametrize("fields,message", [
    (dict(warmup_steps=100, warmup_epochs=1.0),
     "TrainConfig.warmup_steps=100: and warmup_epochs=1.0 both set the warm-up. Set one of them"),
    (dict(warmup_steps=2.5), "TrainConfig.warmup_steps=2.5: must be a whole number of optimizer steps >= 0, or None"),
    (dict(lr_schedule="cosine", min_lr=0.1), "TrainConfig.min_lr=0.1: must be below the peak LR, lr=0.1. Set min_lr "
                                             "below it"),
    (dict(min_lr=0.15, batch_size=512, lr_scaling="linear"), None),  # the peak is lr after scaling: 0.2
    (dict(min_lr=0.06, batch_size=64, lr_scaling="linear"),
     "TrainConfig.min_lr=0.06: must be below the peak LR, lr=0.1 (0.025 after lr_scaling='linear')"),
    (dict(min_lr=-0.01), "TrainConfig.min_lr=-0.01: must be a finite number >= 0"),
    (dict(lr_schedule="wsd", decay_fraction=0.0), "TrainConfig.decay_fraction=0.0: must be a finite number in (0, 1]"),
    (dict(lr_schedule="wsd", decay_fraction=1.5), "TrainConfig.decay_fraction=1.5: must be a finite number in (0, 1]"),
    (dict(lr_schedule="wsd", decay_fraction=1.0), None),
    (dict(lr_schedule="lineer"), "TrainConfig.lr_schedule='lineer': is not one of ['constant', 'step', 'cosine', "
                                 "'linear', 'wsd'] or a 'package.module:function'. Did you mean 'linear'?"),
    (dict(lr_schedule=wants_warmup),
     "TrainConfig.lr_schedule='test_lr_schedules:wants_warmup': must take (optimizer, total_steps), as the engine "
     "calls it, but its signature is wants_warmup(optimizer, total_steps, warmup)"),
    (dict(lr_schedule="test_lr_schedules:wants_warmup"), "must take (optimizer, total_steps), as the engine calls it"),
    (dict(lr_schedule="no_such_module:schedule"), "TrainConfig.lr_schedule='no_such_module:schedule': cannot import "
                                                  "module 'no_such_module'"),
    (dict(lr_schedule=one_cycle, warmup_steps=10),
     "TrainConfig.lr_schedule='test_lr_schedules:one_cycle': is your own scheduler, which owns the LR, and "
     "warmup_steps=10 would shape it too. Build the warm-up and the floor into your scheduler"),
    (dict(lr_schedule=one_cycle, warmup_epochs=0.5, min_lr=0.001),
     "warmup_epochs=0.5, min_lr=0.001 would shape it too. Build the warm-up and the floor into your scheduler "
     "(e.g. torch.optim.lr_scheduler.SequentialLR of a LinearLR warm-up and your decay), and leave warmup_steps, "
     "warmup_epochs and min_lr unset."),
    (dict(lr_schedule="test_lr_schedules:one_cycle"), None),
])
def test_schedule_fields_are_checked_when_the_config_is_built(fields, message):
    if message is None:
        rtm.TrainConfig(lr=LR, use_gpu=False, **fields)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        rtm.TrainConfig(lr=LR, use_gpu=False, **fields)


def test_a_user_scheduler_travels_to_the_ray_workers_like_the_other_code_fields():
    import threading

    from raytrain_mgpu.config.factories import check_objects_ship

    lock = threading.Lock()  # cannot be pickled: the check names the field before Ray starts

    def holds_a_lock(optimizer, total_steps):
        with lock:
            return one_cycle(optimizer, total_steps)

    check_objects_ship(rtm.TrainConfig(lr_schedule=one_cycle, use_gpu=False))
    with pytest.raises(ValueError, match=r"TrainConfig.lr_schedule='test_lr_schedules:test_a_user_scheduler_travels"
                                         r".*holds_a_lock' cannot be sent to the Ray workers"):
        check_objects_ship(rtm.TrainConfig(lr_schedule=holds_a_lock, use_gpu=False))


def test_a_user_scheduler_is_recorded_and_refused_in_a_config_file_without_allow_code(tmp_path):
    cfg = rtm.TrainConfig(lr_schedule=one_cycle, use_gpu=False)
    assert cfg.to_dict()["lr_schedule"].startswith("<object test_lr_schedules:one_cycle sha256:")
    path = tmp_path / "run.yaml"
    path.write_text("lr_schedule: test_lr_schedules:one_cycle\nuse_gpu: false\n")
    with pytest.raises(ValueError, match=r"lr_schedule='test_lr_schedules:one_cycle' names code to run"):
        rtm.TrainConfig.from_yaml(path)
    assert rtm.TrainConfig.from_yaml(path, allow_code=True).lr_schedule == "test_lr_schedules:one_cycle"
