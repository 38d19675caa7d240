"""An autoscaling cluster's node types, read where Ray's own autoscaler reads them.

Ray 2.60's autoscaler keeps its node types to itself: ``get_cluster_config()`` stays None on a
``ray up`` cluster (v1 and v2 autoscaler alike). Its monitor, a process on the head, reads them from
the file it was started with (``--autoscaling-config``; on a ``ray up`` head
``~/ray_bootstrap_config.yaml``, the launcher's config filled out). So does this module:

1. the monitor of the connected cluster among this machine's processes, and the file it names (a
   ``~`` is its own HOME, a relative path its own working folder, as it reads them). Its
   ``--logs-dir`` lies in the connected cluster's session folder: the monitor of another Ray on the
   machine (a notebook's local Ray, a second head in a network namespace) has another session;
2. where no monitor of it can be seen (processes of another user hidden): ``~/ray_bootstrap_config.yaml``
   of this process's user, when this process runs on the cluster's head (``ray job submit``'s drivers do).

Elsewhere (a laptop with the head's address, Ray Client) neither can be seen, and the answer says so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import ray
import ray._private.worker
import yaml
from ray.util.client import ray as client

logger = logging.getLogger(__name__)

PROC = Path("/proc")
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` leaves the config on the head
# The monitor's entry points (services.start_monitor): v1's and the v2 autoscaler's.
_MONITORS = (b"/autoscaler/_private/monitor.py", b"/autoscaler/v2/monitor.py")


@dataclass(frozen=True)
class FoundNodeTypes:
    """What an autoscaler config says the cluster can add; empty for a cluster without one."""

    node_types: Tuple[Tuple[str, Dict[str, float], int], ...] = ()
    """``(name, resources, max count)`` per type that can have a node; -1: no limit."""
    max_worker_nodes: int = -1
    """The config's top-level ``max_workers``: worker nodes of all types together (the head not counted)."""
    source: str = ""
    """The file read."""
    unknown: str = ""
    """Why no config could be read (empty when one was, or when the cluster's monitor has none)."""


def read_node_types() -> FoundNodeTypes:
    """The connected cluster's node types, from the config file its autoscaler reads; none for a Ray that this
    process started (``ray.init()`` without an address, or ``fit``'s own), which has no autoscaler."""
    node = _local_node()
    if node is None:
        if not client.is_connected():  # not connected (unit tests' stand-in nodes): the alive nodes are all
            return FoundNodeTypes()
        return FoundNodeTypes(unknown="connected through Ray Client, this process has no Ray session to match the "
                                      "head's monitor to")
    found = FoundNodeTypes() if node.is_head() else _read_for(node.session_name)
    if found.unknown:
        logger.debug("the node types of this cluster are not known: %s", found.unknown)
    return found


def _local_node():
    return getattr(ray._private.worker, "_global_node", None)


def _driver_on_head() -> bool:
    here = ray.get_runtime_context().get_node_id()
    return any(n["NodeID"] == here and HEAD_RESOURCE in n["Resources"] for n in ray.nodes() if n.get("Alive"))


def _read_for(session_name: str) -> FoundNodeTypes:
    """From the monitor of ``session_name`` on this machine, else the bootstrap config when this driver is on the
    head (the monitor of another user hidden from it)."""
    monitor = _find_monitor(session_name, PROC)
    if monitor is not None:
        pid, args = monitor
        if not args.get("--autoscaling-config"):
            return FoundNodeTypes()  # its monitor has no config: a cluster of fixed nodes
        return _read_file(_monitor_path(pid, args["--autoscaling-config"], PROC))
    home_config = Path(os.path.expanduser(BOOTSTRAP_CONFIG))
    if home_config.is_file() and _driver_on_head():
        return _read_file(home_config)
    return FoundNodeTypes(unknown=f"the GCS holds no node types, no monitor of {session_name} runs on this machine, "
                                  f"and this process is not on the cluster's head with {BOOTSTRAP_CONFIG} (drivers "
                                  f"of `ray job submit` run there)")


def _find_monitor(session_name: str, proc: Path) -> Optional[Tuple[int, Dict[str, str]]]:
    """``(pid, its --name=value arguments)`` of the monitor whose logs are in ``session_name``'s folder."""
    try:
        entries = list(proc.iterdir())
    except OSError:  # no /proc (macOS): no monitor can be seen
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile, or hidden
            continue
        argv = raw.split(b"\0")
        if not any(arg.endswith(_MONITORS) for arg in argv[:3]):
            continue
        args = _named_args([arg.decode(errors="replace") for arg in argv if arg])
        if Path(args.get("--logs-dir", "/")).parent.name == session_name:
            return int(entry.name), args
    return None


def _named_args(argv: List[str]) -> Dict[str, str]:
    """``--name=value`` and ``--name value`` arguments (Ray writes the first)."""
    named = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            name, equals, value = arg.partition("=")
            if not equals and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            named[name] = value
    return named


def _monitor_path(pid: int, value: str, proc: Path) -> Path:
    """The file the monitor opened for ``value``: ``~`` expanded with its HOME, relative to its working folder."""
    if value == "~" or value.startswith("~/"):
        value = _monitor_home(pid, proc) + value[1:]
    else:
        value = os.path.expanduser(value)  # ~user: the same for every process
    try:
        return Path(os.readlink(proc / str(pid) / "cwd"), value)  # an absolute value stays as it is
    except OSError:
        return Path(value)


def _monitor_home(pid: int, proc: Path) -> str:
    try:
        for pair in (proc / str(pid) / "environ").read_bytes().split(b"\0"):
            if pair.startswith(b"HOME="):
                return pair[5:].decode()
    except OSError:  # another user's environment
        pass
    try:  # no HOME: Python's expanduser asks pwd for the user's home
        import pwd

        return pwd.getpwuid((proc / str(pid)).stat().st_uid).pw_dir
    except (OSError, KeyError):
        return os.path.expanduser("~")


def _read_file(path: Path) -> FoundNodeTypes:
    try:
        raw = yaml.safe_load(path.read_text())  # JSON (what `ray up` writes) is YAML too
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        return FoundNodeTypes(source=str(path), unknown=f"cannot read the autoscaler config {path}: {exc}")
    try:
        return parse(raw, str(path))
    except (TypeError, ValueError, AttributeError) as exc:
        return FoundNodeTypes(source=str(path), unknown=f"the autoscaler config {path} does not read as one: {exc}")


def parse(raw: dict, source: str) -> FoundNodeTypes:
    """``available_node_types`` by Ray's rules (``fill_node_type_min_max_workers`` and its scheduler): a worker
    type without ``max_workers`` takes the top-level one; the head type has the head plus its own ``max_workers``
    (default 0); a type that can have no node is left out. Every resource key counts, custom ones included."""
    types = raw.get("available_node_types") if isinstance(raw, dict) else None
    if not isinstance(types, dict) or not types:
        return FoundNodeTypes(source=source, unknown=f"the autoscaler config {source} has no available_node_types")
    head = raw.get("head_node_type")
    max_workers = int(raw["max_workers"]) if raw.get("max_workers") is not None else -1
    found = []
    for name, node_type in types.items():
        count = int(node_type.get("max_workers", 0 if name == head else max_workers))
        count = count + 1 if name == head else count
        resources = node_type.get("resources")
        if resources is None and name == head:
            continue  # the head is up (this driver is connected to it) and counted as such
        if resources is None:
            return FoundNodeTypes(source=source, unknown=f"node type {name!r} of {source} lists no resources (Ray "
                                                         f"fills them in from the cloud's instance type): add "
                                                         f"resources: {{CPU: ..., GPU: ...}} to it")
        if count != 0:
            found.append((str(name), {str(k): float(v) for k, v in resources.items()}, count))
    logger.debug("node types from %s: %s", source, found)
    return FoundNodeTypes(tuple(found), max_workers, source)
