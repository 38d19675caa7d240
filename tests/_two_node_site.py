"""One two-node cluster (tests/_netns.py) for the three two-node modules: test_two_node,
test_two_node_elastic and test_two_node_spot load this file as a plugin (``pytest_plugins``).

A cluster's start costs ~15 s on an idle 2-core machine and ~45 s on a loaded one; one cluster
serves the three modules. It starts when the first test that needs it asks for the ``two_node``
fixture and is torn down right after the last such test in the run (not at the end of the
session: an idle Ray head and raylet would slow every test that follows). Each module works in a
folder of its own under the site (``TwoNodeSite.module``), so run, driver and probe names do not
collide. What the modules need of the cluster, it has for all of them:

- ``root/private``: a folder only the head sees (a read-only tmpfs of the worker node's own mount
  namespace: the worker node can neither see nor write it; test_two_node's storage paths refused by
  the driver's check and by a worker's);
- ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=1`` in every Ray process: Ray Train's preemption watcher
  polls the GCS's draining nodes every 1 s instead of 5 s (test_two_node_spot; the others drain
  nothing);
- the head starts alone; a test that needs both nodes calls ``ensure_worker_node`` (which starts a
  worker node, or a new one in place of a lost one); a test that needs the head alone
  (test_two_node_elastic) calls ``lose_worker_node``, which returns once the GCS has declared the
  node dead.

Namespaces need root, ``ip`` and ``unshare``: without them the tests skip with the reason, except
on CI (``CI=true``), where that is a failure. Nothing is created at collection.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import pytest

from _netns import WORKER_IP, TwoNodeCluster, two_node_site
from _ray_nodes import VENV_BIN

FIXTURE = "two_node"
_open: dict = {}  # the open site: {"site": TwoNodeSite, "stack": ExitStack}

# Polls the GCS (in the head's namespace) until no alive node has the worker node's address.
_WAIT_DEAD = ("import sys, time\nimport ray._raylet\nfrom ray.core.generated.gcs_pb2 import GcsNodeInfo\n"
              "gcs = ray._raylet.GcsClient(address=sys.argv[1])\ndeadline = time.monotonic() + float(sys.argv[3])\n"
              "while any(i.node_manager_address == sys.argv[2] for i in gcs.get_all_node_info("
              "timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values()):\n"
              "    assert time.monotonic() < deadline, 'the GCS still lists the lost node as alive'\n"
              "    time.sleep(0.2)\n")
DEATH_TIMEOUT_S = 120  # the GCS declares a node dead after ~3 s here (_netns.FAST_NODE_DEATH)


class TwoNodeSite:
    """The cluster, the site's folder, and the head-only folder."""

    def __init__(self, cluster: TwoNodeCluster, root: Path):
        self.cluster, self.root, self.private = cluster, root, root / "private"

    def module(self, name: str) -> Path:
        """A module's own folder under the site, with ``shared/`` (storage both nodes see) in it."""
        folder = self.root / name
        (folder / "shared").mkdir(parents=True, exist_ok=True)
        return folder

    def ensure_worker_node(self) -> None:
        """Start a worker node if none is alive (lost by an earlier test, or never started)."""
        if self.cluster.worker is None or not self.cluster.worker.alive():
            self.cluster.start_worker_node()

    def lose_worker_node(self) -> None:
        """SIGKILL the worker node if it is alive, and return once the GCS has declared it dead
        (until then Ray would still offer its CPU)."""
        if self.cluster.worker is not None and self.cluster.worker.alive():
            self.cluster.worker.lose()
        done = self.cluster.head.run([f"{VENV_BIN}/python", "-c", _WAIT_DEAD, self.cluster.address, WORKER_IP,
                                      str(DEATH_TIMEOUT_S)], timeout_s=DEATH_TIMEOUT_S + 60)
        assert done.returncode == 0, done.stderr[-3000:]


def recorded_digits(cfg):
    """``dataset="_two_node_site:recorded_digits"``, ``data_root=<dir>``, for tests/_reference.py's
    in-process run: digits whose training reads are appended to ``<dir>/indices-in-process.txt``
    (a line per batch), as tests/_probe_data.py records what a Ray Train worker reads."""
    from _probe_data import _Recording
    from raytrain_mgpu.data import digits

    data = digits.build(cfg)
    return data._replace(train=_Recording(data.train, Path(cfg.data_root) / "indices-in-process.txt", None, None))



def _close() -> None:
    if _open:
        _open.pop("stack").close()
        _open.clear()


@pytest.fixture(scope="module")
def two_node() -> TwoNodeSite:
    """The shared two-node site, started on first use."""
    if not _open:
        stack = contextlib.ExitStack()
        try:
            cluster, root = stack.enter_context(two_node_site(
                "rtm2n-", private=True, env={"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}, start_worker=False))
        except BaseException:  # a skip too: nothing is left open
            stack.close()
            raise
        _open.update(site=TwoNodeSite(cluster, root), stack=stack)
    return _open["site"]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem: Optional[pytest.Item]) -> None:
    """Tear the site down after the last test that uses it (the next one does not, or none is left)."""
    if _open and (nextitem is None or FIXTURE not in getattr(nextitem, "fixturenames", ())):
        _close()


def pytest_sessionfinish(session) -> None:
    _close()  # an interrupted run too
