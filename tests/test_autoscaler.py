"""Resource checks on an autoscaling cluster: our own ``cluster.yaml`` from cold (0 GPU nodes up).

The autoscaler's state is faked the way Ray's GCS hands it out: ``cluster.yaml``'s
``available_node_types`` become the ``autoscaler_pb2.ClusterConfig`` proto that
``ray._private.state.state.get_cluster_config()`` returns, and only the head is alive.
No Ray is started except in the last test (the shared ``ray_session``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from ray.core.generated import autoscaler_pb2

import raytrain_mgpu as rtm
from raytrain_mgpu.planning import auto
from raytrain_mgpu.runtime import cluster
from raytrain_mgpu.planning.compare import _plan, _skip_unplaceable
from raytrain_mgpu.pipeline.runner import _check_resources, run_pipeline
from raytrain_mgpu.strategies import get_strategy

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
# The head as `ray up` starts it: `CPU: 0` (cluster.yaml), Ray's own memory and node resources.
HEAD = {"CPU": 0.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}
GPU_NODE = {"CPU": 48.0, "GPU": 4.0, "memory": 1.5e11, "object_store_memory": 2e10, "node:10.0.0.2": 1.0}
GPUS_AT_MOST = 4 * (2 + 6)  # gpu_ondemand up to 2 nodes, gpu_spot up to 6, 4 GPUs each


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


@pytest.fixture
def cold(monkeypatch):
    """Our cluster.yaml just after `ray up`: the head alive, both GPU node types at 0 nodes."""
    monkeypatch.setattr(cluster.ray._private.state.state, "get_cluster_config", our_cluster_config)
    monkeypatch.setattr(cluster, "_nodes", lambda: [dict(HEAD)])
    monkeypatch.delenv("RAYTRAIN_MGPU_EMULATE_GPUS", raising=False)


@pytest.fixture
def fixed(monkeypatch):
    """A cluster that does not autoscale (no ClusterConfig in the GCS): one CPU node of 4 CPUs."""
    monkeypatch.setattr(cluster.ray._private.state.state, "get_cluster_config", lambda: None)
    monkeypatch.setattr(cluster, "_nodes", lambda: [{"CPU": 4.0, "memory": 8e9}])
    monkeypatch.delenv("RAYTRAIN_MGPU_EMULATE_GPUS", raising=False)


def test_our_cluster_yaml_reads_as_eight_gpu_nodes_it_can_have(cold, monkeypatch):
    capacity = cluster.read_capacity()
    assert capacity.autoscales
    assert [(t.name, t.resources, t.max_count) for t in capacity.node_types] == [
        ("head", {"CPU": 0.0}, 1), ("gpu_ondemand", {"CPU": 48.0, "GPU": 4.0}, 2),
        ("gpu_spot", {"CPU": 48.0, "GPU": 4.0}, 6)]
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
    with caplog.at_level(logging.INFO, logger="raytrain_mgpu.runtime.cluster"):
        cluster.check_placeable(get_strategy(strategy).bundles(cfg), True, f"strategy={strategy!r}")
    assert "waits for the autoscaler to add nodes" in caplog.text


def test_a_worker_bigger_than_every_node_type_is_refused_naming_the_largest(cold):
    bundles = get_strategy("dp").bundles(rtm.TrainConfig(strategy="dp", num_workers=1, use_gpu=True,
                                                         gpus_per_worker=8))
    assert bundles == [{"CPU": 1, "GPU": 8}]
    with pytest.raises(ValueError, match=r"strategy='dp': one worker needs 8 GPU, but the largest node type "
                                         r"'gpu_ondemand' has 4 GPU \(node types head: 0 CPU, 0 GPU, up to 1; "
                                         r"gpu_ondemand: 48 CPU, 4 GPU, up to 2; gpu_spot: 48 CPU, 4 GPU, up to 6; "
                                         r"now up: node 0: 0 CPU, 0 GPU\), and a worker cannot span nodes\. "
                                         r"Set gpus_per_worker to at most 4, or add a node type with 8 GPU"):
        cluster.check_placeable(bundles, True, "strategy='dp'")


def test_more_gpus_than_the_node_types_can_add_is_refused(cold):
    bundles = [{"CPU": 1, "GPU": 1}] * (GPUS_AT_MOST + 1)
    with pytest.raises(ValueError, match=rf"needs {GPUS_AT_MOST + 1} GPU in all, but this autoscaling cluster "
                                         rf"can scale to at most {GPUS_AT_MOST} .*raise max_workers"):
        cluster.check_placeable(bundles, True, "strategy='ddp'")
    # The totals fit (27 of 32 GPUs), but a 3-GPU worker takes a 4-GPU node, and there are 8 of them.
    with pytest.raises(ValueError, match=r"needs 9 x \{'CPU': 1, 'GPU': 3\}, which this autoscaling cluster "
                                         r"cannot place even at its largest"):
        cluster.check_placeable([{"CPU": 1, "GPU": 3}] * 9, True, "strategy='ddp2'")


def test_the_pipeline_gets_past_its_checks_at_zero_gpu_nodes(cold, monkeypatch, storage):
    # Training itself is out of reach here: the first thing after the checks raises instead.
    class PastTheChecks(Exception):
        pass

    def train_attempt(*args, **kwargs):
        raise PastTheChecks

    monkeypatch.setattr("raytrain_mgpu.pipeline.runner.train_attempt", train_attempt)
    cfg = rtm.TrainConfig(model="mlp", dataset="digits", strategy="pipeline", num_stages=4, num_microbatches=4,
                          use_gpu=True, storage_path=storage)
    with pytest.raises(PastTheChecks):
        run_pipeline(cfg, events=None)
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
    name, reason = auto.choose_strategy(cfg, info)
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


def test_a_local_ray_reads_as_not_autoscaling(ray_session):
    # The real GCS of the shared test instance (ray.init(num_cpus=4)): no node types, one node.
    capacity = cluster.read_capacity()
    assert not capacity.autoscales
    assert [node["CPU"] for node in capacity.alive] == [4.0]
