"""cluster.yaml passes Ray's own validator, and keeps the promises its comments make."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray._private.label_utils import validate_node_label_syntax
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain_mgpu.data.parquet_stream import INGEST_LABEL, placement

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"

# Parameters of EC2 RunInstances that a node_config here may use: Ray passes node_config
# to boto3 unchecked, so a typo would only fail at `ray up`.
EC2_RUN_INSTANCES_KEYS = {"InstanceType", "ImageId", "BlockDeviceMappings", "InstanceMarketOptions",
                          "IamInstanceProfile", "KeyName", "SubnetIds", "SecurityGroupIds", "TagSpecifications",
                          "Placement", "NetworkInterfaces", "CapacityReservationSpecification", "UserData",
                          "MetadataOptions"}
# The worker profile scoped to the run bucket (its policy is in cluster.yaml's comments).
WORKER_PROFILE_ARN = re.compile(r"arn:aws:iam::(ACCOUNT|\d{12}):instance-profile/raytrain-mgpu-worker")


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _validate(config: dict) -> dict:
    """What `ray up` does before it talks to AWS: merge the provider defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_ray_validator_accepts_it_and_rejects_unknown_keys_and_fractional_resources(raw):
    prepared = _validate(raw)
    assert prepared["provider"]["type"] == "aws"

    mutations = {
        "unknown top-level key": lambda c: c.update(idle_timeout_minute=5),
        "unknown node-type key": lambda c: c["available_node_types"]["gpu_spot"].update(min_worker=1),
        "fractional GPU": lambda c: c["available_node_types"]["gpu_spot"]["resources"].update(GPU=0.5),
        "resources as a string": lambda c: c["available_node_types"]["head"]["resources"].update(CPU="0"),
    }
    for what, mutate in mutations.items():
        bad = copy.deepcopy(raw)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)
            pytest.fail(f"the validator accepted a config with an {what}")


def test_head_trains_nothing_and_gpu_workers_scale_from_zero_beside_one_cpu_ingest_node(raw):
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    workers = {name: t for name, t in types.items() if name != raw["head_node_type"]}
    for name, node_type in workers.items():
        resources = node_type["resources"]
        assert all(isinstance(v, int) and not isinstance(v, bool) for v in resources.values()), name
        assert node_type["min_workers"] == (1 if name == "cpu" else 0), name  # the streams' CPU node stays up
        assert set(node_type["node_config"]) <= EC2_RUN_INSTANCES_KEYS, name
        gpu_types = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
        assert len(gpu_types) == (1 if resources.get("GPU", 0) >= 1 else 0), name  # each GPU type names its GPU
    # a GPU type to choose (accelerator_type), a spot type marked for resources_per_worker, one CPU-only type
    assert {k for t in workers.values() for k in t["resources"] if k.startswith("accelerator_type:")} == {
        "accelerator_type:A10G", "accelerator_type:L4"}
    assert [name for name, t in workers.items() if "spot" in t["resources"]] == ["gpu_spot"]
    assert workers["gpu_spot"]["labels"] == {"market-type": "spot"}
    assert [name for name, t in workers.items() if not t["resources"].get("GPU")] == ["cpu"]
    markets = {t["node_config"].get("InstanceMarketOptions", {}).get("MarketType", "on-demand")
               for t in workers.values()}
    assert markets == {"on-demand", "spot"}
    assert workers["cpu"]["node_config"].get("InstanceMarketOptions") is None  # the streams' node is not reclaimed
    assert raw["idle_timeout_minutes"] > 0
    assert all(1 <= t["max_workers"] <= raw["max_workers"] for t in workers.values())


def test_the_cpu_type_is_where_a_parquet_streams_tasks_run_and_no_gpu_type_is(raw):
    """Its label is the one the stream's placement looks for (a valid Ray label), and a cluster of its nodes and
    GPU nodes streams on it alone, with all of its CPUs."""
    types = raw["available_node_types"]
    validate_node_label_syntax(types["cpu"]["labels"])
    assert [name for name, t in types.items() if t.get("labels", {}).get(INGEST_LABEL[0]) == INGEST_LABEL[1]] == ["cpu"]
    nodes = [{"Alive": True, "Resources": {k: float(v) for k, v in t["resources"].items()}, "Labels": t.get("labels", {})}
             for t in types.values()]
    where = placement(nodes, held_cpus=4)  # 4 GPU workers of 1 CPU on a GPU node
    assert where.label_selector == dict([INGEST_LABEL]) and where.cpus == types["cpu"]["resources"]["CPU"]


def test_installs_this_project_with_token_auth_and_a_private_dashboard(raw):
    assert raw["file_mounts"]["~/raytrain-mgpu"] == "."
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    setup = " ; ".join(raw["setup_commands"])
    assert "pip install -q -c ~/raytrain-mgpu/constraints.txt -e ~/raytrain-mgpu" in setup
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = " ".join(raw[key])
        assert "export RAY_AUTH_MODE=token" in start, key
    head_start = " ".join(raw["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    text = CLUSTER_YAML.read_text()
    assert "0.0.0.0" not in text and "IpPermissions" not in text  # nothing opened beyond SSH


def test_holds_no_credentials():
    text = CLUSTER_YAML.read_text()
    patterns = [r"AKIA[0-9A-Z]{16}", r"aws_secret_access_key", r"aws_access_key_id", r"-----BEGIN",
                r"RAY_AUTH_TOKEN=", r"ssh_private_key:\s*\S"]
    for pattern in patterns:
        # Commented examples are fine; live keys are not.
        live = [line for line in text.splitlines() if re.search(pattern, line) and not line.lstrip().startswith("#")]
        assert not live, (pattern, live)


def test_workers_get_the_bucket_scoped_profile_and_the_broad_role_stays_on_the_head(raw):
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]["node_config"]
    # No profile on the head: `ray up` then attaches its default ray-autoscaler-v1 (EC2 and S3
    # full access) to the head only; a profile named here would skip creating that role.
    assert "IamInstanceProfile" not in head
    workers = {name: t["node_config"] for name, t in types.items() if name != raw["head_node_type"]}
    assert workers
    for name, node_config in workers.items():
        profile = node_config.get("IamInstanceProfile")
        assert profile is not None and set(profile) == {"Arn"}, (name, profile)
        assert WORKER_PROFILE_ARN.fullmatch(profile["Arn"]), (name, profile)
    live = [line for line in CLUSTER_YAML.read_text().splitlines()
            if "ray-autoscaler-v1" in line and not line.lstrip().startswith("#")]
    assert not live, live  # the broad profile is nowhere in a node_config


def test_every_node_type_requires_imdsv2(raw):
    for name, node_type in raw["available_node_types"].items():
        options = node_type["node_config"].get("MetadataOptions")
        assert options is not None, name
        assert options["HttpTokens"] == "required" and options.get("HttpEndpoint", "enabled") == "enabled", name
        # 1: Ray and jobs run on the host; 2 only for containers off the host network
        assert options["HttpPutResponseHopLimit"] in (1, 2), name
    assert "docker" not in raw or all(
        t["node_config"]["MetadataOptions"]["HttpPutResponseHopLimit"] == 2
        for t in raw["available_node_types"].values())


def test_every_worker_node_runs_spot_watch_after_ray_start_with_a_deadline_below_the_notice(raw):
    """A spot reclaim becomes a Ray preemption drain only if spot-watch runs on the node (docs/clusters.md: Spot and elastic)."""
    start = " ".join(raw["worker_start_ray_commands"])
    assert start.index("ray start") < start.index("raytrain-mgpu spot-watch")  # it finds its node in Ray
    grace = int(re.search(r"spot-watch --grace-s (\d+)", start).group(1))
    assert 0 < grace < 120  # AWS gives two minutes' notice; the save must fit before the reclaim
    assert "--notice-url http://169.254.169.254/latest/meta-data/spot/instance-action" in start
    assert "RAY_AUTH_MODE=token" in start.split("raytrain-mgpu spot-watch")[0]  # inherited by spot-watch
