"""Model and optimizer factories (issue 14): models from a model zoo, optimizers of your own.

A ``module:function`` model factory receives, of ``input_shape``, ``num_classes`` and
``model_kwargs``, only the keyword arguments it names; a ``**kwargs`` catch-all gets
``model_kwargs`` and ``num_classes`` but never ``input_shape`` (torchvision's builders pass
their kwargs to the model class, which raises on it). ``fit`` builds the model on the meta
device, and its optimizer over it, before Ray starts. The factories below are named
``test_factories:<name>``: this module is importable on the driver and on the shared test
Ray's workers.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from torch import nn

import raytrain_mgpu as rtm
from raytrain_mgpu import api
from raytrain_mgpu.models import build_model, factory_arguments
from raytrain_mgpu.driver.preflight import check_model_builds

# A test extra, checked without importing it (every pytest process collects this module): skipped where it
# is missing, a failure on CI (tests/_extras.py). The helper is imported only then: Ray's workers import this
# module by name, and only its own file is shipped to them.
if importlib.util.find_spec("torchvision") is None:
    from _extras import require

    require("torchvision")

IMAGES = dict(dataset="synthetic", input_shape=[3, 32, 32], num_classes=10, num_samples=64, batch_size=32,
              epochs=1, seed=5, use_gpu=False)  # 2 steps: 64 samples, global batch 32


# ----------------------------------------------------------------------------- factories


def named_both(input_shape, num_classes, width=4):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.Linear(width, num_classes))


def catch_all(**kwargs):
    return nn.Linear(1, kwargs["num_classes"])


def shape_and_catch_all(input_shape, **kwargs):
    return nn.Linear(math.prod(input_shape), kwargs["num_classes"])


def broken(num_classes):
    raise RuntimeError("no weights for this head")


def not_a_module(num_classes):
    return [num_classes]


def reads_values_while_building(num_classes):
    """timm's pattern (``[x.item() for x in torch.linspace(...)]``): fails on meta, builds on CPU."""
    rates = [x.item() for x in torch.linspace(0, 0.1, 3)]
    return nn.Sequential(nn.Flatten(), nn.Dropout(rates[1]), nn.Linear(3 * 32 * 32, num_classes))


def vit_tiny(input_shape, num_classes):
    """A ``vit_b_16``-shaped model at test size: torchvision's own VisionTransformer class."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=input_shape[-1], patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=num_classes)


def small_mlp(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes))


def rmsprop(params, lr, **kwargs):
    return torch.optim.RMSprop(params, lr=lr, **kwargs)


def not_an_optimizer(params, lr):
    return list(params)


# ----------------------------------------------------------------------------- signature filtering (no Ray)


def test_a_factory_gets_only_the_arguments_it_names():
    args = factory_arguments(named_both, "t:named_both", [3, 4], 5, {"width": 2})
    assert args == {"input_shape": (3, 4), "num_classes": 5, "width": 2}
    assert factory_arguments(broken, "t:broken", (3, 4), 5, {}) == {"num_classes": 5}
    # A catch-all gets model_kwargs and num_classes, never input_shape.
    assert factory_arguments(catch_all, "t:catch_all", (3, 4), 5, {"depth": 2}) == {"num_classes": 5, "depth": 2}
    assert factory_arguments(shape_and_catch_all, "t:s", (3, 4), 5, {}) == {"input_shape": (3, 4), "num_classes": 5}
    # No classes (regression data): a catch-all gets none, and model_kwargs may set it.
    assert factory_arguments(catch_all, "t:catch_all", (3,), None, {"num_classes": 1}) == {"num_classes": 1}


def test_model_kwargs_a_factory_does_not_take_or_the_data_gives_are_refused():
    with pytest.raises(ValueError, match=r"t:named_both takes no argument \['depht'\] \(it takes \['input_shape', "
                                         r"'num_classes', 'width'\]\)\. Remove or rename them"):
        factory_arguments(named_both, "t:named_both", (3,), 5, {"depht": 2})
    with pytest.raises(ValueError, match=r"sets \['num_classes'\], which the dataset gives t:catch_all "
                                         r"\(num_classes=5\)\. Remove them from model_kwargs"):
        factory_arguments(catch_all, "t:catch_all", (3,), 5, {"num_classes": 1})


@pytest.mark.parametrize("builder", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_builders_build_with_our_arguments(builder):
    # Before: resnet18(input_shape=..., num_classes=10) raised TypeError in ResNet.__init__.
    model = build_model(f"torchvision.models:{builder}", (3, 32, 32), 10, {})
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("test_factories:vit_tiny", (3, 32, 32), 10, {})(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("mlp", (1, 8, 8), 4, {"widths": [8]})(torch.randn(2, 1, 8, 8)).shape == (2, 4)  # registry


def test_a_factory_that_raises_or_returns_no_module_is_named():
    with pytest.raises(ValueError, match=r"TrainConfig.model='test_factories:broken' failed: broken\(num_classes=10\) "
                                         r"raised RuntimeError: no weights for this head\. Fix the factory"):
        build_model("test_factories:broken", (3, 32, 32), 10, {})
    with pytest.raises(ValueError, match=r"not_a_module\(num_classes=10\) returned a list, not a torch.nn.Module"):
        build_model("test_factories:not_a_module", (3, 32, 32), 10, {})


def test_a_model_that_cannot_build_on_meta_is_built_once_on_cpu_leaving_the_rng_alone():
    cfg = rtm.TrainConfig(model="test_factories:reads_values_while_building", **IMAGES)
    with pytest.raises(ValueError, match="failed"), torch.device("meta"):
        build_model(cfg.model, (3, 32, 32), 10, {})
    before = torch.get_rng_state()
    check_model_builds(cfg, (3, 32, 32), 10)  # no error: the CPU build works
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("side", [4, 5, 8, 13, 27, 28, 29, 32, 64])
def test_lenet_counts_its_dense_input_as_running_its_convs_gives(side):
    """LeNet sizes its first dense layer without a dummy forward (cheap on the meta device): the count must
    match what the convolutions and pools give, on both sides of its 28-pixel padding switch."""
    model = build_model("lenet", (3, side, side), 10, {})
    convs = nn.Sequential(*[m for m in model if not isinstance(m, nn.Linear)][:7])
    assert convs(torch.zeros(1, 3, side, side)).shape[1] == model[7].in_features


def test_lenet_refuses_an_input_its_pools_leave_empty():
    with pytest.raises(ValueError, match=r"LeNet input_size=3: its pools leave no pixels. It needs inputs of at "
                                         r"least 4x4"):
        build_model("lenet", (1, 3, 3), 10, {})


# ----------------------------------------------------------------------------- optimizer config (no Ray)


def test_optimizer_takes_a_name_or_a_factory_and_its_kwargs():
    cfg = rtm.TrainConfig(optimizer="test_factories:rmsprop", optimizer_kwargs={"alpha": 0.9, "momentum": 0.5})
    assert cfg.optim.optimizer == "test_factories:rmsprop" and cfg.optim.optimizer_kwargs == {"alpha": 0.9,
                                                                                                "momentum": 0.5}
    from raytrain_mgpu.engine.optim import build_optimizer

    optimizer = build_optimizer(nn.Linear(2, 2).parameters(), cfg.optim)
    assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["alpha"] == 0.9
    assert optimizer.defaults["lr"] == cfg.optim.scaled_lr()
    adamw = build_optimizer(nn.Linear(2, 2).parameters(), rtm.TrainConfig(optimizer_kwargs={"betas": [0.8, 0.9]}).optim)
    assert tuple(adamw.defaults["betas"]) == (0.8, 0.9)
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer='rmsprop': is not one of \['sgd', 'adamw'\] or a "
                                         r"'package.module:function'\. Set optimizer to one of them"):
        rtm.TrainConfig(optimizer="rmsprop")
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer_kwargs=\{'momentum': 0.5\}: must not set "
                                         r"\['momentum'\]: the trainer passes them"):
        rtm.TrainConfig(optimizer="sgd", optimizer_kwargs={"momentum": 0.5})
    with pytest.raises(ValueError, match=r"TrainConfig.optimizer='os:system': 'os' is a standard-library module"):
        rtm.TrainConfig(optimizer="os:system")


def test_a_config_file_names_an_optimizer_factory_only_when_allowed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: test_factories:rmsprop\n")
    with pytest.raises(ValueError, match=r"optimizer='test_factories:rmsprop' names code to run"):
        rtm.TrainConfig.from_yaml(path)
    assert rtm.TrainConfig.from_yaml(path, allow_code=True).optimizer == "test_factories:rmsprop"


# ----------------------------------------------------------------------------- before Ray


def _refuse_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("fit started Ray before checking the model")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(api, "connect", refuse)


@pytest.mark.parametrize("fields,message", [
    (dict(model="test_factories:broken"),
     r"TrainConfig.model='test_factories:broken' failed: broken\(num_classes=10\) raised RuntimeError"),
    (dict(model="torchvision.models:resnet18", model_kwargs={"widht": 2}),
     r"resnet18\(num_classes=10, widht=2\) raised TypeError: .*unexpected keyword argument 'widht'"),
    (dict(model="mlp", optimizer="test_factories:not_an_optimizer"),
     r"optimizer='test_factories:not_an_optimizer': not_an_optimizer\(params, lr=0.02\) returned a list"),
    (dict(model="mlp", optimizer_kwargs={"betaz": [0.9, 0.9]}),
     r"TrainConfig.optimizer='adamw' with optimizer_kwargs=\{'betaz': \[0.9, 0.9\]\} does not build: TypeError"),
    (dict(model="mlp", loss="test_factories:no_such_loss"),
     r"TrainConfig.loss='test_factories:no_such_loss': module 'test_factories' has no function 'no_such_loss'"),
    (dict(model="mlp", metrics=["accuracy", "test_factories:no_such_metric"]),
     r"TrainConfig.metrics='test_factories:no_such_metric': module 'test_factories' has no function"),
])
def test_a_factory_that_raises_fails_before_ray(fields, message, monkeypatch, tmp_path):
    _refuse_ray(monkeypatch)
    with pytest.raises(ValueError, match=message):
        rtm.fit(rtm.TrainConfig(**{**IMAGES, **fields}, storage_path=str(tmp_path)))


# ----------------------------------------------------------------------------- real builders through fit


def _initial_weights(cfg) -> dict:
    torch.manual_seed(cfg.seed)  # what every rank builds first (engine_checkpoint.build_model)
    return build_model(cfg.model, tuple(cfg.input_shape), cfg.num_classes, cfg.model_kwargs).state_dict()


def _fit_and_check(fields: dict, storage: str):
    """``fields`` through ``fit``; its checkpoint, loaded by the same factory, holds what one worker trains from
    the same config in this process (the in-process runner: the plain model's arithmetic, fsdp's ddp twin)."""
    from _reference import train_one_worker

    cfg = rtm.TrainConfig(**fields, storage_path=storage)
    result = rtm.fit(cfg)
    assert result.metrics["step"] == 2 and math.isfinite(result.metrics["train_loss"])
    assert math.isfinite(result.metrics["test_loss"])
    state = result.load_model().state_dict()  # rebuilt by the same factory, same argument filtering
    want, _, _, history = train_one_worker(fields)  # 2 SGD steps of the ViT below: 7.5e-9 apart at most
    assert state.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert result.metrics["train_loss"] == pytest.approx(history[-1]["train_loss"], rel=1e-4)
    initial = _initial_weights(cfg)
    assert any(v.is_floating_point() and not torch.equal(v, initial[k]) for k, v in state.items())  # it trained
    assert result.load_model()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    return result


@pytest.mark.ray
def test_a_model_zoo_class_by_dotted_name_trains_sharded_over_two_workers_through_fit(ray_session, storage):
    """The whole path once: an installed package's model, named by its dotted path (not shipped:
    the workers import it), built on meta by rank 1, sharded over 2 ranks (``class_token`` is
    1 x 1 x 32: rank 1's shard of it is empty), with ``cpu_offload`` (shards, gradients and optimizer state
    in host memory: the same steps, tests/test_strategies.py), gathered into the checkpoint, loaded back: the
    weights one worker trains. The strategies' handling of each zoo model is checked in one process below."""
    vit = dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
    _fit_and_check(dict(**IMAGES, model="torchvision.models:VisionTransformer", model_kwargs=vit, strategy="fsdp",
                        num_workers=2, optimizer="sgd", lr=0.01, name="vit-fsdp", cpu_offload=True), storage)


# ----------------------------------------------------------------------------- real builders, one process


def _strategy_for(cfg, ranks_seen: int):
    """``cfg``'s strategy in this process on CPU "devices"; ``ranks_seen``: the world size it is told.

    ``ddp`` leaves a world of one unwrapped (one process has nothing to all-reduce), so it is told 2
    and wraps the model in ``DistributedDataParallel`` over the one-rank gloo group: DDP's own hooks,
    buffer broadcast and all-reduce run on the zoo model, averaging over the one rank there is."""
    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    strategy = get_strategy(cfg.strategy)
    ctx = WorkerContext(world_rank=0, world_size=ranks_seen, local_rank=0, local_world_size=1, node_rank=0,
                        devices=(torch.device("cpu"),) * strategy.devices_per_worker(cfg))
    return build_worker(strategy, cfg.parallel, ctx, Objective.of(cfg, cfg.num_classes))


def _plain_loss(model, x, y, slices: int):
    """The plain model's loss as a strategy that splits the batch over ``slices`` devices computes it:
    each slice's mean weighted by its share (BatchNorm normalises each slice by its own statistics)."""
    return sum(nn.functional.cross_entropy(model(xs), ys) * (len(ys) / len(y))
               for xs, ys in zip(x.chunk(slices), y.chunk(slices)))


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # fsdp: a DTensor shard


ZOO_STEPS, ZOO_BATCH = 2, 8  # dp_balanced: 4 samples a device; BatchNorm's last 1 x 1 maps still see 4 values


@pytest.fixture
def one_thread():
    """As a worker with cpus_per_worker=1: two threads on a busy 2-core machine spin more than they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("model", ["torchvision.models:resnet18", "torchvision.models:mobilenet_v3_small",
                                   "test_factories:vit_tiny"])
@pytest.mark.parametrize("strategy,devices", [("ddp", 1), ("fsdp", 1), ("dp_balanced", 2)])
def test_model_zoo_builders_take_the_plain_models_steps_on_data_parallel_strategies(model, strategy, devices,
                                                                                     gloo_group, one_thread):
    """Code we did not write, wrapped by each strategy: the plain model's loss, gradients and
    weights step for step (dp_balanced: each device's slice, as the plain model computes it), and a
    checkpoint that the same factory's model loads."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from raytrain_mgpu.engine.objectives import Predictions
    from raytrain_mgpu.engine.optim import build_optimizer

    cfg = rtm.TrainConfig(**IMAGES, model=model, strategy=strategy, num_workers=1, gpus_per_worker=devices,
                          optimizer="sgd", lr=0.01)
    torch.manual_seed(cfg.seed)
    built = build_model(cfg.model, (3, 32, 32), 10, {})
    plain, initial = copy.deepcopy(built), copy.deepcopy(built.state_dict())
    with torch.device("meta"):  # what fsdp's ranks other than 0 build; at the end, what the checkpoint loads into
        on_meta = build_model(cfg.model, (3, 32, 32), 10, {})
    assert {k: v.shape for k, v in on_meta.state_dict().items()} == {k: v.shape for k, v in initial.items()}
    wrapper = _strategy_for(cfg, ranks_seen=2 if strategy == "ddp" else 1)
    wrapped = wrapper.setup_model(built)
    # The strategy's own handling, not a plain model passed through.
    if strategy == "ddp":
        assert isinstance(wrapped, DistributedDataParallel)
    if strategy == "fsdp":
        assert isinstance(wrapped, FSDPModule) and all(isinstance(p, DTensor) for p in wrapped.parameters())
    optimizer = build_optimizer(wrapped.parameters(), cfg.optim)
    plain_optimizer = build_optimizer(plain.parameters(), cfg.optim)
    plain_params = dict(plain.named_parameters())
    generator = torch.Generator().manual_seed(cfg.seed)
    for step in range(ZOO_STEPS):
        x = torch.randn(ZOO_BATCH, 3, 32, 32, generator=generator)
        y = torch.randint(0, 10, (ZOO_BATCH,), generator=generator)
        rng = torch.get_rng_state()  # mobilenet's dropout: the same masks for both
        loss, outputs = wrapper.placement.compute_loss(wrapper, wrapped, x, y)
        loss.backward()
        torch.set_rng_state(rng)
        want = _plain_loss(plain, x, y, devices)
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
        if strategy == "dp_balanced":  # only the per-device losses and argmax indices came back
            assert isinstance(outputs, Predictions)
        for name, param in wrapper.unwrap(wrapped).named_parameters():
            torch.testing.assert_close(_full(param.grad), plain_params[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=f"step {step}: {name}")
        for opt in (optimizer, plain_optimizer):
            opt.step()
            opt.zero_grad()
    # The checkpoint is the plain model's state, which the same factory's model (same argument filtering) loads.
    saved = wrapper.replication.state_dict(wrapper.unwrap(wrapped))
    assert saved.keys() == initial.keys() and all(type(v) is torch.Tensor for v in saved.values())
    for name, param in plain_params.items():
        torch.testing.assert_close(saved[name], param.detach(), rtol=1e-4, atol=1e-6, msg=name)
    assert any(v.is_floating_point() and not torch.equal(v, initial[k]) for k, v in saved.items())  # it trained
    on_meta.load_state_dict(saved, assign=True)  # strict: every key, every shape
    assert on_meta(torch.randn(2, 3, 32, 32)).shape == (2, 10)
