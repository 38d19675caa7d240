"""Resource checks on an autoscaling cluster: our own ``cluster.yaml`` from cold (0 GPU nodes up).

The autoscaler's state is faked where a ``ray up`` head holds it (Ray 2.60's autoscaler publishes
no node types to the GCS): ``cluster.yaml`` as the head's ``~/ray_bootstrap_config.yaml``, named
by the ``--autoscaling-config`` argument of the cluster's monitor process in a stand-in ``/proc``,
and only the head alive. One test fakes the GCS's answer instead (``autoscaler_pb2.ClusterConfig``,
read first where a Ray publishes it).

The last two tests start Ray: a plain local one, and Ray's real autoscaler from cold
(``tests/_autoscaling_cluster.py``), each with its drivers in subprocesses (this module runs in the
process of the suite's own clusters, conftest.py's OWN_CLUSTERS, not beside the shared instance).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from _autoscaling_cluster import AutoscalingCluster, driver_plan, wait_for
from _ray_nodes import RayNode, base_env, free_port_flags
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from ray.core.generated import autoscaler_pb2

import raytrain_mgpu as rtm
from raytrain_mgpu.planning import auto
from raytrain_mgpu.driver import autoscaler_config
from raytrain_mgpu.driver import cluster
from raytrain_mgpu.planning.compare import _plan, _skip_unplaceable
from raytrain_mgpu.transports.actor_group.runner import _check_resources, run_pipeline
from raytrain_mgpu.strategies import get_strategy

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
# The head as `ray up` starts it: `CPU: 0` (cluster.yaml), Ray's own memory and node resources.
HEAD = {"CPU": 0.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}
GPU_NODE = {"CPU": 48.0, "GPU": 4.0, "memory": 1.5e11, "object_store_memory": 2e10, "node:10.0.0.2": 1.0}
GPUS_AT_MOST = 4 * 8  # 4 GPUs a node; up to 10 GPU nodes by type (gpu_ondemand 2, gpu_spot 6, gpu_l4 2), 8 in all
A10G, SPOT = {"accelerator_type:A10G": 1.0}, {"spot": 4.0}


def our_cluster_config() -> autoscaler_pb2.ClusterConfig:
    """cluster.yaml's node types as the GCS stores them (the head: exactly one node)."""
    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    groups = []
    for name, node_type in raw["available_node_types"].items():
        head = name == raw["head_node_type"]
        groups.append(autoscaler_pb2.NodeGroupConfig(
            name=name, resources={k: int(v) for k, v in node_type["resources"].items()},
            min_count=1 if head else node_type.get("min_workers", 0),
            max_count=1 if head else node_type.get("max_workers", raw["max_workers"])))
    return autoscaler_pb2.ClusterConfig(node_group_configs=groups)


SESSION = "session_2026-11-28_09-00-00_000000_4242"  # the connected cluster's; another Ray's is "..._99"


def fake_monitor(proc: Path, pid: int, session: str, config: str = "", home: Path = Path("/"), cwd: Path = Path("/"),
                 autoscaler: str = "_private"):
    """A monitor process as `ray start --head` leaves it: its arguments, environment and working folder
    (``autoscaler="v2"``: the v2 autoscaler's, under RAY_enable_autoscaler_v2=1)."""
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    argv = [sys.executable, "-u", f"/venv/site-packages/ray/autoscaler/{autoscaler}/monitor.py",
            f"--logs-dir=/tmp/ray/{session}/logs", "--gcs-address=10.0.0.1:6379",
            *([f"--autoscaling-config={config}"] if config else []), "--monitor-ip=10.0.0.1"]
    (entry / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    (entry / "environ").write_bytes(f"PATH=/usr/bin\0HOME={home}\0".encode())
    (entry / "cwd").symlink_to(cwd)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This driver on a machine of its own (a stand-in /proc, HOME), connected to the cluster of SESSION, whose
    GCS holds no node types; on the head unless a test says otherwise."""
    proc, home = tmp_path / "proc", tmp_path / "driver-home"
    proc.mkdir()
    home.mkdir()
    monkeypatch.setattr(autoscaler_config, "PROC", proc)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(autoscaler_config, "_local_node", lambda: SimpleNamespace(session_name=SESSION,
                                                                                  is_head=lambda: False))
    monkeypatch.setattr(autoscaler_config, "_driver_on_head", lambda: True)
    monkeypatch.setattr(cluster.ray._private.state.state, "get_cluster_config", lambda: None)
    monkeypatch.delenv("RAYTRAIN_MGPU_EMULATE_GPUS", raising=False)
    return SimpleNamespace(proc=proc, home=home, root=tmp_path)


@pytest.fixture
def cold(machine, monkeypatch):
    """Our cluster.yaml just after `ray up`: the head alive, both GPU node types at 0 nodes; the head's monitor
    reads ~/ray_bootstrap_config.yaml of its own HOME. Another Ray's monitor runs on the machine too."""
    head_home = machine.root / "head-home"
    head_home.mkdir()
    (head_home / "ray_bootstrap_config.yaml").write_text(CLUSTER_YAML.read_text())
    other = machine.root / "other.yaml"
    other.write_text(yaml.safe_dump({"max_workers": 9, "head_node_type": "h", "available_node_types": {
        "h": {"resources": {"CPU": 0}}, "cpu": {"resources": {"CPU": 64}, "max_workers": 9}}}, sort_keys=False))
    fake_monitor(machine.proc, 77, SESSION[:-4] + "99", config=str(other))
    fake_monitor(machine.proc, 4242, SESSION, config="~/ray_bootstrap_config.yaml", home=head_home)
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD)])
    return head_home / "ray_bootstrap_config.yaml"


@pytest.fixture
def fixed(machine, monkeypatch):
    """A cluster that does not autoscale (its monitor has no autoscaling config): one CPU node of 4 CPUs."""
    fake_monitor(machine.proc, 4242, SESSION)
    monkeypatch.setattr(cluster, "_nodes", lambda: [{"CPU": 4.0, "memory": 8e9}])


def test_our_cluster_yaml_reads_as_eight_gpu_nodes_it_can_have(cold, monkeypatch):
    capacity = cluster.read_capacity()
    assert capacity.autoscales
    assert (capacity.node_types_source, capacity.node_types_unknown) == (str(cold), "")  # not the other Ray's
    assert [(t.name, t.resources, t.max_count) for t in capacity.node_types] == [
        ("head", {"CPU": 0.0}, 1), ("gpu_ondemand", {"CPU": 48.0, "GPU": 4.0, **A10G}, 2),
        ("gpu_spot", {"CPU": 48.0, "GPU": 4.0, **A10G, **SPOT}, 6),
        ("gpu_l4", {"CPU": 48.0, "GPU": 4.0, "accelerator_type:L4": 1.0}, 2), ("cpu", {"CPU": 16.0}, 2)]
    assert capacity.alive_gpus == 0
    assert capacity.gpus_per_node() == (4,) * 8
    assert capacity.max_total("GPU") == GPUS_AT_MOST
    # Nodes already up are of a node type: two spot nodes up still make 8 GPU nodes, not 10.
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD), dict(GPU_NODE), dict(GPU_NODE)])
    warm = cluster.read_capacity()
    assert warm.alive_gpus == 8 and warm.gpus_per_node() == (4,) * 8 and warm.max_total("GPU") == GPUS_AT_MOST


@pytest.mark.parametrize("strategy,overrides", [
    ("ddp", dict(num_workers=GPUS_AT_MOST)),          # every GPU the node types can add
    ("dp", dict(num_workers=1, gpus_per_worker=4)),   # a whole 4-GPU node for one worker
    ("ddp2", dict(num_workers=8, gpus_per_worker=4, placement="STRICT_SPREAD")),
])
def test_gpu_runs_pass_the_check_with_no_gpu_node_up(cold, strategy, overrides, caplog):
    cfg = rtm.TrainConfig(strategy=strategy, use_gpu=True, batch_size=64, **overrides)
    with caplog.at_level(logging.INFO, logger="raytrain_mgpu.driver.cluster"):
        cluster.check_placeable(get_strategy(strategy).bundles(cfg), True, f"strategy={strategy!r}")
    assert "waits for the autoscaler to add nodes" in caplog.text


def test_a_worker_bigger_than_every_node_type_is_refused_naming_the_largest(cold):
    bundles = get_strategy("dp").bundles(rtm.TrainConfig(strategy="dp", num_workers=1, use_gpu=True,
                                                         gpus_per_worker=8))
    assert bundles == [{"CPU": 1, "GPU": 8}]
    with pytest.raises(ValueError, match=r"strategy='dp': one worker needs 8 GPU, but the largest node type "
                                         r"'gpu_ondemand' has 4 GPU \(node types head: 0 CPU, 0 GPU, up to 1; "
                                         r"gpu_ondemand: 48 CPU, 4 GPU, 1 accelerator_type:A10G, up to 2; gpu_spot: "
                                         r"48 CPU, 4 GPU, 1 accelerator_type:A10G, 4 spot, up to 6; .*cpu: 16 CPU, 0 "
                                         r"GPU, up to 2; now up: node 0: 0 CPU, 0 GPU\), and a worker cannot span "
                                         r"nodes\. Set gpus_per_worker to at most 4, or add a node type with 8 GPU"):
        cluster.check_placeable(bundles, True, "strategy='dp'")


def test_more_gpus_than_the_node_types_can_add_is_refused(cold):
    bundles = [{"CPU": 1, "GPU": 1}] * (GPUS_AT_MOST + 1)
    with pytest.raises(ValueError, match=rf"needs {GPUS_AT_MOST + 1} GPU in all, but this autoscaling cluster "
                                         rf"can scale to at most {GPUS_AT_MOST} .*raise max_workers"):
        cluster.check_placeable(bundles, True, "strategy='ddp'")
    # The totals fit (27 of 32 GPUs), but a 3-GPU worker takes a 4-GPU node, and max_workers lets 8 of them up.
    with pytest.raises(ValueError, match=r"needs 9 x \{'CPU': 1, 'GPU': 3\}, which this autoscaling cluster "
                                         r"cannot place even at its largest"):
        cluster.check_placeable([{"CPU": 1, "GPU": 3}] * 9, True, "strategy='ddp2'")


def test_the_pipeline_gets_past_its_checks_at_zero_gpu_nodes(cold, monkeypatch, storage):
    # Training itself is out of reach here: the first thing after the checks raises instead.
    class PastTheChecks(Exception):
        pass

    def drive(*args, **kwargs):
        raise PastTheChecks

    monkeypatch.setattr("raytrain_mgpu.transports.actor_group.runner.drive", drive)
    cfg = rtm.TrainConfig(model="mlp", dataset="digits", strategy="pipeline", num_stages=4, num_microbatches=4,
                          use_gpu=True, num_workers=1, storage_path=storage)
    with pytest.raises(PastTheChecks):
        run_pipeline(cfg, None, events=None)
    too_many = cfg.replace(strategy="ddp_pipeline", num_workers=9, batch_size=144)  # 36 stage actors, 1 GPU each
    with pytest.raises(ValueError, match=r"needs 36 GPU \(1 per stage actor x 9 replica\(s\) x num_stages=4\), "
                                         r"but this autoscaling cluster can scale to at most 32 GPU"):
        _check_resources(too_many, get_strategy("ddp_pipeline").bundles(too_many), 9)


def test_auto_counts_the_gpus_it_can_scale_to_and_does_not_probe_from_cold(cold, monkeypatch, caplog):
    def probe():
        raise AssertionError("a one-GPU probe task with no GPU node up would wait for the autoscaler")

    monkeypatch.setattr(auto, "_probe_gpu_memory", probe)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = rtm.TrainConfig(model="lenet", dataset="digits", strategy="auto", use_gpu=True, batch_size=64)
    with caplog.at_level(logging.INFO, logger="raytrain_mgpu.planning.auto"):
        info = auto.cluster_info(cfg)
    assert (info.devices_per_node, info.device_memory_bytes) == ((4,) * 8, None)
    assert "no GPU node is up yet" in caplog.text and "the estimate without a memory limit" in caplog.text
    name, reason, _ = auto.choose_strategy(cfg, info)
    assert name == "ddp" and "ddp over all 32 devices" in reason
    assert auto.plan_config(cfg, name, info).num_workers == 32
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="raytrain_mgpu.planning.auto"):
        auto.cluster_info(cfg.replace(memory_budget_bytes=2**30))
    assert "using memory_budget_bytes=1073741824" in caplog.text
    # With a GPU node up, the probe runs as before.
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD), dict(GPU_NODE)])
    monkeypatch.setattr(auto, "_probe_gpu_memory", lambda: 24 * 2**30)
    assert auto.cluster_info(cfg).device_memory_bytes == 24 * 2**30


def test_compare_keeps_gpu_runs_at_zero_gpu_nodes(cold):
    cfg = rtm.TrainConfig(model="mlp", dataset="digits", use_gpu=True, batch_size=64)
    capacity = cluster.read_capacity()
    rows = _plan(cfg, ["ddp", "dp", "mp", "ddp2", "pipeline"], auto.cluster_info(cfg, capacity))
    planned = [row.label for row in rows if row.config is not None]
    assert {"ddp", "dp", "ddp2", "pipeline"} <= set(planned)
    _skip_unplaceable(rows, True, capacity)
    assert [row.label for row in rows if row.config is not None] == planned
    assert all(row.status != "skipped" for row in rows if row.label in planned)


def test_a_cluster_that_does_not_autoscale_keeps_todays_checks(fixed):
    capacity = cluster.read_capacity()
    assert not capacity.autoscales and capacity.gpus_per_node() == ()
    assert capacity.node_types_unknown == ""  # known to have none: its monitor runs without a config
    with pytest.raises(ValueError, match=r"use_gpu=True, but the Ray cluster has no GPU \(node 0: 4 CPU, 0 GPU\)"):
        cluster.check_placeable([{"CPU": 1, "GPU": 1}], True, "strategy='ddp'")
    with pytest.raises(ValueError, match=r"needs 8 x \{'CPU': 1\}.*cannot place \(node 0: 4 CPU, 0 GPU\)"):
        cluster.check_placeable([{"CPU": 1}] * 8, False, "strategy='ddp'")
    cfg = rtm.TrainConfig(model="mlp", dataset="digits", strategy="pipeline", num_stages=2, use_gpu=True)
    with pytest.raises(ValueError, match=r"needs 2 GPU .* but the Ray cluster has 0 GPU\. Lower num_stages"):
        _check_resources(cfg, get_strategy("pipeline").bundles(cfg), 1)
    assert auto.cluster_info(cfg).devices_per_node == (0,)
    rows = _plan(cfg, ["dp"], auto.ClusterInfo((4,), True))  # laid out for 4 GPUs the cluster lacks
    _skip_unplaceable(rows, True, capacity)
    assert rows[-1].status == "skipped" and "the Ray cluster has no GPU" in rows[-1].reason


def test_workers_go_to_the_node_types_the_user_names_and_what_no_type_has_is_refused(cold, monkeypatch):
    def bundles(**fields):
        return get_strategy("ddp").bundles(rtm.TrainConfig(use_gpu=True, batch_size=96, **fields))

    for fields in (dict(num_workers=24, resources_per_worker={"spot": 1}),  # gpu_spot: 6 nodes x spot 4
                   dict(num_workers=8, accelerator_type="L4"), dict(num_workers=8, accelerator_type="A10G")):
        cluster.check_placeable(bundles(**fields), True, "strategy='ddp'")
    with pytest.raises(ValueError, match=r"accelerator_type='H100': no node of this cluster \(alive, or of a node type "
                                         r"its autoscaler can add\) has that GPU type \(GPU types there: A10G, L4;"):
        cluster.check_placeable(bundles(num_workers=2, accelerator_type="H100"), True, "strategy='ddp'")
    with pytest.raises(ValueError, match=r"resources_per_worker asks for the Ray resource 'tpu_v9', which no node of "
                                         r"this cluster \(alive, or of a node type its autoscaler can add\) has "
                                         r"\(custom resources there: spot;"):
        cluster.check_placeable(bundles(num_workers=2, resources_per_worker={"tpu_v9": 1}), True, "strategy='ddp'")
    # strategy="auto" counts the GPUs of the nodes the workers may use: the two L4 nodes, not all 32
    monkeypatch.setattr(auto, "_probe_gpu_memory", lambda: None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    l4 = rtm.TrainConfig(model="lenet", dataset="digits", strategy="auto", use_gpu=True, batch_size=64,
                         accelerator_type="L4")
    assert auto.cluster_info(l4).devices_per_node == (4, 4)
    assert auto.cluster_info(l4.replace(accelerator_type=None)).devices_per_node == (4,) * 8


def test_the_gcs_answer_comes_first(cold, monkeypatch):
    # A Ray whose autoscaler publishes its node types: those, not the file's (here another cluster's).
    cold.write_text(yaml.safe_dump({"max_workers": 1, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 0}}, "cpu": {"resources": {"CPU": 4}}}}, sort_keys=False))
    monkeypatch.setattr(cluster.ray._private.state.state, "get_cluster_config", our_cluster_config)
    capacity = cluster.read_capacity()
    assert capacity.node_types_source == "the GCS"
    assert [t.name for t in capacity.node_types] == ["head", "gpu_ondemand", "gpu_spot", "gpu_l4", "cpu"]
    assert capacity.max_total("GPU") == 4 * (2 + 6 + 2)  # the GCS's types carry no top-level max_workers


def _write_config(path: Path, cpus: int) -> None:
    """A head of 0 CPUs and up to 2 nodes of ``cpus`` CPUs."""
    path.write_text(yaml.safe_dump({"max_workers": 2, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 0}}, "cpu": {"resources": {"CPU": cpus}, "max_workers": 2}}}, sort_keys=False))


def test_the_config_read_is_the_connected_clusters_own(machine, monkeypatch):
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD)])
    _write_config(machine.root / "other.yaml", cpus=64)
    fake_monitor(machine.proc, 77, SESSION[:-4] + "99", config=str(machine.root / "other.yaml"))
    # Only another Ray's monitor on this machine, and no bootstrap config here: not known, and said so.
    capacity = cluster.read_capacity()
    assert not capacity.autoscales
    assert capacity.node_types_unknown.startswith(f"the GCS holds no node types, no monitor of {SESSION} runs on "
                                                  f"this machine, and this process is not on the cluster's head")
    # On the head with `ray up`'s ~/ray_bootstrap_config.yaml (its monitor hidden from this user): that file.
    _write_config(machine.home / "ray_bootstrap_config.yaml", cpus=4)
    capacity = cluster.read_capacity()
    assert capacity.node_types_source == str(machine.home / "ray_bootstrap_config.yaml")
    assert capacity.max_total("CPU") == 8 and capacity.node_types_unknown == ""
    monkeypatch.setattr(autoscaler_config, "_driver_on_head", lambda: False)  # not on the head: another's file
    assert not cluster.read_capacity().autoscales and cluster.read_capacity().node_types_unknown
    # The connected cluster's monitor (the v2 autoscaler's), started in run/ with a relative path: the file there.
    run = machine.root / "run"
    run.mkdir()
    _write_config(run / "autoscaling.yaml", cpus=2)
    fake_monitor(machine.proc, 4242, SESSION, config="autoscaling.yaml", cwd=run, autoscaler="v2")
    capacity = cluster.read_capacity()
    assert capacity.node_types_source == str(run / "autoscaling.yaml") and capacity.max_total("CPU") == 4


def test_every_resource_key_counts_and_max_workers_reads_as_rays_autoscaler_reads_it(machine, monkeypatch):
    config = machine.root / "autoscaling.yaml"
    config.write_text(yaml.safe_dump({"max_workers": 3, "head_node_type": "head", "available_node_types": {
        "head": {"resources": {"CPU": 2}, "max_workers": 1},           # the head, and 1 worker node of its type
        "gpu_spot": {"resources": {"CPU": 8, "GPU": 2, "spot": 1}},    # no max_workers: the top-level 3
        "big": {"resources": {"CPU": 64, "GPU": 8}, "max_workers": 1},
        "off": {"resources": {"CPU": 4}, "max_workers": 0}}}, sort_keys=False))  # off can have no node: left out
    fake_monitor(machine.proc, 4242, SESSION, config=str(config))
    head = dict(HEAD, CPU=2.0)
    monkeypatch.setattr(cluster, "_nodes", lambda: [head])
    capacity = cluster.read_capacity()
    assert [(t.name, t.resources, t.max_count) for t in capacity.node_types] == [
        ("head", {"CPU": 2.0}, 2), ("gpu_spot", {"CPU": 8.0, "GPU": 2.0, "spot": 1.0}, 3),
        ("big", {"CPU": 64.0, "GPU": 8.0}, 1)]
    assert capacity.max_worker_nodes == 3 and "gpu_spot: 8 CPU, 2 GPU, 1 spot, up to 3" in capacity.describe()
    # 3 worker nodes at once of whichever types: the 3 richest in each resource, not every type at its max.
    assert capacity.max_total("GPU") == 8 + 2 + 2 and capacity.gpus_per_node() == (8, 2, 2)
    assert capacity.max_total("CPU") == 2 + 64 + 8 + 8 and capacity.max_total("spot") == 3
    # A spot node up already leaves room for 2 more.
    monkeypatch.setattr(cluster, "_nodes", lambda: [head, {"CPU": 8.0, "GPU": 2.0, "spot": 1.0, "memory": 1e9}])
    assert cluster.read_capacity().max_total("GPU") == 2 + 8 + 2
    with pytest.raises(ValueError, match=r"needs 14 GPU in all.* at most 12"):
        cluster.check_placeable([{"CPU": 1, "GPU": 1}] * 14, True, "strategy='ddp'")


def test_a_ray_this_process_started_has_no_node_types_and_a_machine_without_proc_sees_no_monitor(machine,
                                                                                                 monkeypatch):
    monkeypatch.setattr(autoscaler_config, "PROC", machine.root / "no-proc")  # macOS
    monkeypatch.setattr(cluster, "_nodes", lambda: [{"CPU": 4.0}])
    capacity = cluster.read_capacity()  # connected to a cluster: its monitor cannot be seen from here
    assert not capacity.autoscales and capacity.node_types_unknown.startswith("the GCS holds no node types")
    # ray.init() (or fit) started it here: a Ray without an autoscaler, known as such with no /proc either.
    monkeypatch.setattr(autoscaler_config, "_local_node", lambda: SimpleNamespace(session_name=SESSION,
                                                                                  is_head=lambda: True))
    capacity = cluster.read_capacity()
    assert not capacity.autoscales and capacity.node_types_unknown == ""


@pytest.mark.parametrize("text,reason", [
    ("max_workers: 2\nhead_node_type: head\navailable_node_types:\n  head: {resources: {CPU: 0}}\n"
     "  gpu: {max_workers: 2, node_config: {InstanceType: g5.xlarge}}\n",
     r"node type 'gpu' of \S+autoscaling.yaml lists no resources \(Ray fills them in from the cloud's instance "
     r"type\): add resources: \{CPU: \.\.\., GPU: \.\.\.\} to it"),
    ("available_node_types: [", r"cannot read the autoscaler config \S+autoscaling.yaml: "),
    ("max_workers: 2\n", r"the autoscaler config \S+autoscaling.yaml has no available_node_types"),
])
def test_a_config_that_does_not_say_what_its_nodes_have_leaves_them_unknown(machine, monkeypatch, text, reason):
    (machine.root / "autoscaling.yaml").write_text(text)
    fake_monitor(machine.proc, 4242, SESSION, config=str(machine.root / "autoscaling.yaml"))
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD)])
    capacity = cluster.read_capacity()
    assert not capacity.autoscales
    assert re.fullmatch(reason + ".*", capacity.node_types_unknown, re.S), capacity.node_types_unknown


# ----------------------------------------------------------------------------- real Ray, drivers in subprocesses

CAPACITY = """import json, sys, ray
from raytrain_mgpu.driver.cluster import read_capacity
ray.init(**json.loads(sys.argv[1]), log_to_driver=False)
c = read_capacity()
print(json.dumps({"autoscales": c.autoscales, "node_types": [[t.name, t.resources, t.max_count] for t in c.node_types],
                  "max_worker_nodes": c.max_worker_nodes, "source": c.node_types_source,
                  "unknown": c.node_types_unknown, "alive_cpus": [n.get("CPU", 0) for n in c.alive]}))
"""


def read_capacity_in_a_driver(env: dict, init: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", CAPACITY, json.dumps(init)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.ray
def test_a_local_ray_reads_as_not_autoscaling():
    # A real GCS and monitor of a plain `ray start --head --num-cpus 4` (no autoscaling config), a driver
    # connected to it: no node types, one node, and known to have none (its monitor found, without a config).
    root = Path(tempfile.mkdtemp(prefix="rtmloc-", dir="/tmp"))  # short: Ray's socket paths
    (root / "home").mkdir()
    head = RayNode(root / "t", base_env(root / "home", RAY_AUTH_MODE="disabled"))
    try:
        ports = free_port_flags()
        head.start(["--head", "--num-cpus", "4", "--include-dashboard=false",
                    *[str(x) for kv in ports.items() for x in kv]])
        capacity = read_capacity_in_a_driver(head.env, {"address": f"127.0.0.1:{ports['--port']}"})
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert not capacity["autoscales"]
    assert capacity["alive_cpus"] == [4.0]
    assert capacity["unknown"] == ""


COLD_FIT = dict(model="mlp", dataset="digits", num_workers=2, use_gpu=False, batch_size=64, epochs=2, name="cold")


@pytest.mark.ray
def test_fit_gets_its_nodes_from_the_autoscaler_from_cold_and_they_go_when_idle(tmp_path):
    # A head with 0 CPUs on 6379 and a 1-CPU type at 0 of at most 2 nodes, idle after 12 s: Ray's real autoscaler.
    root = Path(tempfile.mkdtemp(prefix="rtmas-", dir="/tmp"))  # short: Ray's socket paths
    cold = AutoscalingCluster(root, {"cpu1": {"resources": {"CPU": 1}, "max_workers": 2}}, max_workers=2,
                              idle_timeout_minutes=0.2)
    try:
        with cold:
            assert cold.worker_nodes() == 0
            # Drivers on the head (as `ray job submit`'s), with a HOME of their own: the config is found through
            # the head's monitor process, whose ~ is its own HOME.
            (root / "driver-home").mkdir()
            env = {**cold.env, "HOME": str(root / "driver-home")}
            capacity = read_capacity_in_a_driver(env, {"address": cold.address})
            assert capacity["node_types"] == [["ray.head.default", {"CPU": 0.0}, 1], ["cpu1", {"CPU": 1.0}, 2]]
            assert capacity["source"] == str(cold.home / "ray_bootstrap_config.yaml") and capacity["unknown"] == ""
            assert capacity["max_worker_nodes"] == 2 and capacity["alive_cpus"] == [0.0]
            # fit connects itself (address=), as a job script does.
            fit = {"kind": "fit", "own_ray": True,
                   "config": dict(COLD_FIT, address=cold.address, storage_path=str(tmp_path / "results"))}
            plan = driver_plan([fit], root / "plan.json")
            start = time.monotonic()
            done = subprocess.run([sys.executable, "tests/_fit_driver.py", str(plan), str(root / "results.json")],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=420)
            driver_s = time.monotonic() - start
            assert done.returncode == 0, done.stderr[-4000:]
            (run,) = json.loads((root / "results.json").read_text())
            assert run["ok"], run["error"]
            assert [row["epoch"] for row in run["history"]] == [1, 2] and run["history"][-1]["test_accuracy"] > 0.8
            # Both ranks on worker nodes the autoscaler added (the fake provider's ids); the head has no CPU.
            nodes = run["history"][-1]["node_id_per_rank"]
            assert len(set(nodes)) == 2 and FAKE_HEAD_NODE_ID not in nodes, nodes
            assert all(node.startswith(FAKE_HEAD_NODE_ID[:40]) for node in nodes), nodes
            assert re.search(r"Adding \d node\(s\) of type cpu1", cold.monitor_log())
            # Gone, and for being idle (the monitor logs the reason after it ended them).
            idle = re.compile(r"Removing \d nodes of type cpu1 \(idle\)")
            idle_s = wait_for(lambda: cold.worker_nodes() == 0 and idle.search(cold.monitor_log()), 120,
                              "the worker nodes ended by the autoscaler once idle")
            print(f"fit from cold: {run['seconds']} s ({driver_s:.1f} s with the driver's start); "
                  f"the worker nodes gone {idle_s:.1f} s after")
        assert cold.pids() == []  # every process of the head and of the nodes its monitor started has ended
    finally:
        cold.stop()
        shutil.rmtree(root, ignore_errors=True)
