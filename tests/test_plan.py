"""The run plan: derived once from the config and the strategy class (pure, no Ray)."""

import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.strategies.plan import build_plan


@pytest.mark.parametrize("kwargs, replicas, micro, per_step, processes", [
    (dict(strategy="ddp", num_workers=2, batch_size=128), 2, 64, 1, 2),
    (dict(strategy="ddp", num_workers=2, batch_size=128, grad_accum_steps=4), 2, 16, 4, 2),
    (dict(strategy="dp", num_workers=1, gpus_per_worker=2, batch_size=64), 1, 64, 1, 1),
    (dict(strategy="ddp2", num_workers=2, gpus_per_worker=2, batch_size=64), 2, 32, 1, 2),
    (dict(strategy="pipeline", num_workers=1, num_stages=3, num_microbatches=4, batch_size=48), 1, 12, 4, 3),
    (dict(strategy="ddp_pipeline", num_workers=2, num_stages=2, num_microbatches=4, batch_size=64), 2, 8, 4, 4),
])
def test_plan_batch_arithmetic_and_processes(kwargs, replicas, micro, per_step, processes):
    plan = build_plan(TrainConfig(**kwargs, use_gpu=False))
    assert (plan.replicas, plan.micro_batch, plan.micro_batches_per_step, plan.num_processes) == \
        (replicas, micro, per_step, processes)
    assert plan.replicas * plan.micro_batch * plan.micro_batches_per_step == kwargs["batch_size"]
    assert plan.batch_granularity == replicas * per_step


def test_steps_per_epoch_drops_the_remainder_like_the_samplers():
    # 1,437 digits over 2 replicas: 718 each, 64 per micro-batch -> 11 micro-batches -> 5 steps of 2
    plan = build_plan(TrainConfig(strategy="ddp", num_workers=2, use_gpu=False, batch_size=256, grad_accum_steps=2),
                      1437)
    assert plan.steps_per_epoch == 5
    pipe = build_plan(TrainConfig(strategy="ddp_pipeline", num_workers=2, use_gpu=False, num_stages=2, batch_size=64),
                      1437)
    assert pipe.steps_per_epoch == 1437 // 2 // 32


def test_steps_per_epoch_is_the_engines_count_and_refuses_a_split_with_no_full_step():
    from raytrain_mgpu.engine.feed import steps_per_epoch

    cfg = TrainConfig(strategy="ddp", num_workers=2, use_gpu=False, batch_size=256, grad_accum_steps=2)
    for num_train in (256, 1437, 5000):  # the driver's plan and each rank's feed count the same steps
        assert build_plan(cfg, num_train).steps_per_epoch == steps_per_epoch(cfg, num_train, 2, 64 * 2)
    with pytest.raises(ValueError, match=r"batch_size=256 is larger than the training split \(255 samples\)"):
        build_plan(cfg, 255)


def test_gpu_plan_bundles_hold_every_device_of_a_worker():
    plan = build_plan(TrainConfig(strategy="ddp_mp", use_gpu=True, num_workers=2, gpus_per_worker=2, batch_size=64))
    assert plan.bundles == ({"CPU": 1, "GPU": 2},) * 2 and plan.devices_per_worker == 2
    assert "global batch 64 = 2 replica(s) x 32 x 1 accumulation step(s)" == plan.describe()
