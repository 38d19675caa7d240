"""Ray's real autoscaler on one machine, from cold: a head with 0 CPUs whose monitor starts worker
nodes (local raylets, Ray's fake node provider) when demand appears and ends them when idle.

    with AutoscalingCluster(root, {"cpu1": {"resources": {"CPU": 1}, "max_workers": 2}}) as cluster:
        cluster.address, cluster.env, cluster.worker_nodes()

What it rests on, measured with Ray 2.60:

- The fake provider starts its nodes against the GCS at this machine's IP and port 6379 unless its
  provider config names another (``gcs_address``: a head on a free port worked as well). The head
  listens on 6379, as a ``ray up`` head does, so only one such cluster can run on a machine at a
  time: its tests are in conftest.py's OWN_CLUSTERS group, one process, and no other test starts a
  Ray on 6379 outside a network namespace. Taken already, the start fails saying so.
- ``ray.cluster_utils.AutoscalingCluster`` reads an example config the pip wheel lacks and runs
  ``ray stop --force`` (every Ray of the user on the machine). So the config is written here, and the
  head is started with ``ray start`` and ended by its processes alone (``_ray_nodes``): every process
  of the cluster, the worker nodes' included (the head's monitor starts them), inherits the head's
  marker.
- The head runs as ``ray up`` starts it: ``--autoscaling-config=~/ray_bootstrap_config.yaml`` (the
  monitor expands the ``~`` with its own HOME), token authentication with a token of the cluster's own.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import yaml
from _ray_nodes import RayNode, base_env, free_port_flags, marked_pids

GCS_PORT = 6379  # where the fake provider's nodes look for the GCS (see above)
HEAD_TYPE = "ray.head.default"
BOOTSTRAP = "ray_bootstrap_config.yaml"  # the name `ray up` gives it in the head's home


def autoscaling_config(worker_types: Dict[str, dict], max_workers: int, idle_timeout_minutes: float) -> dict:
    """A cluster-launcher config for the fake provider: the head with 0 CPUs, ``worker_types`` at
    ``min_workers: 0`` unless they say otherwise, and the empty sections the launcher's schema wants."""
    types = {HEAD_TYPE: {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}}
    for name, node_type in worker_types.items():
        types[name] = {"node_config": {}, "min_workers": 0, **node_type}
    empty_lists = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                   "head_start_ray_commands", "worker_start_ray_commands", "cluster_synced_files", "rsync_exclude",
                   "rsync_filter")
    return {"cluster_name": "rtm-autoscaling", "max_workers": max_workers, "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_minutes, "head_node_type": HEAD_TYPE, "available_node_types": types,
            # launch_multiple: the nodes the autoscaler asks for in one round start together, as a cloud's do
            # (else one a round: a second 1-CPU node came 3 s after the first)
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "launch_multiple": True},
            "auth": {}, "docker": {}, "file_mounts": {}, "file_mounts_sync_continuously": False,
            **{key: [] for key in empty_lists}}


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> float:
    """Poll ``predicate`` until it holds; the seconds it took. AssertionError naming ``what`` past ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - start


class AutoscalingCluster:
    """The head (``ray start --head`` on port 6379 with an autoscaling config) and what its monitor starts."""

    def __init__(self, root: Path, worker_types: Dict[str, dict], max_workers: int = 2,
                 idle_timeout_minutes: float = 0.1):
        self.root = Path(root)
        self.config = autoscaling_config(worker_types, max_workers, idle_timeout_minutes)
        self.home = self.root / "head-home"  # the head's HOME: `ray up`'s bootstrap config lives here
        self.token_path = self.root / "auth_token"
        # Every Ray process of the cluster and every driver of it: token authentication with this token.
        auth = dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        self.env = base_env(self.home, **auth)
        # RAY_FAKE_CLUSTER: the fake provider refuses to start without it; the monitor's round every second.
        self.node = RayNode(self.root / "t", {**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        self.address = f"127.0.0.1:{GCS_PORT}"

    def start(self) -> "AutoscalingCluster":
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", GCS_PORT)) == 0:
                raise RuntimeError(f"port {GCS_PORT} is taken (another Ray head on this machine?), and the fake node "
                                   f"provider's nodes join the GCS there only: end that Ray, then run this test again")
        self.home.mkdir(parents=True, exist_ok=True)
        self.token_path.write_text(uuid.uuid4().hex + "\n")
        self.token_path.chmod(0o600)
        (self.home / BOOTSTRAP).write_text(yaml.safe_dump(self.config, sort_keys=False))
        ports = free_port_flags(skip=("--port",))
        self.node.start(["--head", "--num-cpus", "0", "--port", str(GCS_PORT), f"--autoscaling-config=~/{BOOTSTRAP}",
                         *[str(x) for kv in ports.items() for x in kv]])
        return self

    def stop(self) -> None:
        self.node.stop()

    def pids(self) -> List[int]:
        """Every live process of the cluster (the head's and its worker nodes')."""
        return marked_pids(self.node.marker)

    def worker_nodes(self) -> int:
        """Worker nodes up: raylets of the cluster other than the head's (one raylet a node)."""
        return max(len(self._raylets()) - 1, 0)

    def _raylets(self) -> List[str]:
        raylets = []
        for pid in self.pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:  # ended meanwhile
                continue
            if argv and argv[0].endswith(b"/raylet"):
                raylets.append(argv[0].decode())
        return raylets

    def monitor_log(self) -> str:
        logs = self.root / "t" / "session_latest" / "logs"
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("monitor.*")) if p.is_file())

    def __enter__(self) -> "AutoscalingCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def driver_plan(steps: List[dict], path: Path) -> Path:
    """A plan file for tests/_fit_driver.py."""
    path.write_text(json.dumps({"steps": steps}))
    return path
