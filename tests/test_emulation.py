"""GPU emulation (``RAYTRAIN_MGPU_EMULATE_GPUS=N``): Ray Train runs with ``use_gpu=True`` on CPU.

Under emulation Ray schedules workers onto fake GPUs and sets ``CUDA_VISIBLE_DEVICES`` as on
a real node; each run records, per rank, the devices it would use (``cuda:k``), the backend
(nccl) and what Ray gave it (``ray.get_gpu_ids()``, ``CUDA_VISIBLE_DEVICES``, node id). The
tests recompute the devices from Ray's raw answer instead of trusting the resolver
(``_emulation_checks.check_devices``). The strategies' fits through Ray in
tests/test_strategies.py ask for the shared Ray instance's 4 fake GPUs and are checked that way
(ddp2 there runs on CPU: with GPUs it needs a node per worker, as below). Here, in a subprocess so the shared session is not
disturbed: two nodes (``ray start`` with private temp dirs) for PACK and STRICT_SPREAD. ``fit``
starting its own local Ray with the fake GPUs: tests/test_real_cpus.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _emulation_checks import check_devices
from _ray_nodes import RayNode, base_env, free_port_flags

import raytrain_mgpu as rtm
from raytrain_mgpu.driver import cluster
from raytrain_mgpu.engine import devices
from raytrain_mgpu.engine.devices import EMULATE_ENV
from raytrain_mgpu.checkpointing.contents import ASYNC_SHARDED_ENV

REPO = Path(__file__).resolve().parents[1]
TINY = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=64, epochs=1, max_steps=2,
            optimizer="sgd", lr=0.1, use_gpu=True)


# ----------------------------------------------------------------------------- no Ray


def test_worker_runtime_env_carries_the_switch_only_when_set(monkeypatch):
    node = object()
    monkeypatch.setattr(cluster, "_local_node", lambda: node)
    monkeypatch.setattr(cluster, "_RAYLET_ENV", {})  # a Ray joined or started by the user: its raylet has none of ours
    monkeypatch.setenv(EMULATE_ENV, "3")
    assert cluster.worker_runtime_env("mlp", "digits")["env_vars"][EMULATE_ENV] == "3"
    monkeypatch.delenv(EMULATE_ENV)
    assert EMULATE_ENV not in cluster.worker_runtime_env("mlp", "digits")["env_vars"]
    # A Ray that connect() started got the switch before ray.init: the env adds nothing (Ray's pre-started workers
    # then serve the run)...
    monkeypatch.setenv(EMULATE_ENV, "3")
    monkeypatch.setattr(cluster, "_RAYLET_ENV", {"node": node, "env": cluster.worker_env_vars()})
    assert "env_vars" not in cluster.worker_runtime_env("mlp", "digits")
    # ...but a switch set after that start reaches the workers only through it (they inherit the raylet's environment)
    monkeypatch.setenv(ASYNC_SHARDED_ENV, "1")
    assert cluster.worker_runtime_env("mlp", "digits")["env_vars"] == {ASYNC_SHARDED_ENV: "1"}
    monkeypatch.setattr(cluster, "_local_node", lambda: object())  # another Ray since: nothing is assumed of it
    assert set(cluster.worker_runtime_env("mlp", "digits")["env_vars"]) == {EMULATE_ENV, ASYNC_SHARDED_ENV,
                                                                            "RAY_worker_niceness"}


def test_connect_starts_a_local_ray_with_fake_gpus_only_under_emulation(monkeypatch):
    calls = []
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    with pytest.raises(ValueError, match=rf"use_gpu=True, but this machine has no CUDA GPU .*{EMULATE_ENV}=4"):
        cluster.connect(None, False, local_has_gpu_check=True)
    monkeypatch.setenv(EMULATE_ENV, "2")
    assert cluster.connect(None, False, local_has_gpu_check=True) is True
    assert calls[-1]["num_gpus"] == 2 and calls[-1]["address"] is None
    assert calls[-1]["include_dashboard"] is False  # fit's own Ray: no dashboard processes in its start


def test_resolver_under_emulation_computes_on_cpu_and_records_cuda(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "4")
    assignment = devices.resolve_devices(True, 2)  # outside Ray: cuda:0..1
    assert [d.type for d in assignment.compute] == ["cpu", "cpu"]
    assert assignment.record() == {"devices": ["cuda:0", "cuda:1"], "backend": "nccl", "emulated": True}
    assert assignment.backend == "gloo" and devices.backend(True) == "gloo"
    monkeypatch.setenv(EMULATE_ENV, "many")
    with pytest.raises(ValueError, match=rf"{EMULATE_ENV}='many': must be a whole number of GPUs"):
        devices.is_emulated()


# ----------------------------------------------------------------------------- own Ray instances (subprocesses)

def _clean_env(root: Path, **extra: str) -> dict:
    (root / "home").mkdir(exist_ok=True)
    return base_env(root / "home", RAY_AUTH_MODE="disabled", **extra)  # fit sets its controller poll itself


def _two_emulated_nodes(root: Path, env: dict):
    head, worker = RayNode(root / "h", env), RayNode(root / "w", env)
    ports = free_port_flags()
    # no dashboard: the driver connects to the GCS, and nothing here reads the state API
    head.start(["--head", "--num-cpus", "2", "--num-gpus", "2", "--include-dashboard=false",
                *[str(x) for kv in ports.items() for x in kv]])
    address = f"127.0.0.1:{ports['--port']}"
    worker_ports = free_port_flags(skip=("--port", "--dashboard-port", "--ray-client-server-port"))
    worker.start(["--address", address, "--num-cpus", "2", "--num-gpus", "2",
                  *[str(x) for kv in worker_ports.items() for x in kv]])
    return head, worker, address


def test_the_ports_given_to_ray_nodes_never_repeat():
    """Chosen one at a time, two of a node's flags once got the same port and ``ray start`` refused it; here 800
    ports in 8 calls (as the nodes of a session ask: the ports of one node, then another's) are all distinct."""
    from _ray_nodes import free_ports

    given = [port for _ in range(8) for port in free_ports(100)]
    assert len(set(given)) == len(given)


@pytest.mark.slow
def test_pack_and_strict_spread_over_two_emulated_nodes():
    # Two nodes of 2 fake GPUs each, started WITHOUT the switch: only the driver has it, so
    # the workers emulate only if the runtime env carries it (the driver calls ray.init itself).
    root = Path(tempfile.mkdtemp(prefix="rtmemu2-", dir="/tmp"))
    head = worker = None
    try:
        head, worker, address = _two_emulated_nodes(root, _clean_env(root))
        storage = str(root / "results")
        plan = {"steps": [
            {"kind": "fit", "config": {**TINY, "strategy": "ddp", "num_workers": 2, "placement": "PACK",
                                       "name": "pack", "storage_path": storage}},
            {"kind": "fit", "config": {**TINY, "strategy": "ddp2", "num_workers": 2, "gpus_per_worker": 2,
                                       "placement": "STRICT_SPREAD", "name": "spread", "storage_path": storage}},
        ]}
        (root / "plan.json").write_text(json.dumps(plan))
        env = _clean_env(root, RAY_ADDRESS=address, **{EMULATE_ENV: "2"})
        done = subprocess.run([sys.executable, str(REPO / "tests" / "_fit_driver.py"), str(root / "plan.json"),
                               str(root / "results.json")], env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=540)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads((root / "results.json").read_text())
    finally:
        for node in (worker, head):
            if node is not None:
                node.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert [r["ok"] for r in results] == [True, True], [r.get("error") for r in results]
    pack, spread = results[0]["history"][-1], results[1]["history"][-1]
    check_devices(pack, workers=2, per_worker=1)
    assert len(set(pack["node_id_per_rank"])) == 1  # PACK: both workers on one node, on its 2 GPUs
    assert sorted(d for ds in pack["devices_per_rank"] for d in ds) == ["cuda:0", "cuda:1"]
    check_devices(spread, workers=2, per_worker=2)
    assert len(set(spread["node_id_per_rank"])) == 2  # STRICT_SPREAD: one worker (node) each
    assert spread["devices_per_rank"] == [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]]


def test_the_banner_says_when_gpus_are_emulated(monkeypatch):
    from raytrain_mgpu.api import _banner
    from raytrain_mgpu.strategies.plan import build_plan

    cfg = rtm.TrainConfig(strategy="ddp_mp", num_workers=2, gpus_per_worker=2, use_gpu=True)
    monkeypatch.setenv(EMULATE_ENV, "4")
    assert "2 worker(s) x 2 GPU (emulated by RAYTRAIN_MGPU_EMULATE_GPUS" in _banner(cfg, build_plan(cfg), (1, 8, 8), 10)
    monkeypatch.delenv(EMULATE_ENV)
    assert "emulated" not in _banner(cfg, build_plan(cfg), (1, 8, 8), 10)
    on_cpu = cfg.replace(use_gpu=False)  # the devices a CPU worker splits over are named too
    assert "2 worker(s) x 1 CPU (2 CPU stand-in devices)" in _banner(on_cpu, build_plan(on_cpu), (1, 8, 8), 10)
