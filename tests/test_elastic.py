"""Elastic ``num_workers=(min, max)`` (``strategies/elastic.py``): validation, batch arithmetic, plan, one fit.

The arithmetic is checked for every count against torch's own ``DistributedSampler``: with the
micro-batch fixed by the max count and ``max x grad_accum_steps / W`` accumulation steps, every
count trains the same samples in each optimizer step and the same number of steps per epoch.
The two-node grow/shrink run is ``tests/test_two_node_elastic.py``; an elastic fit that starts with the
room the cluster has (2 of at most 3) and ends with one worker's weights is tests/test_real_cpus.py's.
"""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

import raytrain_mgpu as rtm
from raytrain_mgpu.cli import _build_parser
from raytrain_mgpu.engine.run_state import EPOCH_KEYS, RunState, epoch_row
from raytrain_mgpu.strategies import STRATEGIES
from raytrain_mgpu.strategies.elastic import at_count, worker_range
from raytrain_mgpu.strategies.plan import build_plan



def accumulation_steps(max_workers: int, grad_accum_steps: int, world_size: int) -> int:
    """Micro-steps per optimizer step for each of ``world_size`` workers (the micro-batch fixed by the max)."""
    parts = max_workers * grad_accum_steps
    if parts % world_size:
        raise ValueError(f"{world_size} worker(s) cannot split {parts} micro-batches per step "
                         f"(num_workers max {max_workers} x grad_accum_steps {grad_accum_steps})")
    return parts // world_size

def test_a_range_is_normalised_from_yaml_and_parsed_from_the_cli(capsys):
    assert rtm.TrainConfig(num_workers=[1, 2], batch_size=64).num_workers == (1, 2)
    assert _build_parser().parse_args(["train", "--num-workers", "1-4"]).num_workers == (1, 4)
    assert _build_parser().parse_args(["train", "--num-workers", "3"]).num_workers == 3
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["train", "--help"])
    assert "--num-workers 1-4" in " ".join(capsys.readouterr().out.split())  # documented in --help


@pytest.mark.parametrize("value", [(2, 1), (0, 2), (1, 2, 3), (1.0, 2), (True, 2)])
def test_a_malformed_range_is_refused_with_the_form_to_write(value):
    with pytest.raises(ValueError, match=r"TrainConfig.num_workers=.*an elastic range is \(min, max\) with "
                                         r"1 <= min <= max. Write e.g. num_workers=\(1, 4\)"):
        rtm.TrainConfig(num_workers=value)


@pytest.mark.parametrize("strategy", ["pipeline", "ddp_pipeline", "ddp2", "dp", "mp", "auto"])
def test_strategies_that_are_not_plain_replicas_refuse_a_range_before_ray(strategy):
    with pytest.raises(ValueError, match=rf"num_workers=\(1, 2\) with strategy='{strategy}': an elastic worker "
                                         r"count needs .* \(ddp, ddp_mp, fsdp\). Use one of them, or a fixed "
                                         r"num_workers=2"):
        rtm.TrainConfig(strategy=strategy, num_workers=(1, 2), batch_size=64)


def test_elastic_is_a_class_attribute_of_the_data_parallel_strategies():
    assert sorted(name for name, cls in STRATEGIES.items() if cls.elastic) == ["ddp", "ddp_mp", "fsdp"]


def test_a_batch_some_count_cannot_split_names_the_counts_that_work_and_the_fix():
    with pytest.raises(ValueError) as caught:
        rtm.TrainConfig(num_workers=(1, 3), batch_size=64)
    message = str(caught.value)
    assert message.startswith("TrainConfig.num_workers=(1, 3) with batch_size=64 and grad_accum_steps=1: "
                              "2, 3 worker(s) cannot split it")
    assert "Counts that work: 1, 2; use num_workers=(1, 2) or grad_accum_steps=2 with batch_size=66." in message
    # the fixes it names are accepted
    rtm.TrainConfig(num_workers=(1, 2), batch_size=64)
    rtm.TrainConfig(num_workers=(1, 3), batch_size=66, grad_accum_steps=2)
    with pytest.raises(ValueError, match=r"3 worker\(s\) cannot split it .* use num_workers=\(2, 2\) or "
                                         r"grad_accum_steps=3 with batch_size=72\."):
        rtm.TrainConfig(num_workers=(2, 4), batch_size=64)
    with pytest.raises(ValueError, match=r"elastic_resize_interval_s=-1: must be a number of seconds >= 0"):
        rtm.TrainConfig(elastic_resize_interval_s=-1)


@pytest.mark.parametrize("low,high,batch,accum", [(1, 2, 64, 1), (1, 3, 66, 2), (2, 4, 72, 3), (1, 4, 48, 3)])
def test_every_count_trains_the_same_samples_per_step_and_steps_per_epoch(low, high, batch, accum):
    cfg = rtm.TrainConfig(num_workers=(low, high), use_gpu=False, batch_size=batch, grad_accum_steps=accum)
    micro = batch // (high * accum)
    for num_train in (batch, 1438, 1439, 5 * batch - 1, 997):
        plan = build_plan(cfg, num_train)
        assert plan.steps_per_epoch == num_train // batch
        data = range(num_train)  # the epoch's seeded permutation, as one replica reads it
        positions = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7, drop_last=True))
        for workers in range(low, high + 1):
            steps_of = accumulation_steps(high, accum, workers)
            assert plan.micro_batches_at(workers) == steps_of and workers * micro * steps_of == batch
            # nested floors: floor(floor(N / W) / micro) // A_W == N // B
            assert (num_train // workers // micro) // steps_of == num_train // batch
            shares = [list(DistributedSampler(data, num_replicas=workers, rank=r, shuffle=True, seed=7,
                                              drop_last=True)) for r in range(workers)]
            for step in range(num_train // batch):  # step s trains positions [s*B, (s+1)*B), whatever W
                trained = [i for share in shares for i in share[step * micro * steps_of:(step + 1) * micro * steps_of]]
                assert sorted(trained) == sorted(positions[step * batch:(step + 1) * batch]), (workers, step)


def test_the_plan_holds_min_and_max_and_needs_only_the_mins_bundles():
    cfg = rtm.TrainConfig(num_workers=(1, 3), use_gpu=False, batch_size=66, grad_accum_steps=2, cpus_per_worker=2)
    plan = build_plan(cfg, 1438)
    assert (plan.min_workers, plan.num_processes, plan.replicas, plan.micro_batch) == (1, 3, 3, 11)
    assert plan.bundles == ({"CPU": 2},) and plan.worker_counts == (1, 2, 3)
    assert plan.describe() == ("global batch 66 = workers x micro-batch x accumulation step(s), elastic: "
                               "1 x 11 x 6, 2 x 11 x 3, 3 x 11 x 2")
    with pytest.raises(ValueError, match="4 data shard"):
        plan.micro_batches_at(4)
    fixed = build_plan(rtm.TrainConfig(num_workers=2, use_gpu=False, batch_size=64), 1438)
    assert fixed.min_workers is None and fixed.worker_counts == (2,) and fixed.micro_batches_at(2) == 1
    assert len(fixed.bundles) == 2
    assert fixed.describe() == "global batch 64 = 2 replica(s) x 32 x 1 accumulation step(s)"
    assert worker_range(cfg) == (1, 3) and at_count(cfg, 3).num_workers == 3 and cfg.num_workers == (1, 3)


def test_every_history_row_records_its_workers():
    assert EPOCH_KEYS[:4] == ("epoch", "step", "attempt", "workers")
    row = epoch_row(epoch=0, state=RunState(step=3), lr=0.1, loss_sum=1.0, samples=2, elapsed_s=1.0, steps=3,
                    data_wait_share=0.0, peak_memory_bytes=[0, 0, 0], devices={}, workers=2)
    assert row["workers"] == 2
    pipeline_row = epoch_row(epoch=0, state=RunState(step=3), lr=0.1, loss_sum=1.0, samples=2, elapsed_s=1.0,
                             steps=3, data_wait_share=0.0, peak_memory_bytes=[0, 0, 0], devices={})
    assert pipeline_row["workers"] == 3  # one per process that reported its peak (the pipeline's stage actors)


def test_the_memory_estimate_and_compare_refuse_a_range_naming_the_count_to_use():
    from raytrain_mgpu.planning.compare import compare
    from raytrain_mgpu.planning.memory import device_memory

    cfg = rtm.TrainConfig(model="mlp", dataset="digits", strategy="fsdp", num_workers=(1, 2), use_gpu=False,
                          batch_size=64)
    with pytest.raises(ValueError, match=r"num_workers=\(1, 2\): the memory estimate is for one worker count. "
                                         r"Estimate with num_workers=1"):
        device_memory("fsdp", cfg, profile=None)

    def no_fit(cfg):
        raise AssertionError("compare trained although the range is refused")

    with pytest.raises(ValueError, match=r"compare: TrainConfig.num_workers=\(1, 2\) is an elastic range.*"
                                         r"Pass num_workers=2"):
        compare(cfg, ["ddp"], fit=no_fit)
