"""The pipeline under NCCL's semantics, emulated on gloo (issue 10).

On NCCL a group's communicator is created on its first call, which blocks until every
member makes one; the executor posts receives ahead of need, so without the warm-up of
``raytrain_mgpu.pipeline.p2p`` several schedules hang on their first step on GPUs. Here
local processes (no Ray) run every schedule with that semantics emulated (first use
waits for every member, messages matched in order without tags) and must end with the
same weights as without it; with the warm-up skipped, the emulation turns the hang into
an error naming the ranks. That stage actors on Ray get distinct emulated GPUs is checked on the
killed runs of ``tests/test_pipeline_step_checkpoints.py`` (use_gpu=True: one run for both).
Each local rank runs the engine (``engine/loop.py``) with the stage's step runner, as a stage actor does.
"""

from __future__ import annotations

import re

import pytest
import torch

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.engine.devices import EMULATE_ENV
from _pipeline_local import LocalRun, run_local

STEPS = 2
# 9 blocks: enough for interleaved_1f1b's 8 virtual stages at P = 4
MLP = dict(model="mlp", dataset="synthetic", input_shape=[6], num_classes=3, num_samples=48,
           model_kwargs={"widths": [8] * 8}, batch_size=24, optimizer="sgd", lr=0.1, momentum=0.9,
           cpus_per_worker=1, seed=4, strategy="pipeline", use_gpu=False, num_workers=1)
# (schedule, P, m): m = P and m = 2P for every schedule and P in 2..4
CASES = [(schedule, p, m) for schedule in ("gpipe", "1f1b", "interleaved_1f1b") for p in (2, 3, 4)
         for m in (p, 2 * p)]
# the issue's deadlocking cases first, and one of each schedule: a test each; the rest is one test
FAST = {("gpipe", 2, 2), ("1f1b", 3, 3), ("1f1b", 3, 6), ("interleaved_1f1b", 4, 4), ("interleaved_1f1b", 2, 4),
        ("gpipe", 4, 8)}
REST = [case for case in CASES if case not in FAST]


def config(schedule: str, p: int, m: int, **overrides) -> TrainConfig:
    return TrainConfig(**{**MLP, "num_stages": p, "schedule": schedule, "num_microbatches": m,
                          "name": f"{schedule}-p{p}-m{m}", **overrides})


def runs_both_ways(cases) -> list:
    """Each case with and without NCCL semantics."""
    return [LocalRun(config(*case), STEPS, emulate_nccl=emulate) for case in cases for emulate in (True, False)]


def assert_same_run(results: list, case) -> None:
    """``results``: the two runs of ``case`` from :func:`runs_both_ways`."""
    emulated, plain = results
    assert emulated.error is None and plain.error is None, emulated.error or plain.error
    assert emulated.model_state.keys() == plain.model_state.keys()
    for key, value in plain.model_state.items():  # the same arithmetic in the same order: bit for bit
        torch.testing.assert_close(emulated.model_state[key], value, rtol=0, atol=0, msg=f"{case}: {key}")
    # the epoch's loss, summed over the ranks (the last stage measures it): the same bits too
    loss = [[row["train_loss"] for row in r.stats[0]["history"]] for r in (emulated, plain)]
    assert loss[0] == loss[1] and loss[0][-1] > 0
    assert all(s["steps"] == STEPS for s in emulated.stats)
    assert all(s["nccl_semantics"] for s in emulated.stats) and not any(s["nccl_semantics"] for s in plain.stats)


# Without the warm-up the emulation must catch what hangs on GPUs: the issue's cases.
DEADLOCKS = [("gpipe", 2, 2), ("1f1b", 3, 3), ("interleaved_1f1b", 4, 4)]
DEADLOCK_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def pool():
    """Every run in one pool of local processes: starting them is most of the cost (measured on the
    2-core VM, warm: the 12 cases outside FAST 20 s in a pool of their own, all 18 cases 23 s in one).

    The variable is set for the whole pool (spawned processes inherit it) but only the
    ``use_gpu=True`` run reads it; the others set ``emulate_nccl`` explicitly.
    """
    fast = sorted(FAST)
    runs = runs_both_ways(fast) + runs_both_ways(REST)
    runs.append(LocalRun(config("gpipe", 2, 2, use_gpu=True), 1))
    runs += [LocalRun(config(*case, collective_timeout_s=DEADLOCK_TIMEOUT_S), 1, emulate_nccl=True, skip_warmup=True)
             for case in DEADLOCKS]
    runs.append(LocalRun(config("gpipe", 2, 2), 1, emulate_nccl=False, skip_warmup=True))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATE_ENV, "2")
        # every result arrives within 300 s, or run_local fails: a hang cannot pass. The first comes
        # after 4 processes have started, imported torch and run (42 s measured on the 2-core VM, the
        # next ones 0-5 s apart): 300 s leaves room for a machine 5x slower.
        results = run_local(runs, timeout_s=300, return_errors=True)
    both = fast + REST
    named = {("both", case): results[2 * i:2 * i + 2] for i, case in enumerate(both)}
    named["use_gpu"] = results[2 * len(both)]
    named.update({("deadlock", case): results[2 * len(both) + 1 + i] for i, case in enumerate(DEADLOCKS)})
    named["gloo"] = results[-1]
    return named


@pytest.mark.parametrize("case", sorted(FAST), ids=lambda case: "-".join(map(str, case)))
def test_every_schedule_trains_the_same_under_nccl_semantics(pool, case):
    assert_same_run(pool[("both", case)], case)


def test_every_schedule_p2_to_p4_trains_the_same_under_nccl_semantics(pool):
    for case in REST:
        assert_same_run(pool[("both", case)], case)


def test_cases_cover_every_schedule_and_the_issue_cases():
    assert {(s, p) for s, p, _ in CASES} == {(s, p) for s in ("gpipe", "1f1b", "interleaved_1f1b") for p in (2, 3, 4)}
    assert {("gpipe", 2, 2), ("1f1b", 3, 3), ("interleaved_1f1b", 4, 4)} <= FAST


def test_emulated_gpus_turn_nccl_semantics_on_and_are_recorded(pool):
    """The default: use_gpu under RAYTRAIN_MGPU_EMULATE_GPUS means NCCL semantics, cuda:k and nccl recorded."""
    result = pool["use_gpu"]
    assert result.error is None, result.error
    assert [s["backend"] for s in result.stats] == ["nccl", "nccl"]
    assert all(s["emulated"] and s["devices"] == ["cuda:0"] for s in result.stats)  # no Ray: cuda:0 each
    assert all(torch.isfinite(v).all() for v in result.model_state.values())


@pytest.mark.parametrize("case", DEADLOCKS, ids=lambda case: "-".join(map(str, case)))
def test_without_the_warmup_the_emulation_fails_naming_the_ranks(pool, case):
    error = pool[("deadlock", case)].error
    assert error is not None, f"{case} ran without the warm-up under NCCL semantics: the emulation missed a hang"
    named = (r"the first use of channel [FB] \d->\d of replica 0 \(global ranks \[\d, \d\]\) waited "
             rf"collective_timeout_s={DEADLOCK_TIMEOUT_S:g} s, and rank\(s\) \[\d\] never used it")
    assert re.search(named, error), error


def test_without_nccl_semantics_gloo_hides_the_deadlock(pool):
    """Why the emulation is needed: gloo connects every group in new_group, so this passes."""
    result = pool["gloo"]
    assert result.error is None and all(s["steps"] == 1 for s in result.stats), result.error
