"""Schedules as data: every small (stages, micro-batches) case, without processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_mgpu.pipeline.schedule import (BACKWARD, FORWARD, Action, ScheduleError, build_order,
                                             channel_sequences, check_schedule, format_grid, forward_only,
                                             ideal_bubble_fraction, num_virtual_stages, simulate, stage_rank)

CASES = [(schedule, p, m) for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
         for p in range(1, 5) for m in range(1, 9)
         if not (schedule != "gpipe" and m < p) and not (schedule == "interleaved_1f1b" and m % p)]


def test_action_prints_like_torch():
    assert str(Action(1, FORWARD, 0)) == "1F0"
    assert repr(Action(12, BACKWARD, 3)) == "12B3"


@pytest.mark.parametrize("schedule,p,m", CASES)
def test_every_small_schedule_is_complete_ordered_and_deadlock_free(schedule, p, m):
    order = build_order(schedule, p, m)
    stages = num_virtual_stages(schedule, p)
    # each micro-batch: F then B exactly once per stage, on the rank that holds the stage
    for rank, actions in enumerate(order):
        assert all(stage_rank(a.stage, p) == rank for a in actions)
        for stage in {a.stage for a in actions}:
            for mb in range(m):
                assert actions.index(Action(stage, FORWARD, mb)) < actions.index(Action(stage, BACKWARD, mb))
    assert sorted(a for r in order for a in r) == sorted(
        Action(s, k, i) for s in range(stages) for k in (FORWARD, BACKWARD) for i in range(m))
    # dependencies across stages, checked on the timeline (simulate raises on a deadlock)
    timeline = simulate(order, stages)
    for (stage, kind, mb), start in timeline.starts.items():
        if kind == FORWARD and stage > 0:
            assert start >= timeline.starts[Action(stage - 1, FORWARD, mb)] + 1
        if kind == BACKWARD and stage < stages - 1:
            assert start >= timeline.starts[Action(stage + 1, BACKWARD, mb)] + 1
    # with equal costs the measured bubble is the textbook one
    assert timeline.bubble_fraction() == pytest.approx(ideal_bubble_fraction(schedule, p, m))
    # messages between two ranks are received in the order they are sent (NCCL pairs in order)
    for channel, (sent, received) in channel_sequences(order, stages).items():
        assert sent == received, channel


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 5) for m in range(p, 9)])
def test_1f1b_holds_at_most_p_minus_s_activations(p, m):
    timeline = simulate(build_order("1f1b", p, m))
    assert timeline.max_in_flight == [min(m, p - s) for s in range(p)]
    gpipe = simulate(build_order("gpipe", p, m))
    assert gpipe.max_in_flight == [m] * p  # what 1F1B saves


@pytest.mark.parametrize("p,m", [(p, m) for p in range(1, 5) for m in range(1, 9)])
def test_forward_only_order_covers_every_stage(p, m):
    for stages in (p, 2 * p):
        timeline = simulate(forward_only(p, m, stages), stages)
        assert len(timeline.starts) == stages * m


def test_same_order_as_torch_pipelining():
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    for p in range(1, 5):
        for m in range(p, 9):
            fake = SimpleNamespace(_num_stages=p, _n_microbatches=m)
            ours = {name: build_order(name, p, m) for name in ("gpipe", "1f1b")}
            for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
                theirs = cls._get_pipeline_order(fake)
                for rank in range(p):
                    if name == "1f1b" and rank == p - 1:
                        # torch 2.14's IR for the last rank of 1F1B is off by one (it lists
                        # 1F1 first and a 1F{m}); its runtime runs F0, B0, F1, ... like ours.
                        continue
                    compute = [str(a) for a in theirs[rank] if a is not None and "REDUCE" not in str(a)]
                    assert compute == [str(a) for a in ours[name][rank]], (name, p, m, rank)


def test_deadlocked_order_is_reported_with_the_grid():
    order = build_order("gpipe", 2, 2)
    order[1] = [Action(1, BACKWARD, 0), Action(1, FORWARD, 0), Action(1, FORWARD, 1), Action(1, BACKWARD, 1)]
    message = r"deadlock at time 2: every rank waits \(next actions \[.0B0., .1B0.\]\)\nstep \| rank 0"
    with pytest.raises(ScheduleError, match=message):
        simulate(order)


def test_incomplete_order_is_rejected():
    order = build_order("1f1b", 2, 4)
    order[0].remove(Action(0, BACKWARD, 3))
    with pytest.raises(ScheduleError, match=r"missing \[0B3\]"):
        simulate(order)
    order = build_order("1f1b", 2, 4)
    order[0].append(Action(1, FORWARD, 0))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        simulate(order)


def test_grid_marks_the_failing_action():
    grid = format_grid(build_order("1f1b", 3, 4), mark=Action(1, BACKWARD, 2))
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "|", "rank", "0", "|", "rank", "1", "|", "rank", "2"]
    assert sum(">1B2<" in line for line in lines) == 1
    assert len(lines) == 1 + simulate(build_order("1f1b", 3, 4)).makespan


def test_schedule_errors_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"num_microbatches=2 is smaller than num_stages=4.*num_microbatches >= 4"):
        check_schedule("1f1b", 4, 2)
    check_schedule("gpipe", 4, 2)  # GPipe runs with fewer micro-batches than stages
    with pytest.raises(ValueError, match=r"num_microbatches=6 is not a multiple of num_stages=4.*4 or 8"):
        check_schedule("interleaved_1f1b", 4, 6)
    with pytest.raises(ValueError, match="schedule='zb'"):
        check_schedule("zb", 2, 4)
