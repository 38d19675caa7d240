"""``strategy="auto"``: the choice from the memory estimate and the cluster's devices (pure, no Ray)."""

from __future__ import annotations

import json

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.planning.auto import ClusterInfo, choose_strategy, plan_config, resolve_auto
from raytrain_mgpu.planning.memory import profile_config

# Parameters and AdamW state dominate: 784 -> 1024 -> 1024 -> 10 is about 1.9 M parameters,
# 30 MiB with gradients and optimizer state; activations are small at batch 64.
BIG = dict(model="mlp", model_kwargs={"widths": [1024, 1024]}, dataset="synthetic", input_shape=[1, 28, 28],
           num_classes=10, batch_size=64, optimizer="adamw")
MiB = 2**20


def test_a_small_model_gets_ddp_over_every_device():
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", batch_size=128)
    name, reason, _ = choose_strategy(cfg, ClusterInfo((4,), True, 80 * 2**30))
    assert name == "ddp"
    assert reason.startswith("ddp over all 4 devices: the model fits one device")
    assert "[4 GPU(s) of 80.0 GiB on 1 node(s)]" in reason
    name, reason, _ = choose_strategy(cfg, ClusterInfo((1,), True, 80 * 2**30))
    assert (name, reason.split(":")[0]) == ("ddp", "ddp with one worker (the plain model)")
    # CPU without a budget: nothing to check the estimate against, so it is taken to fit.
    assert choose_strategy(cfg, ClusterInfo((2,), False))[0] == "ddp"


def test_large_outputs_are_named_as_the_reason_against_dp():
    lm = rtm.TrainConfig(model="transformer_lm", dataset="synthetic_text", input_shape=[32], num_classes=8000,
                         model_kwargs={"num_layers": 1, "hidden": 32, "num_heads": 2}, batch_size=64)
    name, reason, _ = choose_strategy(lm, ClusterInfo((2,), True, 80 * 2**30))
    assert name == "ddp" and "are large next to the model's" in reason and "dp (which gathers them" in reason


def test_a_model_over_the_per_device_budget_gets_fsdp_on_one_node_and_pipeline_across_nodes():
    cfg = rtm.TrainConfig(**BIG)
    profile = profile_config(cfg)
    assert profile.state_bytes() > 25 * MiB  # the premise: ddp needs more than the budget below
    name, reason, _ = choose_strategy(cfg, ClusterInfo((4,), True), memory_budget_bytes=20 * MiB, profile=profile)
    assert name == "fsdp", reason
    assert reason.startswith("fsdp: ddp would need") and "over the budget 20 MiB" in reason
    name, reason, _ = choose_strategy(cfg, ClusterInfo((2, 2), True), memory_budget_bytes=20 * MiB, profile=profile)
    assert name == "pipeline" and "splits the model into stages" in reason
    # On CPU the budget is explicit; four worker processes stand in for four devices.
    assert choose_strategy(cfg, ClusterInfo((4,), False), memory_budget_bytes=20 * MiB, profile=profile)[0] == "fsdp"


def test_nothing_fits_is_an_error_that_says_which_batch_would():
    cfg = rtm.TrainConfig(**BIG)
    with pytest.raises(ValueError, match=r"strategy='auto': no strategy fits batch_size=64 into 5 MiB per device "
                                         r"on 2 GPU\(s\).*ddp fits no batch \(its model state alone needs .*Lower "
                                         r"batch_size, raise grad_accum_steps, or add devices"):
        choose_strategy(cfg, ClusterInfo((2,), True), memory_budget_bytes=5 * MiB)
    with pytest.raises(ValueError, match=r"no strategy fits .* on 1 GPU\(s\)"):
        choose_strategy(cfg, ClusterInfo((1,), True), memory_budget_bytes=20 * MiB)


def test_layouts_follow_the_cluster():
    cfg = rtm.TrainConfig(model="mlp", model_kwargs={"widths": [32, 32]}, dataset="digits", batch_size=120)
    eight = ClusterInfo((8,), True, 80 * 2**30)
    assert plan_config(cfg, "ddp", eight).num_workers == 8 and plan_config(cfg, "fsdp", eight).num_workers == 8
    assert plan_config(cfg.replace(batch_size=100), "ddp", eight).num_workers == 5  # 100 splits over 5, not 8
    dp = plan_config(cfg, "dp", eight)
    assert (dp.num_workers, dp.gpus_per_worker) == (1, 8)
    assert plan_config(cfg, "pipeline", eight).num_stages == 4  # Flatten, two blocks, the classifier
    assert plan_config(cfg, "mp", eight).gpus_per_worker == 4
    with pytest.raises(ValueError, match="ddp2 runs one worker per node and needs at least 2 nodes"):
        plan_config(cfg, "ddp2", eight)
    two_nodes = plan_config(cfg, "ddp2", ClusterInfo((4, 4), True))
    assert (two_nodes.num_workers, two_nodes.gpus_per_worker, two_nodes.placement) == (2, 4, "STRICT_SPREAD")


def test_resolve_keeps_the_name_and_records_the_choice():
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", name="my-run", storage_path="/nonexistent/raytrain")
    resolved, record = resolve_auto(cfg, ClusterInfo((2,), False))
    assert (resolved.strategy, resolved.num_workers, resolved.name) == ("ddp", 2, "my-run")
    assert record["auto_strategy"] == "ddp" and record["auto_reason"].startswith("ddp over all 2 devices")


def test_a_resumed_run_keeps_the_strategy_it_started_with(tmp_path):
    checkpoint = tmp_path / "my-run" / "checkpoint_epoch000002"
    checkpoint.mkdir(parents=True)
    started = rtm.TrainConfig(model="lenet", dataset="digits", strategy="pipeline", num_stages=3,
                              num_microbatches=4, name="my-run", storage_path=str(tmp_path))
    (checkpoint / "meta.json").write_text(json.dumps({"strategy": "pipeline", "config": started.to_dict()}))
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", name="my-run", storage_path=str(tmp_path))
    resolved, record = resolve_auto(cfg, ClusterInfo((2,), False))
    assert (resolved.strategy, resolved.num_stages) == ("pipeline", 3)
    assert record == {"auto_strategy": "pipeline",
                      "auto_reason": "resuming: the run keeps the strategy it started with"}


# ----------------------------------------------------------------------------- auto through the config and fit

def test_config_accepts_auto_and_a_budget_with_units():
    cfg = rtm.TrainConfig(strategy="auto", memory_budget_bytes="4MiB")
    assert cfg.name == "lenet-digits-auto" and cfg.memory_budget_bytes == 4 * MiB
    with pytest.raises(ValueError, match=r"TrainConfig.memory_budget_bytes='lots' is not a size"):
        rtm.TrainConfig(strategy="auto", memory_budget_bytes="lots")


def test_a_resumed_run_keeps_the_tensor_groups_it_started_with(tmp_path):
    """auto chose fsdp with tensor groups (plain fsdp did not fit): the resume keeps the groups, not plain fsdp."""
    checkpoint = tmp_path / "lm-run" / "checkpoint_epoch000001"
    checkpoint.mkdir(parents=True)
    lm = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=24,
              model_kwargs={"num_layers": 2, "hidden": 16, "num_heads": 4}, name="lm-run", storage_path=str(tmp_path))
    started = rtm.TrainConfig(**lm, strategy="fsdp", num_workers=2, tensor_parallel_size=2)
    (checkpoint / "meta.json").write_text(json.dumps({"strategy": "fsdp", "config": started.to_dict()}))
    resolved, _ = resolve_auto(rtm.TrainConfig(**lm), ClusterInfo((2,), False))
    assert (resolved.strategy, resolved.num_workers, resolved.tensor_parallel_size) == ("fsdp", 2, 2)


def test_fsdp_offers_no_tensor_groups_where_the_cluster_has_no_device():
    from raytrain_mgpu.planning.auto import layouts

    cfg = rtm.TrainConfig(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=24)
    assert layouts(cfg, "fsdp", ClusterInfo((0,), True)) == ({},)  # GPUs asked for, none there: no bare max() error
    assert {"tensor_parallel_size": 2, "num_workers": 2} in layouts(cfg, "fsdp", ClusterInfo((2,), True))
