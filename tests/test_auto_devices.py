"""``use_gpu="auto"`` and ``num_workers="auto"`` (the defaults): the GPUs found are used, in the strategy's own layout.

Resolved once, where a run starts (``planning/auto_devices.resolve_auto_devices``: fit, compare, tune); the config
itself reads no device and starts no Ray when it is built. The machine is faked here (no GPU; emulated GPUs; a
connected cluster's capacity), and one run on the shared Ray instance trains on its 4 emulated GPUs.
"""

from __future__ import annotations

import io

import pytest
import ray
import torch
from _emulation_checks import check_devices

import raytrain_mgpu as rtm
import raytrain_mgpu.api
from raytrain_mgpu.cli import _build_parser, config_from_args
from raytrain_mgpu.driver import cluster
from raytrain_mgpu.driver.cluster import Capacity, NodeType
from raytrain_mgpu.engine.devices import EMULATE_ENV
from raytrain_mgpu.planning.auto_devices import resolve_auto_devices
from raytrain_mgpu.strategies.plan import build_plan

SMALL = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=1, max_steps=2,
             optimizer="sgd", lr=0.1)


def _refuse(what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} was called")
    return refuse


@pytest.fixture
def no_gpu_machine(monkeypatch):
    """This machine: no GPU, no emulation, no Ray up or named (whatever the session's shared Ray is doing)."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", _refuse("ray.init"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def four_emulated_gpus(no_gpu_machine, monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "4")


def test_defaults_say_auto_and_a_machine_without_gpu_trains_as_before(no_gpu_machine):
    cfg = rtm.TrainConfig()
    assert (cfg.use_gpu, cfg.num_workers) == ("auto", "auto")  # kept until the run starts
    resolved, line = resolve_auto_devices(cfg)
    assert (resolved.use_gpu, resolved.num_workers) == (False, 2)  # ddp: 2 CPU workers, the layout before "auto"
    assert line == "no GPU found on this machine -> 2 CPU workers"
    # dp with the defaults is no longer refused (it wanted num_workers=1): one worker over 2 CPU stand-in devices
    dp, line = resolve_auto_devices(rtm.TrainConfig(strategy="dp"))
    assert (dp.use_gpu, dp.num_workers, dp.gpus_per_worker) == (False, 1, 2)
    assert line == "no GPU found on this machine -> 1 CPU worker x 2 CPU stand-in devices"
    mp, _ = resolve_auto_devices(rtm.TrainConfig(strategy="mp"))
    assert (mp.num_workers, mp.gpus_per_worker) == (1, 2)
    # a strategy that needs more devices than 2 CPU processes (ddp_mp: 2 x 2) runs as configured there, as before
    ddp_mp, _ = resolve_auto_devices(rtm.TrainConfig(strategy="ddp_mp"))
    assert (ddp_mp.num_workers, ddp_mp.gpus_per_worker) == (2, 1)


def test_emulated_gpus_get_the_strategys_own_layout(four_emulated_gpus):
    ddp, line = resolve_auto_devices(rtm.TrainConfig(**SMALL))
    assert (ddp.use_gpu, ddp.num_workers, ddp.gpus_per_worker) == (True, 4, 1)
    assert line == f"use_gpu=auto found 4 GPUs on this machine (emulated by {EMULATE_ENV}) -> 4 workers x 1 GPU"
    assert build_plan(ddp).bundles == ({"CPU": 1, "GPU": 1},) * 4
    dp, line = resolve_auto_devices(rtm.TrainConfig(**SMALL, strategy="dp"))
    assert (dp.use_gpu, dp.num_workers, dp.gpus_per_worker) == (True, 1, 4)
    assert line.endswith("-> 1 worker x 4 GPUs")
    # ddp splits the batch evenly: 66 samples over 3 of the 4 GPUs
    assert resolve_auto_devices(rtm.TrainConfig(**{**SMALL, "batch_size": 66}))[0].num_workers == 3
    deep = {**SMALL, "model_kwargs": {"widths": [16, 16, 16]}}  # 5 blocks: a stage per GPU
    pipeline, line = resolve_auto_devices(rtm.TrainConfig(**deep, strategy="pipeline"))
    assert (pipeline.num_workers, pipeline.num_stages, line.split("-> ")[1]) == (1, 4, "4 stage actors x 1 GPU")


def test_what_the_user_set_is_kept(four_emulated_gpus, monkeypatch):
    two, line = resolve_auto_devices(rtm.TrainConfig(**SMALL, num_workers=2))
    assert (two.use_gpu, two.num_workers) == (True, 2)
    assert line.endswith("-> 2 workers x 1 GPU (num_workers=2 as set)")
    dp, _ = resolve_auto_devices(rtm.TrainConfig(**SMALL, strategy="dp", gpus_per_worker=2))
    assert (dp.num_workers, dp.gpus_per_worker) == (1, 2)  # only the layout keys left at their default
    monkeypatch.setattr(torch.cuda, "device_count", _refuse("torch.cuda.device_count"))
    monkeypatch.delenv(EMULATE_ENV)
    cpu, line = resolve_auto_devices(rtm.TrainConfig(**SMALL, use_gpu=False))  # nothing to read
    assert (cpu.use_gpu, cpu.num_workers) == (False, 2) and line == "use_gpu=False -> 2 CPU workers"
    fixed = rtm.TrainConfig(**SMALL, use_gpu=False, num_workers=2)
    assert resolve_auto_devices(fixed) == (fixed, "")


def test_building_a_config_reads_no_device_and_starts_no_ray(monkeypatch):
    monkeypatch.setattr(ray, "init", _refuse("ray.init"))
    monkeypatch.setattr(cluster, "read_capacity", _refuse("read_capacity"))
    monkeypatch.setattr(torch.cuda, "device_count", _refuse("torch.cuda.device_count"))
    monkeypatch.setattr("raytrain_mgpu.engine.devices.emulated_gpus", _refuse("emulated_gpus"))
    for strategy in ("ddp", "dp", "dp_balanced", "mp", "ddp_mp", "ddp2", "fsdp", "pipeline", "ddp_pipeline", "auto"):
        cfg = rtm.TrainConfig(strategy=strategy)
        assert (cfg.use_gpu, cfg.num_workers) == ("auto", "auto"), strategy
        assert cfg.replace(lr=0.1).num_workers == "auto"
    # The strategy's rules are checked on the layout a machine without a GPU gets: 1 ddp worker for this batch
    with pytest.raises(ValueError, match=r"batch_size=100 \(global\) does not split evenly over 1 data-parallel "
                                         r"replica\(s\) x grad_accum_steps=3"):
        rtm.TrainConfig(batch_size=100, grad_accum_steps=3)
    # A GPU-only option waits for the devices: refused when the run finds none, with what 'auto' chose
    cfg = rtm.TrainConfig(precision="16-mixed")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("raytrain_mgpu.engine.devices.emulated_gpus", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"precision='16-mixed' needs CUDA.*chosen for 'auto': use_gpu=False, "
                                         r"num_workers=2, because no GPU found on this machine"):
        resolve_auto_devices(cfg)
    with pytest.raises(ValueError, match=r"use_gpu='yes': must be true, false or 'auto'"):
        rtm.TrainConfig(use_gpu="yes")
    with pytest.raises(ValueError, match=r"num_workers='all': must be a positive integer, 'auto'"):
        rtm.TrainConfig(num_workers="all")
    with pytest.raises(ValueError, match=r"use_gpu='auto' has no plan until the devices are read"):
        build_plan(rtm.TrainConfig())


def test_a_connected_cluster_is_read_not_this_machine(no_gpu_machine, monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # connect() then joins nothing
    two_nodes = Capacity(({"CPU": 8, "GPU": 4, "accelerator_type:H100": 1}, {"CPU": 8, "GPU": 4}))
    monkeypatch.setattr(cluster, "read_capacity", lambda: two_nodes)
    cfg, line = resolve_auto_devices(rtm.TrainConfig(**SMALL))
    assert (cfg.use_gpu, cfg.num_workers) == (True, 8)
    assert line == "use_gpu=auto found 8 GPUs on the Ray cluster (2 nodes) -> 8 workers x 1 GPU"
    h100, _ = resolve_auto_devices(rtm.TrainConfig(**SMALL, accelerator_type="H100"))  # the nodes it may use
    assert h100.num_workers == 4
    # an autoscaler's GPU node types count before any GPU node is up
    scaling = Capacity(({"CPU": 4},), (NodeType("gpu", {"CPU": 8, "GPU": 4}, 2),))
    monkeypatch.setattr(cluster, "read_capacity", lambda: scaling)
    cfg, line = resolve_auto_devices(rtm.TrainConfig(**SMALL, strategy="dp"))
    assert (cfg.use_gpu, cfg.num_workers, cfg.gpus_per_worker) == (True, 1, 4)
    assert "found 8 GPUs on the Ray cluster (2 nodes) (counting the nodes its autoscaler can add)" in line
    monkeypatch.setattr(cluster, "read_capacity", lambda: Capacity(({"CPU": 4},)))
    assert resolve_auto_devices(rtm.TrainConfig(**SMALL))[1] == "no GPU found on the Ray cluster -> 2 CPU workers"


def test_a_named_cluster_is_joined_to_be_read_and_the_layout_must_run_there(no_gpu_machine, monkeypatch):
    joined = []
    monkeypatch.setattr(cluster, "connect", lambda address, verbose, local_has_gpu_check: joined.append(
        (address, local_has_gpu_check)) or False)
    monkeypatch.setattr(cluster, "read_capacity", lambda: Capacity(({"CPU": 8, "GPU": 4},)))
    cfg, _ = resolve_auto_devices(rtm.TrainConfig(**SMALL, address="ray://head:10001"))
    assert joined == [("ray://head:10001", False)] and cfg.num_workers == 4
    with pytest.raises(ValueError, match=r"num_workers='auto' with strategy='ddp2' on 4 GPU\(s\) on 1 node\(s\): "
                                         r"ddp2 runs one worker per node .*Set num_workers"):
        resolve_auto_devices(rtm.TrainConfig(**SMALL, strategy="ddp2", address="ray://head:10001"))
    monkeypatch.setattr(cluster, "read_capacity", lambda: Capacity(({"CPU": 8},)))
    with pytest.raises(ValueError, match=r"num_workers='auto' with use_gpu=True: no GPU found on the Ray cluster"):
        resolve_auto_devices(rtm.TrainConfig(**SMALL, use_gpu=True, address="ray://head:10001"))


def test_the_cli_takes_auto_true_and_false():
    def parsed(*argv):
        return config_from_args(_build_parser().parse_args(["train", *argv]))

    assert (parsed().use_gpu, parsed().num_workers) == ("auto", "auto")
    assert parsed("--use-gpu").use_gpu is True and parsed("--no-use-gpu").use_gpu is False
    assert parsed("--use-gpu", "auto").use_gpu == "auto" and parsed("--use-gpu", "false").use_gpu is False
    assert parsed("--num-workers", "auto").num_workers == "auto" and parsed("--num-workers", "3",
                                                                            "--batch-size", "96").num_workers == 3


def test_fit_says_what_it_found_and_needs_no_ray_for_a_local_run(no_gpu_machine, storage):
    # dp on a machine without a GPU: one worker, trained in this process; Ray is never asked (ray.init refuses)
    out = io.StringIO()
    result = rtm.fit(rtm.TrainConfig(**SMALL, strategy="dp", storage_path=storage), stream=out)
    assert "devices: no GPU found on this machine -> 1 CPU worker x 2 CPU stand-in devices\n" in out.getvalue()
    assert (result.config.use_gpu, result.config.num_workers, result.config.gpus_per_worker) == (False, 1, 2)
    assert result.history[-1]["step"] == 2


@pytest.mark.ray
def test_a_fit_with_the_defaults_trains_on_the_clusters_gpus(ray_session, storage):
    out = io.StringIO()
    result = rtm.fit(rtm.TrainConfig(**SMALL, storage_path=storage), stream=out)  # no use_gpu, no num_workers
    assert "devices: use_gpu=auto found 4 GPUs on the Ray cluster -> 4 workers x 1 GPU\n" in out.getvalue()
    assert (result.config.use_gpu, result.config.num_workers) == (True, 4)
    check_devices(result.history[-1], workers=4, per_worker=1)  # cuda:k from Ray's GPU ids, one per worker
