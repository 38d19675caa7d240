"""``raytrain-mgpu spot-watch``: turns a spot node's termination notice into a Ray node drain.

Run on every spot worker node after ``ray start`` (cluster.yaml's worker start commands). On a
notice it asks the GCS to drain its own node with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
deadline ``grace_s`` from now (what ``ray drain-node`` does), waits ``grace_s`` and exits. Ray
Train sees the drain (its preemption watcher), the workers save a step checkpoint
(``checkpointing/preemption.py``), and at the deadline the group restarts without the node, counted
against ``max_preemption_failures`` and not ``max_failures``.

The notices:

- SIGTERM (and SIGINT): the OS sends it at shutdown. Ray's own processes on the node get it
  too, so it only buys time where they outlive this process's handler (e.g. a systemd unit
  ordered after Ray's, or a node whose shutdown stops this watcher first).
- ``notice_url``: a cloud metadata endpoint polled every ``poll_s``: GCP
  ``http://metadata.google.internal/computeMetadata/v1/instance/preempted`` ("TRUE" on a notice;
  sent with ``Metadata-Flavor: Google``), AWS ``http://169.254.169.254/latest/meta-data/spot/instance-action``
  (404 until a notice; asked with an IMDSv2 token when one can be had). A notice is any 200 answer
  whose body is not empty or ``FALSE``.

Choose ``grace_s`` below the cloud's notice (GCP 30 s, AWS 120 s) minus the checkpoint's save
time, so Ray restarts the group before the machine goes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

__all__ = ["own_node_id", "drain_node", "notice_at_url", "watch"]

logger = logging.getLogger(__name__)
PREEMPTION_REASON = "DRAIN_NODE_REASON_PREEMPTION"


def _gcs(address: str):
    # late: loads Ray (0.5 s), as in the two functions below; `raytrain-mgpu spot-watch --help` imports this module
    import ray._raylet
    from ray._private import services

    return ray._raylet.GcsClient(address=services.canonicalize_bootstrap_address_or_die(address))


def own_node_id(address: str, node_ip: Optional[str] = None, timeout_s: float = 60.0) -> str:
    """The hex id of the alive Ray node at this machine's IP (as Ray picks it), waiting for it to register."""
    # late: loads Ray (see _gcs)
    from ray._private import services
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    gcs = _gcs(address)
    ip = node_ip or services.get_node_ip_address(services.canonicalize_bootstrap_address_or_die(address))
    deadline = time.monotonic() + timeout_s
    while True:
        infos = gcs.get_all_node_info(timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values()
        ours = [info.node_id.hex() for info in infos if info.node_manager_address == ip]
        if len(ours) == 1:
            return ours[0]
        if len(ours) > 1:
            raise ValueError(f"{len(ours)} Ray nodes run at {ip}: pass --node-id (one of {sorted(ours)}).")
        if time.monotonic() > deadline:
            raise ValueError(f"no alive Ray node at {ip} after {timeout_s:.0f} s: start spot-watch after "
                             f"`ray start` on the same machine, or pass --node-ip/--node-id.")
        time.sleep(1.0)


def drain_node(address: str, node_id: str, grace_s: float, message: str = "spot termination notice") -> None:
    """``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds grace_s``."""
    from ray.core.generated import autoscaler_pb2  # late: loads Ray (see _gcs)

    deadline_ms = time.time_ns() // 1_000_000 + int(grace_s * 1000)
    accepted, why = _gcs(address).drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(PREEMPTION_REASON),
                                             message, deadline_ms)
    if not accepted:
        raise RuntimeError(f"the GCS refused to drain node {node_id}: {why}")


def _aws_token(url: str, timeout_s: float) -> Optional[str]:
    """An IMDSv2 session token (cluster.yaml sets ``HttpTokens: required``: a GET without one gets 401)."""
    root = url.split("/latest/meta-data/")[0]
    request = urllib.request.Request(f"{root}/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.read().decode().strip()
    except (urllib.error.URLError, OSError):  # IMDSv1 only, or unreachable: ask without a token
        return None


def notice_at_url(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the cloud's metadata endpoint announces a termination (see the module's docstring)."""
    headers = {"Metadata-Flavor": "Google"}
    if "/latest/meta-data/" in url:  # AWS's instance metadata: IMDSv2 first
        token = _aws_token(url, timeout_s)
        if token:
            headers["X-aws-ec2-metadata-token"] = token
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body = answer.read().decode(errors="replace").strip()
    except (urllib.error.URLError, OSError):  # 404 (AWS: no notice), or the endpoint unreachable
        return False
    return body not in ("", "FALSE")


def watch(address: str, grace_s: float, node_id: Optional[str] = None, node_ip: Optional[str] = None,
          notice_url: Optional[str] = None, poll_s: float = 5.0, log: Callable[[str], None] = logger.info) -> int:
    """Wait for a notice (SIGTERM/SIGINT, or ``notice_url``), drain this node, wait ``grace_s``; 0 when drained."""
    node_id = node_id or own_node_id(address, node_ip)
    noticed = threading.Event()
    why = {"notice": ""}

    def on_signal(signum, frame):
        why["notice"] = signal.Signals(signum).name
        noticed.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    log(f"spot-watch: node {node_id} at {address}; on SIGTERM{' or ' + notice_url if notice_url else ''} "
        f"it drains with a {grace_s:g} s deadline")
    try:
        while not noticed.wait(poll_s if notice_url else 1.0):
            if notice_url and notice_at_url(notice_url):  # a 1 s wake-up without a URL: nothing to poll
                why["notice"] = notice_url
                break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    drain_node(address, node_id, grace_s, f"spot termination notice ({why['notice']})")
    log(f"spot-watch: {why['notice']}: node {node_id} drained (preemption), deadline in {grace_s:g} s")
    time.sleep(grace_s)  # the drain's deadline: Ray Train restarts the group without this node
    return 0


def add_arguments(parser) -> None:
    """``raytrain-mgpu spot-watch``'s options."""
    parser.add_argument("--grace-s", type=float, required=True,
                        help="the drain's deadline in seconds from the notice (below the cloud's notice: GCP 30, AWS 120)")
    parser.add_argument("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else this node's 'auto')")
    parser.add_argument("--notice-url", help="also poll this metadata URL for a notice, e.g. GCP's "
                        ".../computeMetadata/v1/instance/preempted or AWS's .../latest/meta-data/spot/instance-action")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between --notice-url polls")
    parser.add_argument("--node-id", help="this node's Ray id (default: the alive node at this machine's IP)")
    parser.add_argument("--node-ip", help="this node's IP as Ray knows it (default: as Ray picks it)")


def run_and_print(args) -> int:
    if not args.grace_s >= 0 or args.grace_s == float("inf"):
        raise ValueError(f"spot-watch --grace-s={args.grace_s}: must be a finite number >= 0 "
                         f"(seconds from the notice to the drain's deadline). Set it to e.g. 25 on GCP, 100 on AWS.")
    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    return watch(address, args.grace_s, node_id=args.node_id, node_ip=args.node_ip, notice_url=args.notice_url,
                 poll_s=args.poll_s, log=lambda line: print(line, flush=True))
