"""A stuck rank is named from the ranks' heartbeats (engine/liveness.py): the judge's rules on beats made here,
and the position an in-process run's engine keeps. The Ray Train run with a rank stuck for ever, named with the
default threshold, is tests/test_cluster_failures.py's."""

from __future__ import annotations

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.engine.liveness import POSITION, Beat, Judge, stacks


def _beat(rank, step, seq, phase="forward", group="g1", stack=None, step_time_s=0.1, world_size=2):
    return Beat(group, rank, world_size, step, seq, phase, node=f"10.0.0.{rank + 1}", node_id=f"n{rank}",
                pid=100 + rank, step_time_s=step_time_s, stack=stack)


def _feed(judge, beats_at):
    """``beats_at``: ``[(time, beat), ...]`` in order; the judge's finding after each, the first one kept."""
    for now, beat in beats_at:
        judge.add(beat, now)
        found = judge.stall(now)
        if found is not None:
            return now, found
    return None, None


def test_a_rank_behind_the_others_is_named_after_the_threshold_with_its_stacks():
    # DDP: rank 1 stopped in its forward of step 20; rank 0 went on to its backward (waiting in the all-reduce)
    judge = Judge(timeout_s=60)
    beats = [(t, _beat(0, 20, 3, "backward")) for t in range(0, 100, 10)]
    beats += [(t + 1, _beat(1, 20, 2, "forward", stack="File user.py, in step: time.sleep" if t >= 20 else None))
              for t in range(0, 100, 10)]
    when, stall = _feed(Judge(timeout_s=60), sorted(beats, key=lambda b: b[0]))
    assert stall is not None and stall.ranks == [1] and when == 70  # the first beat after 60 s of standing still
    assert "rank 1 (node 10.0.0.2, pid 101) at step 20 (forward)" in stall.line
    assert "no progress while another rank stands further on for 60 s" in stall.line
    assert "time.sleep" in stall.report
    assert judge.stall(200) is None  # never fed: nothing to judge


def test_ranks_that_all_stand_at_the_same_place_are_not_judged():
    # a long checkpoint write or evaluation: every rank at the same mark, nobody behind
    beats = sorted([(t + r, _beat(r, 20, 5, "checkpoint")) for t in range(0, 600, 10) for r in (0, 1)],
                   key=lambda b: b[0])
    assert _feed(Judge(timeout_s=60), beats) == (None, None)


def test_moving_ranks_are_not_judged_and_a_new_attempt_starts_afresh():
    judge = Judge(timeout_s=30)
    beats = [(t + r, _beat(r, t // 10, 1)) for t in range(0, 300, 10) for r in (0, 1)]
    assert _feed(judge, sorted(beats, key=lambda b: b[0])) == (None, None)
    # a new group (a restart): the old group's ranks are forgotten, its late beats ignored once it was judged
    judge.add(_beat(0, 40, 1, group="g2"), 400)
    assert set(judge.ranks) == {0} and judge.stall(1000) is None  # rank 1 of g2 has not beaten yet


def test_a_pipeline_stage_that_works_while_the_others_wait_for_it_is_the_stuck_one():
    # stage 0 stands in its forward of micro-batch 1 at a higher mark count than stage 1, which waits to receive
    beats = sorted([(t, _beat(0, 7, 9, "action 0F1")) for t in range(0, 200, 10)]
                   + [(t + 1, _beat(1, 7, 4, "waiting: stage 1, action 1F1, waiting for its input"))
                      for t in range(0, 200, 10)], key=lambda b: b[0])
    when, stall = _feed(Judge(timeout_s=60), beats)
    assert stall.ranks == [0] and "no progress while the other ranks wait for it" in stall.line


def test_a_rank_whose_heartbeats_stop_while_the_others_beat_is_named():
    beats = sorted([(t, _beat(0, t // 10, 1)) for t in range(0, 200, 10)] + [(0.5, _beat(1, 0, 1))],
                   key=lambda b: b[0])
    when, stall = _feed(Judge(timeout_s=60), beats)
    assert stall.ranks == [1] and when == 70 and "its heartbeats stopped" in stall.line
    assert "no stacks (its heartbeats stopped)" in stall.report


def test_the_default_threshold_is_120_s_or_20_median_steps_and_0_turns_it_off():
    judge = Judge()
    judge.add(_beat(0, 1, 1, step_time_s=None), 0)
    assert judge.threshold_s() == 120
    judge.add(_beat(0, 1, 1, step_time_s=9.0), 1)
    judge.add(_beat(1, 1, 1, step_time_s=11.0), 1)
    assert judge.threshold_s() == pytest.approx(200.0)  # 20 x the median 10 s
    off = Judge(timeout_s=0)
    beats = [(t, _beat(0, 20, 3)) for t in range(0, 1000, 10)] + [(t, _beat(1, 20, 2)) for t in range(0, 1000, 10)]
    assert _feed(off, sorted(beats, key=lambda b: b[0])) == (None, None)


def test_an_in_process_run_keeps_its_position_and_whether_it_stepped(storage):
    cfg = rtm.TrainConfig(model="mlp", dataset="digits", num_workers=1, use_gpu=False, epochs=1, batch_size=128,
                          storage_path=storage, name="position", runner="local")
    result = rtm.fit(cfg)
    assert POSITION.stepped and POSITION.step == result.metrics["step"] - 1  # in the last step when it ended
    assert len(POSITION.step_times) == min(result.metrics["step"], 64) and POSITION.median_step_s() > 0
    assert "Thread" in stacks()


def test_a_rank_that_cannot_write_the_storage_fails_before_its_first_step_naming_node_path_and_cause(storage,
                                                                                                   tmp_path):
    from raytrain_mgpu.transports.base import check_writable
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run folder's parent should be")  # as a mount point that is not a folder
    folder = RunFolder(str(blocked / "run"))
    with pytest.raises(OSError, match=r"node 10\.0\.0\.3 cannot write and read TrainConfig.storage_path: "
                                      r".*blocked/run \((FileExistsError|NotADirectoryError|OSError): .*\)\. "
                                      r"Checkpoints would fail there\. Mount the storage on every node") as refused:
        check_writable(folder, "10.0.0.3")
    assert refused.value.errno is not None  # kept: the retry policy reads it (a read-only mount is not retried)
    check_writable(RunFolder(str(tmp_path / "fine" / "run")), "10.0.0.3")  # writes, reads, deletes
    assert list((tmp_path / "fine" / "run").iterdir()) == []

    # a rank's engine checks it before its first step (a node that joined later included: every rank, every attempt)
    from _engine import make_engine

    engine = make_engine(dict(model="mlp", dataset="digits", epochs=1, batch_size=128, name="run"),
                         storage=str(blocked), setup=False)
    with pytest.raises(OSError, match="cannot write and read TrainConfig.storage_path"):
        engine.run()
    assert not POSITION.stepped and POSITION.phase == "setup"  # not a step, not a checkpoint's late failure


def test_a_storage_that_refuses_writes_is_not_retried_but_a_hiccup_is():
    import errno

    from raytrain_mgpu.transports.retry import verdict

    for refused in (errno.EROFS, errno.EACCES, errno.EPERM):
        assert not verdict(OSError(refused, "node 10.0.0.3 cannot write and read ...")).retryable, refused
    assert verdict(OSError(errno.EIO, "a hiccup")).retryable
    assert verdict(OSError("no errno")).retryable
