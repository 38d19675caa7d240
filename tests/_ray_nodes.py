"""Ray nodes started with ``ray start`` for tests, and torn down without ``ray stop``.

``ray stop`` kills every Ray process on the machine by name, including other test
sessions' instances (and the processes in other network namespaces: namespaces do not
separate PIDs). So each node started here carries a marker in its environment
(``RTM_TEST_NODE=<unique>``), every process Ray forks for it inherits the marker, and
teardown signals exactly the processes whose ``/proc/<pid>/environ`` holds it.

Each node also gets its own ``--temp-dir``: ``ray start`` records the cluster address in
``<temp-dir>/ray_current_cluster``, and a plain ``ray.init()`` elsewhere on the machine
joins whatever the default ``/tmp/ray/ray_current_cluster`` names. A private temp dir
keeps other sessions from joining a test's head by accident.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

VENV_BIN = str(Path(sys.executable).parent)
RAY = str(Path(VENV_BIN) / "ray")
MARKER = "RTM_TEST_NODE"

# The ports of ``ray start`` whose defaults are fixed numbers (6379, 8265, 10001), which another Ray on the
# host (the other test process's) may hold: each gets one of ours (:func:`free_ports`). The dashboard agent's
# HTTP port (52365 by default) is given as 0: the agent binds a free one itself and publishes it. Every other
# port of a node (node and object managers, the agent's gRPC, the metrics export, the runtime env agent) Ray
# binds as 0 by default: no time passes between choosing such a port and binding it, for another process
# to take it in.
_HEAD_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port")
_GIVEN: set = set()  # every port this process has handed out


def free_ports(count: int) -> List[int]:
    """``count`` distinct ports that no process holds on any address now and that this process never handed out
    before (a port it gave a Ray node may be that node's still). Each is held until all are chosen, so none comes
    twice: chosen one at a time, two of a node's flags once got the same port, and ``ray start`` refused
    ("metrics_export is trying to use a port number ... used by other components")."""
    sockets: List[socket.socket] = []
    ports: List[int] = []
    try:
        while len(ports) < count:
            if len(sockets) > count + 1000:
                raise RuntimeError(f"no {count} free ports found after {len(sockets)} tries")
            held = socket.socket()
            sockets.append(held)
            held.bind(("", 0))  # all addresses: a port held on any of them is not free
            port = held.getsockname()[1]
            if port not in _GIVEN:
                ports.append(port)
    finally:
        for held in sockets:
            held.close()
    _GIVEN.update(ports)
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def free_port_flags(skip: Sequence[str] = ()) -> Dict[str, int]:
    """The port flags of ``ray start`` (except those in ``skip``): the fixed defaults' ports, distinct (a node's
    own and every other node's this process started), and the dashboard agent's HTTP port left to the agent."""
    flags = [flag for flag in _HEAD_PORT_FLAGS if flag not in skip]
    return {**dict(zip(flags, free_ports(len(flags)))), "--dashboard-agent-listen-port": 0}


def marked_pids(marker: str) -> List[int]:
    """PIDs of processes whose environment holds ``RTM_TEST_NODE=<marker>``."""
    needle = f"{MARKER}={marker}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def kill_marked(marker: str, grace_s: float = 3.0) -> None:
    """SIGTERM the marked processes, then SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in marked_pids(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not marked_pids(marker):
            return


class RayNode:
    """One ``ray start`` node: its marker, temp dir, environment and log."""

    def __init__(self, temp_dir: Path, env: Dict[str, str], prefix: Sequence[str] = ()):
        self.marker = uuid.uuid4().hex[:12]
        self.temp_dir = Path(temp_dir)
        self.env = {**env, MARKER: self.marker}
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", "ns"]
        self.log = self.temp_dir.parent / f"{self.temp_dir.name}.start.log"

    def start(self, args: Sequence[str], timeout_s: float = 120) -> None:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*self.prefix, RAY, "start", "--temp-dir", str(self.temp_dir), "--disable-usage-stats", *args]
        with open(self.log, "a") as log:
            done = subprocess.run(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{self.log.read_text()[-3000:]}")

    def alive(self) -> bool:
        return bool(marked_pids(self.marker))

    def stop(self) -> None:
        kill_marked(self.marker)

    def lose(self) -> None:
        """SIGKILL every process of this node at once, no clean shutdown: a lost machine."""
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, cmd: Sequence[str], timeout_s: float, extra_env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` with this node's environment (and namespace), output captured.
        ``extra_env`` values of None remove the variable."""
        env = _merge_env(self.env, extra_env)
        return subprocess.run([*self.prefix, *cmd], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s)

    def popen(self, cmd: Sequence[str], extra_env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
              **kwargs) -> subprocess.Popen:
        env = _merge_env(self.env, extra_env)
        return subprocess.Popen([*self.prefix, *cmd], env=env, cwd=cwd, **kwargs)


def _merge_env(env: Dict[str, str], extra: Optional[Dict[str, Optional[str]]]) -> Dict[str, str]:
    merged = dict(env)
    for key, value in (extra or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


# Ray's log monitor (one per node) globs the session's log folder every 0.1 s until the folder holds
# 1,000 files, then every LOG_NAME_UPDATE_INTERVAL_S; a test Ray's folder fills with every fit's worker
# logs, and no test reads worker output through a driver (every driver has log_to_driver=False). With
# the back-off from the first file and 2 s: the log monitor 11.1 -> 4.5 CPU-s over test_fit,
# test_faults and test_callbacks with -n 0 (~290 s; measured with /proc/<pid>/stat).
QUIET_LOG_MONITOR = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2"}


def base_env(home: Path, **extra: str) -> Dict[str, str]:
    """A clean environment: the venv first on PATH (so a job's ``python`` is the venv's), a
    temporary HOME, no inherited Ray settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RTM_"))}
    # RAY_TRAIN_METRICS_ENABLED=0: Ray Train's Prometheus metrics, which no test reads (about 0.4 s
    # of CPU per training worker on the 2-core VM; the suite is CPU-bound, see conftest.py).
    env.update(HOME=str(home), PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", RAY_TRAIN_METRICS_ENABLED="0",
               **QUIET_LOG_MONITOR)
    env.update(extra)
    return env
