"""A real two-node Ray cluster on one machine: one network namespace per node.

``ray.cluster_utils.Cluster`` starts several raylets on one IP, so Ray Train gives every
worker node rank 0 and gloo talks over loopback. Here each node lives in its own network
namespace with its own address, joined by a veth pair:

    namespace <prefix>h  rtm0 10.213.77.1/24  <-- veth -->  rtm0 10.213.77.2/24  namespace <prefix>w
         Ray head (GCS, raylet)                                   Ray worker node (raylet)
         driver scripts run here

Both ends carry the same interface name so that one ``GLOO_SOCKET_IFNAME=rtm0`` fits
every worker. The subnet is private and exists only inside the two namespaces, so no
traffic leaves them. Namespaces share the file system and PIDs with the host: a folder
under the test's tmp dir is "shared storage"; ``private_dirs`` are covered, on the worker
node only, by a read-only tmpfs of its own mount namespace (a path the head sees and the
worker node can neither see nor write: a storage path that is not shared, as where a
node's mount is missing and its local disk refuses the path).

Ray processes are torn down through ``_ray_nodes`` (by environment marker, never with
``ray stop``), then the namespaces are deleted, which deletes the veth pair too.
Requires root and ``ip`` (iproute2) and ``unshare`` (util-linux).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from _ray_nodes import VENV_BIN, RayNode, base_env

SUBNET = "10.213.77"
IFNAME = "rtm0"
HEAD_IP, WORKER_IP = f"{SUBNET}.1", f"{SUBNET}.2"
GCS_PORT = 6379  # inside the head's own namespace: nothing else listens there

# The GCS declares a node dead after ~3 s instead of ~30 s (period x threshold + timeout).
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "2", "RAY_health_check_initial_delay_ms": "1000"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable_reason() -> Optional[str]:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root, e.g. in CI)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs `{tool}`: apt-get install -y {package}"
    probe = f"rtmp{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace here: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class TwoNodeCluster:
    """Head in one namespace, worker node in another. Use as a context manager.

    ``start_worker=False``: the head alone at first (its namespaces are both made); the test
    starts the worker node later with ``start_worker_node()``, e.g. to grow an elastic run."""

    def __init__(self, root: Path, private_dirs: Sequence[Path] = (), head_cpus: int = 1, worker_cpus: int = 1,
                 start_worker: bool = True):
        self.root = Path(root)
        self.start_worker = start_worker
        self.private_dirs = [Path(p) for p in private_dirs]
        self.head_cpus, self.worker_cpus = head_cpus, worker_cpus
        tag = uuid.uuid4().hex[:6]
        self.head_ns, self.worker_ns = f"rtm{tag}h", f"rtm{tag}w"
        self.address = f"{HEAD_IP}:{GCS_PORT}"
        (self.root / "home").mkdir(parents=True, exist_ok=True)
        self.env = base_env(self.root / "home", RAY_AUTH_MODE="disabled", GLOO_SOCKET_IFNAME=IFNAME,
                            **FAST_NODE_DEATH)  # fit sets its controller poll itself
        self.head: Optional[RayNode] = None
        self.worker: Optional[RayNode] = None
        self._namespaces: List[str] = []

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "TwoNodeCluster":
        try:
            self._make_network()
            self.head = RayNode(self.root / "h", self.env, prefix=["ip", "netns", "exec", self.head_ns])
            self.head.start(["--head", "--node-ip-address", HEAD_IP, "--port", str(GCS_PORT),
                             "--num-cpus", str(self.head_cpus), "--include-dashboard=false"])
            if self.start_worker:
                self.start_worker_node()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_network(self) -> None:
        veth_h, veth_w = f"{self.head_ns}v", f"{self.worker_ns}v"  # <= 15 characters
        for ns in (self.head_ns, self.worker_ns):
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
        _ip("link", "add", veth_h, "type", "veth", "peer", "name", veth_w)
        for ns, veth, ip in ((self.head_ns, veth_h, HEAD_IP), (self.worker_ns, veth_w, WORKER_IP)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "link", "set", veth, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def start_worker_node(self, labels: Optional[Dict[str, str]] = None) -> None:
        """(Re)start the worker node; a restarted node gets a fresh marker and temp dir. ``labels``: Ray node labels
        (``ray start --labels``) of this node only; a node started again without them has none."""
        prefix = ["ip", "netns", "exec", self.worker_ns]
        if self.private_dirs:
            mounts = " && ".join(f"mount -t tmpfs -o ro rtm-private {d}" for d in self.private_dirs)
            for d in self.private_dirs:
                d.mkdir(parents=True, exist_ok=True)
            prefix += ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]
        attempt = 0 if self.worker is None else int(self.worker.temp_dir.name.rsplit("-", 1)[-1]) + 1
        self.worker = RayNode(self.root / f"w-{attempt}", self.env, prefix=prefix)
        self.worker.start(["--address", self.address, "--node-ip-address", WORKER_IP,
                           "--num-cpus", str(self.worker_cpus),
                           *(["--labels", ",".join(f"{k}={v}" for k, v in labels.items())] if labels else [])])

    def close(self) -> None:
        for node in (self.worker, self.head):
            if node is not None:
                node.stop()
        for ns in self._namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces = []

    # ------------------------------------------------------------------ drivers

    def python(self, args: Sequence[str], extra_env: Optional[Dict[str, str]] = None, **popen_kwargs):
        """Start ``python <args>`` as a driver in the head's namespace (a Popen)."""
        env = {**self.env, "RAY_ADDRESS": self.address, **(extra_env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.head_ns, f"{VENV_BIN}/python", *args],
                                env=env, **popen_kwargs)


@contextlib.contextmanager
def two_node_site(prefix: str, private: bool = False, env: Optional[Dict[str, str]] = None,
                  **cluster_kwargs) -> Iterator[Tuple[TwoNodeCluster, Path]]:
    """A module's two-node cluster and its folder (``root/shared``: storage both nodes see;
    ``root/private`` with ``private=True``: a folder only the head sees). Skips with the reason
    where namespaces cannot be made, except on CI (``CI=true``), where that is a failure.
    ``env``: extra settings for every Ray process. Everything is torn down on exit."""
    import pytest  # a test helper: only the fixtures call this

    reason = unavailable_reason()  # creates and deletes a probe namespace: call it from a fixture, not at collection
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the two-node tests cannot run on this CI machine: {reason}")
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: Ray's socket paths live below
    (root / "shared").mkdir()
    started = time.monotonic()
    try:
        if private:
            cluster_kwargs["private_dirs"] = [root / "private"]
        cluster = TwoNodeCluster(root / "cluster", **cluster_kwargs)
        cluster.env.update(env or {})
        with cluster:
            print(f"two-node cluster up in {time.monotonic() - started:.0f} s")
            yield cluster, root
    finally:
        shutil.rmtree(root, ignore_errors=True)
