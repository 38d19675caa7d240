"""The multi-device strategies: dp, dp_balanced, mp, ddp_mp, ddp2, fsdp.

Three tiers, as everywhere: pure checks (registry, errors, warnings, splits), one-process
checks that each strategy computes the plain model's loss and gradients on CPU "devices"
(a hand-made WorkerContext; a one-rank gloo group where DDP/FSDP need one), and Ray fits
that train through ``fit`` (each ~15 s, so each fit checks several things).
"""

from __future__ import annotations

import copy
import re
import threading
from pathlib import Path

import pytest
import torch
from _emulation_checks import check_devices
from _probe_data import check_hsdp_mesh
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import raytrain_mgpu as rtm
from raytrain_mgpu.bench import gpu_report
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.contents import ASYNC_SHARDED_ENV
from raytrain_mgpu.driver import cluster
from raytrain_mgpu.models import build_model
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy, strategy_names
from raytrain_mgpu.engine.objectives import Predictions
from raytrain_mgpu.engine.precision import capture as autocast_state
from raytrain_mgpu.parallel.placement import SplitModel, call_with_autocast

CPU = torch.device("cpu")
MULTI_DEVICE = ("dp", "dp_balanced", "mp", "ddp_mp", "ddp2", "fsdp")


def _strategy(name: str, devices: int = 1, **overrides):
    cfg = rtm.TrainConfig(strategy=name, num_workers=1, gpus_per_worker=devices, **overrides)
    ctx = WorkerContext(world_rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                        devices=(CPU,) * get_strategy(name).devices_per_worker(cfg))
    return build_worker(get_strategy(name), cfg.parallel, ctx)


def _model(name: str):
    torch.manual_seed(0)
    if name == "transformer_lm":
        return build_model(name, (12,), 50, {"num_layers": 2, "hidden": 16, "num_heads": 2})
    return build_model(name, (1, 8, 8), 10, {"widths": [32, 16]} if name == "mlp" else {})


def _batch(model_name: str, n: int):
    generator = torch.Generator().manual_seed(1)
    if model_name == "transformer_lm":
        return (torch.randint(0, 50, (n, 12), generator=generator),
                torch.randint(0, 50, (n, 12), generator=generator))
    return torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def _step(strategy, model, x, y):
    """Loss, predicted classes and gradients (by parameter name) of one strategy step."""
    wrapped = strategy.setup_model(model)
    loss, logits = strategy.placement.compute_loss(strategy, wrapped, x, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in strategy.unwrap(wrapped).named_parameters()}
    return loss.detach(), logits.detach().argmax(dim=1), grads, wrapped


def _plain_step(model, x, y):
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    return loss.detach(), logits.detach().argmax(dim=1), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_step(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-6, msg=key)




# ----------------------------------------------------------------------------- registry and errors


def test_registry_lists_every_strategy():
    assert set(MULTI_DEVICE) | {"ddp"} <= set(strategy_names())
    with pytest.raises(ValueError, match=r"strategy='ddp3' is not a known strategy. Did you mean 'ddp'\? Valid "
                                         r"names: ") as error:
        rtm.TrainConfig(strategy="ddp3")
    listed = str(error.value).split("Valid names: ")[-1].split(" (auto")[0].split(", ")
    assert set(MULTI_DEVICE) | {"auto"} <= set(listed)


@pytest.mark.parametrize("strategy,instead", [("dp", "ddp2"), ("dp_balanced", "ddp"), ("mp", "ddp_mp")])
def test_single_process_strategies_refuse_several_workers(strategy, instead):
    with pytest.raises(ValueError, match=rf"num_workers=2: strategy='{strategy}' runs in one worker process on "
                                         rf"one node.*Set num_workers=1, or use strategy='{instead}'"):
        rtm.TrainConfig(strategy=strategy, num_workers=2, gpus_per_worker=2)


@pytest.mark.parametrize("overrides,match", [
    (dict(strategy="dp", num_workers=1, gpus_per_worker=2, output_device=2),
     r"output_device=2: must be the local index of one of the worker's gpus_per_worker=2 devices \(0 to 1\)"),
    (dict(strategy="mp", num_workers=1, gpus_per_worker=2, balance=[3, 3, 6]),
     r"balance=\[3, 3, 6\] lists 3 block counts, but gpus_per_worker=2 devices.*one count per device"),
    (dict(strategy="ddp_mp", gpus_per_worker=2, balance="time"),
     r"balance='time' with strategy='ddp_mp'.*Use balance='params'"),
    (dict(strategy="ddp2", use_gpu=True, gpus_per_worker=4),
     r"placement='PACK' with strategy='ddp2' and num_workers=2: ddp2 runs one worker per node.*STRICT_SPREAD"),
    (dict(strategy="ddp2", sync_batchnorm=True),
     r"sync_batchnorm=True with strategy='ddp2'.*Use strategy='ddp'"),
    (dict(strategy="fsdp", precision="16-mixed", use_gpu=True),
     r"precision='16-mixed' with strategy='fsdp'.*Use precision='bf16-mixed'"),
])
def test_bad_combinations_name_field_and_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        rtm.TrainConfig(**overrides)


def test_split_that_leaves_a_device_empty_fails_before_ray():
    # mlp with widths [32] has 3 blocks (Flatten, Linear+ReLU, Linear): 4 devices cannot all get one.
    cfg = rtm.TrainConfig(strategy="mp", num_workers=1, gpus_per_worker=4, model="mlp", model_kwargs={"widths": [32]})
    with pytest.raises(ValueError, match=r"gpus_per_worker=4 is more than the 3 blocks.*Set gpus_per_worker to at most 3"):
        get_strategy("mp").check_model(cfg, (1, 8, 8), 10)
    cfg = cfg.replace(gpus_per_worker=2, balance=[1, 1])
    with pytest.raises(ValueError, match=r"balance=\[1, 1\] must list 2 positive block counts .* summing to the "
                                         r"model's 3 blocks"):
        get_strategy("ddp_mp").check_model(cfg, (1, 8, 8), 10)
    get_strategy("mp").check_model(cfg.replace(balance=[2, 1]), (1, 8, 8), 10)  # fits: no error


@pytest.mark.parametrize("strategy", ["dp", "ddp2"])
def test_gpus_per_worker_larger_than_a_node_is_refused_by_the_cluster_check(strategy, monkeypatch):
    # Two nodes of 4 GPUs; a worker asking for 8 fits on neither.
    monkeypatch.setattr(cluster, "_nodes", lambda: [{"CPU": 16.0, "GPU": 4.0}, {"CPU": 16.0, "GPU": 4.0}])
    monkeypatch.setattr(cluster.ray._private.state.state, "get_max_resources_from_cluster_config", lambda: None)
    cfg = rtm.TrainConfig(strategy=strategy, num_workers=1, use_gpu=True, gpus_per_worker=8)
    bundles = get_strategy(strategy).bundles(cfg)
    assert bundles == [{"CPU": 1, "GPU": 8}]
    with pytest.raises(ValueError, match=rf"strategy='{strategy}'.* 8 GPU.*\(node 0: 16 CPU, 4 GPU; node 1: 16 CPU, "
                                         rf"4 GPU\).*gpus_per_worker"):
        cluster.check_placeable(bundles, True, f"strategy={strategy!r}")
    cluster.check_placeable(get_strategy(strategy).bundles(cfg.replace(gpus_per_worker=4)), True, "fits")


@pytest.mark.parametrize("overrides,option,readers", [
    (dict(strategy="dp", num_workers=1, gpus_per_worker=2, bucket_cap_mb=50), "bucket_cap_mb=50", "ddp, ddp2, ddp_mp"),
    (dict(strategy="ddp", output_device=1), "output_device=1", "ddp2, dp"),
    (dict(strategy="ddp", gpus_per_worker=2), "gpus_per_worker=2", "ddp2, ddp_mp, dp, dp_balanced, mp"),
    (dict(strategy="fsdp", balance=[2, 2]), r"balance=\(2, 2\)", "ddp_mp, ddp_pipeline, mp, pipeline"),
    (dict(strategy="mp", num_workers=1, sync_batchnorm=True), "sync_batchnorm=True", "ddp, ddp_mp, fsdp"),
    (dict(strategy="ddp", num_stages=3), "num_stages=3", "ddp_pipeline, pipeline"),
    (dict(strategy="ddp", cpu_offload=True), "cpu_offload=True", "fsdp"),
    (dict(strategy="pipeline", batch_size=128, bucket_cap_mb=50), "bucket_cap_mb=50", "ddp, ddp2, ddp_mp"),
    (dict(strategy="ddp_pipeline", num_workers=2, batch_size=128, sync_batchnorm=True), "sync_batchnorm=True",
     "ddp, ddp_mp, fsdp"),
])
def test_options_without_effect_are_warned_about_by_name(overrides, option, readers):
    with pytest.warns(UserWarning, match=rf"TrainConfig.{option} has no effect with strategy='{overrides['strategy']}'; "
                                         rf"it is read by .*Remove it, or pick one of those") as record:
        rtm.TrainConfig(**overrides)
    named = str(record[0].message).split("read by ")[1].split(".")[0].split(", ")
    assert named == readers.split(", ")


# ----------------------------------------------------------------------------- one process, CPU devices


def test_dp_over_two_cpu_devices_takes_the_plain_models_step():
    # dp on 2 CPU "devices" scatters the batch over CPU stand-ins (tests/test_dp_multidevice.py
    # checks the scatter itself); through the strategy's compute_loss the step equals the plain one.
    x, y = _batch("lenet", 10)
    want = _plain_step(_model("lenet"), x, y)
    got = _step(_strategy("dp", devices=2), _model("lenet"), x, y)
    _assert_same_step(got[:3], want)


@pytest.mark.parametrize("model_name", ["mlp", "lenet", "transformer_lm"])
@pytest.mark.parametrize("batch", [10, 2])  # 10 on 3 devices: slices 4, 4, 2; 2 on 3: one device idle
def test_dp_balanced_matches_plain_loss_gradients_and_predictions(model_name, batch):
    x, y = _batch(model_name, batch)
    want = _plain_step(_model(model_name), x, y)
    strategy = _strategy("dp_balanced", devices=3)
    loss, predictions, grads, _ = _step(strategy, _model(model_name), x, y)
    _assert_same_step((loss, predictions, grads), want)
    # Only argmax indices travel: the meter gets Predictions, never the logits.
    assert isinstance(strategy.placement.compute_loss(strategy, _model(model_name), x, y)[1], Predictions)


def test_mp_splits_by_parameters_and_matches_plain_gradients():
    x, y = _batch("mlp", 10)
    want = _plain_step(_model("mlp"), x, y)
    strategy = _strategy("mp", devices=3)
    got = _step(strategy, _model("mlp"), x, y)
    _assert_same_step(got[:3], want)
    split = got[3]
    assert isinstance(split, SplitModel) and len(split.block_devices) == 4  # Flatten, 2 x Linear+ReLU, Linear
    # The checkpoint keys are the unsplit model's.
    assert strategy.replication.state_dict(strategy.unwrap(split)).keys() == _model("mlp").state_dict().keys()


def test_mp_explicit_balance_and_a_model_that_places_itself():
    x, y = _batch("mlp", 6)
    want = _plain_step(_model("mlp"), x, y)
    _assert_same_step(_step(_strategy("mp", devices=2, balance=[3, 1]), _model("mlp"), x, y)[:3], want)

    class Net(nn.Module):  # seed 000's two sub-nets, placed by the model itself
        def __init__(self):
            super().__init__()
            self.sub_net1 = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU())
            self.sub_net2 = nn.Linear(16, 10)

        def place(self, devices):
            self.devices = devices
            self.sub_net1.to(devices[0])
            self.sub_net2.to(devices[-1])

        def forward(self, x):
            return self.sub_net2(self.sub_net1(x.to(self.devices[0])).to(self.devices[-1]))

    net = Net()
    wrapped = _strategy("mp", devices=2).setup_model(net)
    assert wrapped is net and net.devices == [CPU, CPU]


def test_autocast_dtype_reaches_replica_threads():
    # Autocast is thread-local: DataParallel's threads would not inherit it.
    layer = nn.Linear(4, 4)
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = autocast_state("cpu")
        plain = threading.Thread(target=lambda: out.setdefault("plain", layer(torch.ones(1, 4))))
        handed = threading.Thread(target=lambda: out.setdefault(
            "handed", call_with_autocast(layer, state, torch.ones(1, 4))))
        for thread in (plain, handed):
            thread.start()
            thread.join()
    assert out["plain"].dtype == torch.float32 and out["handed"].dtype == torch.bfloat16


def test_ddp_unused_parameters_error_names_the_option(gloo_group):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 3)
            self.unused = nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x)

    strategy = _strategy("ddp")
    model = DistributedDataParallel(TwoHeads())
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    strategy.placement.compute_loss(strategy, model, x, y)[0].backward()
    with pytest.raises(RuntimeError, match=r"Parameters that got no gradient: unused.weight, unused.bias. Set "
                                           r"TrainConfig.find_unused_parameters=True .* or static_graph=True"):
        strategy.placement.compute_loss(strategy, model, x, y)


def test_fsdp_on_cpu_with_gloo_matches_plain_and_saves_full_state(gloo_group):
    x, y = _batch("lenet", 8)
    want = _plain_step(_model("lenet"), x, y)
    strategy = _strategy("fsdp")
    model = strategy.setup_model(_model("lenet"))
    loss, logits = strategy.placement.compute_loss(strategy, model, x, y)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    _assert_same_step((loss.detach(), logits.argmax(1), grads), want)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the loop clips sharded (DTensor) gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()
    first_block = model[0]._get_fsdp_state()._fsdp_param_group  # torch keeps the flag private
    with strategy.replication.no_sync(model):
        assert first_block.reduce_grads is False
    assert first_block.reduce_grads is True
    # Checkpoints hold the full, unsharded state under the plain model's keys.
    state = strategy.replication.state_dict(strategy.unwrap(model))
    assert state.keys() == _model("lenet").state_dict().keys()
    assert all(type(v) is torch.Tensor for v in state.values())
    optim_state = strategy.replication.optimizer_state_dict(strategy.unwrap(model), optimizer)
    assert set(optim_state["state"]) == set(state)  # keyed by parameter name, not by shard
    fresh = strategy.setup_model(_model("lenet"))
    strategy.replication.load_state_dict(strategy.unwrap(fresh), state)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    strategy.replication.load_optimizer_state_dict(strategy.unwrap(fresh), fresh_optimizer, optim_state)
    again = strategy.replication.state_dict(strategy.unwrap(fresh))
    assert all(torch.equal(a, b) for a, b in zip(again.values(), state.values()))
    reloaded = strategy.replication.optimizer_state_dict(strategy.unwrap(fresh), fresh_optimizer)["state"]
    assert all(torch.equal(reloaded[k]["momentum_buffer"], v["momentum_buffer"]) for k, v in optim_state["state"].items())


def test_fsdp_cpu_offload_takes_the_same_steps_with_every_shard_under_the_offload_policy(gloo_group):
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from raytrain_mgpu.parallel.replication import allocate, offload_devices, offload_policy

    x, y = _batch("lenet", 8)
    runs = {}
    for offload in (False, True):
        strategy = _strategy("fsdp", cpu_offload=offload)
        model = strategy.setup_model(_model("lenet"))
        groups = [unit._get_fsdp_state()._fsdp_param_group for unit in model.modules() if isinstance(unit, FSDPModule)]
        policies = {type(group.offload_policy) for group in groups if group is not None}  # torch keeps it private
        assert (policies == {CPUOffloadPolicy}) if offload else (CPUOffloadPolicy not in policies), policies
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):  # the second step uses the momentum the first left (on the host when offloaded)
            strategy.placement.compute_loss(strategy, model, x, y)[0].backward()
            optimizer.step()
            optimizer.zero_grad()
        replication = strategy.replication
        runs[offload] = replication.state_dict(model), replication.optimizer_state_dict(model, optimizer)["state"]
    assert runs[True][0].keys() == runs[False][0].keys()
    assert all(torch.equal(runs[True][0][k], v) for k, v in runs[False][0].items())
    assert all(torch.equal(runs[True][1][k]["momentum_buffer"], v["momentum_buffer"]) for k, v in runs[False][1].items())
    # What a GPU worker would use (decided here without one): pinned host shards, buffers on its device.
    gpu = torch.device("cuda", 1)
    assert offload_devices(gpu, True) == (torch.device("cpu"), gpu) and offload_devices(gpu, False) == (gpu, gpu)
    assert offload_policy(gpu, True).pin_memory is True and offload_policy(CPU, True).pin_memory is False
    assert not isinstance(offload_policy(gpu, False), CPUOffloadPolicy)
    # ... and the placement it makes: shards on one device, buffers on another (meta stands in for the GPU)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to("meta")
    assert allocate(bn, CPU, torch.device("meta")) == torch.device("meta")
    assert {p.device.type for p in bn.parameters()} == {"cpu"}
    assert {b.device.type for b in bn.buffers()} == {"meta"}


@pytest.mark.parametrize("name", MULTI_DEVICE)
def test_bf16_mixed_trains_on_cpu(name, gloo_group):
    # One optimizer step under the engine's bf16 autocast; gradients stay fp32 and point where fp32's do.
    x, y = _batch("lenet", 8)
    want = _plain_step(_model("lenet"), x, y)[2]
    strategy = _strategy(name, devices=2 if name in ("dp", "dp_balanced", "mp", "ddp_mp", "ddp2") else 1,
                         precision="bf16-mixed")
    model = strategy.setup_model(_model("lenet"))
    before = copy.deepcopy(strategy.replication.state_dict(strategy.unwrap(model)))
    # bf16 really in use: the step runner's own autocast, and every Linear/Conv output in bf16.
    seen = []
    for module in strategy.unwrap(model).modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            module.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with strategy.autocast():  # the run's precision, from its config (cfg.parallel)
        loss, _ = strategy.placement.compute_loss(strategy, model, x, y)
    assert seen and set(seen) == {torch.bfloat16}, seen
    if name == "fsdp":  # FSDP2 also all-gathers and computes with bf16 parameters
        policy = strategy.unwrap(model)._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    loss.backward()
    grads = {n: p.grad for n, p in strategy.unwrap(model).named_parameters()}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    assert torch.isfinite(loss) and all(g.dtype == torch.float32 for g in grads.values())
    for key, grad in grads.items():
        assert nn.functional.cosine_similarity(grad.flatten(), want[key].flatten(), dim=0) > 0.98, key
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    after = strategy.replication.state_dict(strategy.unwrap(model))
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MULTI_DEVICE)
def test_strategies_step_on_one_gpu(name, gloo_group):
    # One device: DP/MP hold one GPU, DDP2/FSDP run with one rank. fp32 must match the plain model.
    device = torch.device("cuda", 0)
    cfg = rtm.TrainConfig(strategy=name, num_workers=1, use_gpu=True, gpus_per_worker=1)
    strategy = build_worker(get_strategy(name), cfg.parallel, WorkerContext(0, 1, 0, 1, 0, (device,)))
    x, y = _batch("lenet", 16)
    want = _plain_step(_model("lenet").to(device), x.to(device), y.to(device))
    model = strategy.setup_model(_model("lenet"))
    loss, logits = strategy.placement.compute_loss(strategy, model, x.to(device), y.to(device))
    loss.backward()
    grads = {n: p.grad for n, p in strategy.unwrap(model).named_parameters()}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    _assert_same_step((loss.detach(), logits.detach().argmax(1), grads), want)


# ----------------------------------------------------------------------------- through fit (Ray, CPU, gloo)

# Every fit here asks for GPUs (use_gpu=True) on the shared Ray instance's 4 emulated ones, so
# each strategy's fit is also its emulated fit: Ray's GPU ids, CUDA_VISIBLE_DEVICES and the
# cuda:k each rank would use are checked (_emulation_checks.check_devices), while the numbers are
# computed on CPU with gloo. ddp2 stays on CPU here: with GPUs it runs one worker per node, and the
# shared instance is one node (its emulated fit: tests/test_emulation.py's STRICT_SPREAD run).

# One small run for every strategy: an MLP on digits, plain SGD, 2 epochs. No BatchNorm, no dropout,
# plain SGD: equal global batches give equal weights up to rounding (AdamW would amplify rounding
# where gradients are near zero; SGD keeps it at ~1e-6), so each strategy's fit is checked against
# the plain PyTorch loop's weights, not only its accuracy.
MLP = rtm.TrainConfig(num_workers=1, use_gpu=False, model="mlp", model_kwargs={"widths": [32]}, batch_size=64,
                      optimizer="sgd", lr=0.1, seed=3, epochs=2)
STEPS_PER_EPOCH = 1438 // 64  # digits' train split, global batch 64


def _plain_run(cfg):
    """The single-process run in plain PyTorch: the model and (train_loss, test_loss, test_accuracy) per epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine.optim import build_optimizer

    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    x_test, y_test = torch.stack([x for x, _ in data.test]), torch.tensor([y for _, y in data.test])
    history = []
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            logits = model(x_test)
        history.append((sum(losses) / len(losses), nn.functional.cross_entropy(logits, y_test).item(),
                        (logits.argmax(1) == y_test).float().mean().item()))
    return model, history


def _check_report_row(cfg, history):
    """``gpu-report``'s row of this emulated run: what the report prints for the strategy on GPUs."""
    row = gpu_report.strategy_row(cfg, history, "EMULATED")
    assert row.what.startswith(f"strategy `{cfg.strategy}`, use_gpu=True: {cfg.num_workers} worker(s)"), row
    figure = re.fullmatch(r"finished (\d+) steps, ([\d.]+) ms a step; peak memory per device ([\d./]+) GiB "
                          r"\(max/min ([\d.]+)\)", row.figure)
    assert figure and int(figure.group(1)) == history[-1]["step"] and float(figure.group(2)) > 0, row
    assert len(figure.group(3).split("/")) == len(history[-1]["peak_memory_bytes"]), row


@pytest.fixture(scope="module")
def plain_mlp():
    """The plain loop's model and its (train_loss, test_loss, test_accuracy) per epoch."""
    return _plain_run(MLP)


def _local(uri: str, *parts: str) -> Path:
    """A ``file://`` URI's (or a path's) local path, joined with ``parts``."""
    return Path(uri.removeprefix("file://"), *parts)


@pytest.mark.ray
@pytest.mark.parametrize("strategy,workers,devices", [("mp", 1, 2), ("ddp_mp", 2, 2), ("ddp2", 2, 2), ("fsdp", 4, 1)])
def test_each_strategys_fit_ends_with_the_plain_loops_weights(strategy, workers, devices, plain_mlp, ray_session,
                                                              storage, tmp_path, monkeypatch):
    # Measured spread against the plain loop (2-core VM): dp and dp_balanced ~2.5e-6 relative (the
    # batch summed in two slices), mp ~5e-8; the bound is 40x the larger.
    # runner="ray": a 1-worker mp run would otherwise train in this process; through Ray is the point here
    # (Ray's GPU ids and CUDA_VISIBLE_DEVICES of 2 emulated GPUs, the cuda:k recorded)
    cfg = MLP.replace(strategy=strategy, num_workers=workers, gpus_per_worker=devices, name=strategy,
                      storage_path=storage, use_gpu=strategy != "ddp2", runner="ray")
    if strategy == "fsdp":  # HSDP (2 shard groups of 2), sharded checkpoints: stopped after epoch 1 and resumed,
        # it must still end on the plain weights. DCP's asynchronous save at steps 10, 20 (30, 40 resumed), switched on
        # as a user does (the default is synchronous), its host buffers reused from the first save: the synchronous
        # one ends each fit. The optimizer is a user's factory that records the mesh it was handed.
        # Storage as a URI: Ray Train uploads every rank's folder through pyarrow's filesystem, as for s3:// or gs://
        # (Ray reads a file:// checkpoint in place where it downloads a remote one).
        monkeypatch.setenv(ASYNC_SHARDED_ENV, "1")
        cfg = cfg.replace(storage_path=f"file://{storage}", shard_group_size=2, optimizer="_probe_data:mesh_sgd",
                          optimizer_kwargs={"probe": str(tmp_path), "momentum": MLP.momentum},
                          keep_best=True, monitor="test_loss", mode="min",  # and the best copy, from gathered shards
                          checkpoint_every_n_steps=10)
        first = rtm.fit(cfg.replace(epochs=1))
        assert first.checkpoint_path.startswith(f"file://{storage}/"), first.checkpoint_path
        files = sorted(p.name for p in _local(first.checkpoint_path, ckpt_format.SHARDED_DIR).iterdir())
        assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]  # every rank's file, in one folder
        assert not _local(first.checkpoint_path, "model.pt").exists()
        after_first = first.load_model().state_dict()  # consolidated on the driver
    result = rtm.fit(cfg)
    plain, history = plain_mlp
    got = result.load_model().state_dict()  # fsdp: gathered from both shards; mp: the split model's pieces
    assert got.keys() == plain.state_dict().keys()  # the checkpoint is the plain model's, whatever the strategy did
    if strategy == "fsdp":  # keep_best's copy: the best epoch's model, gathered to rank 0 (a plain model.pt)
        copy = torch.load(_local(result.path, "best_checkpoint", "model.pt"), weights_only=True)
        want = got if result.history[1]["test_loss"] < result.history[0]["test_loss"] else after_first
        assert copy.keys() == want.keys() and all(torch.equal(copy[k], want[k]) for k in want)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # The same run, so the same accuracy (>= 0.9: this fit is also the strategy's "it learns" check).
    accuracy = result.metrics["test_accuracy"]
    assert accuracy == pytest.approx(history[-1][2], abs=1e-3) and accuracy >= 0.9
    assert result.history[-1]["step"] == MLP.epochs * STEPS_PER_EPOCH
    assert len(result.metrics["peak_memory_bytes"]) == workers * devices  # every device of every worker
    if strategy != "ddp2":
        check_devices(result.history[-1], workers=workers, per_worker=devices)
        _check_report_row(result.config, result.history)
    if strategy == "fsdp":
        check_hsdp_mesh(tmp_path, workers=4, shard=2)


@pytest.mark.parametrize("strategy", ["dp", "dp_balanced"])
def test_dp_and_dp_balanced_loops_end_with_the_plain_loops_weights(strategy, plain_mlp):
    """dp and dp_balanced split one worker's batch over its devices; through Ray they differ from ``mp``'s fit
    above (1 worker x 2 emulated GPUs: Ray's ids, CUDA_VISIBLE_DEVICES, the cuda:k recorded, the checkpoint
    loaded back) only inside the worker. So their run is the in-process runner (the engine every Ray Train worker
    runs, tests/_reference.py) in this process over 2 CPU stand-in devices, as each would train under
    emulation: the same checks on the weights (what its checkpoint holds), steps, accuracy and report row."""
    from _reference import evaluate, train_one_worker

    fields = {**MLP.to_dict(), "strategy": strategy, "gpus_per_worker": 2}
    weights, _, _, history = train_one_worker(fields)
    plain, plain_history = plain_mlp
    assert weights.keys() == plain.state_dict().keys()  # the plain model's state, not DataParallel's "module."
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=key)
    accuracy = evaluate({**fields, "strategy": "ddp", "gpus_per_worker": 1}, weights)["test_accuracy"]
    assert accuracy == pytest.approx(plain_history[-1][2], abs=1e-3) and accuracy >= 0.9
    assert history[-1]["step"] == MLP.epochs * STEPS_PER_EPOCH
    assert len(history[-1]["peak_memory_bytes"]) == 2  # both devices of the worker
    _check_report_row(MLP.replace(strategy=strategy, gpus_per_worker=2, use_gpu=True), history)


@pytest.mark.ray
def test_fsdp_in_bf16_learns_like_the_plain_fp32_loop(plain_mlp, ray_session, storage):
    # FSDP's MixedPrecisionPolicy on top of autocast, bf16 over gloo: not the fp32 weights, the same accuracy band.
    cfg = MLP.replace(strategy="fsdp", num_workers=2, precision="bf16-mixed", name="fsdp-bf16", storage_path=storage,
                      use_gpu=True)
    result = rtm.fit(cfg)
    history = result.history
    accuracy = history[-1]["test_accuracy"]
    assert accuracy >= 0.9 and abs(accuracy - plain_mlp[1][-1][2]) <= 0.05, [h["test_accuracy"] for h in history]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["step"] == MLP.epochs * STEPS_PER_EPOCH
    assert len(history[-1]["peak_memory_bytes"]) == 2
    check_devices(history[-1], workers=2, per_worker=1)
    _check_report_row(cfg, history)
    assert result.load_model().state_dict().keys() == plain_mlp[0].state_dict().keys()
