"""Spot nodes on a real two-node cluster (issue 17): head and worker node in separate network
namespaces (tests/_netns.py), one module-scoped cluster, one driver process per test
(tests/_fit_driver.py, in the head's namespace).

- a 2-worker ``ddp`` run with ``checkpoint_every_n_steps=K`` loses its worker node (every Ray
  process on it, SIGKILL) part-way through epoch 2; a new worker node takes its place and the
  run resumes mid-epoch from the last step checkpoint: it trains at most K steps twice and ends
  with the 1-worker reference run's weights;
- a simulated preemption: ``raytrain-mgpu spot-watch`` on the worker node gets SIGTERM, drains its
  node (reason preemption, deadline G s), the workers save a step checkpoint; when spot-watch
  exits (the deadline) the test kills the node and starts a new one. With ``max_failures=0`` the
  run still finishes (the restart is charged to ``max_preemption_failures``), ends with the
  reference weights, and the driver printed the "preempted" and "resuming at step" lines.

Namespaces need root, ``ip`` and ``unshare``: without them the tests skip with the reason,
except on CI (``CI=true``), where that is a failure. Nothing is created at collection.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _netns import WORKER_IP, TwoNodeCluster, two_node_site
from _ray_nodes import VENV_BIN

pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 5
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64,
           optimizer="sgd", lr=0.1, seed=3, epochs=EPOCHS)
STEPS_PER_EPOCH = 1438 // 64
PER_RANK_STEP = 32  # 2 workers, batch 64, no accumulation
DRIVER_TIMEOUT_S = 400
GRACE_S = 10  # spot-watch's drain deadline: the run (about 25 s of 0.2 s steps) goes on past it
K = 5


class _Site:
    def __init__(self, cluster: TwoNodeCluster, root: Path):
        self.cluster, self.root, self.shared = cluster, root, root / "shared"


@pytest.fixture(scope="module")
def site():
    # Ray Train's preemption watcher polls the GCS's draining nodes every 1 s instead of 5 s.
    with two_node_site("rtm2s-", env={"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}) as (cluster, root):
        yield _Site(cluster, root)


def _drive(site: _Site, name: str, steps: list, act=None) -> tuple:
    """Run ``steps`` in a driver in the head's namespace; (results, worker-node replacements, driver output).
    ``act()`` is called every 0.1 s while it runs (the test's faults)."""
    if not site.cluster.worker.alive():  # lost by the previous test
        site.cluster.start_worker_node()
    folder = site.root / f"driver-{name}"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps({"steps": steps}))
    results_file, log = folder / "results.json", folder / "driver.log"
    replaced = 0
    with open(log, "w") as out:
        driver = site.cluster.python(["tests/_fit_driver.py", str(folder / "plan.json"), str(results_file)],
                                     extra_env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"},
                                     cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + DRIVER_TIMEOUT_S
        try:
            while driver.poll() is None:
                assert time.monotonic() < deadline, f"the driver did not finish within {DRIVER_TIMEOUT_S} s"
                if act is not None:
                    act()
                if not site.cluster.worker.alive():
                    site.cluster.start_worker_node()  # the lost machine is replaced (the autoscaler's job)
                    replaced += 1
                time.sleep(0.1)
        finally:
            if driver.poll() is None:
                driver.kill()
    output = log.read_text()
    assert driver.returncode == 0 and results_file.is_file(), output[-5000:]
    results = json.loads(results_file.read_text())
    assert len(results) == len(steps), output[-5000:]
    print(f"{name}: driver steps (s):", [r["seconds"] for r in results])
    return results, replaced, output


def _attempts(probe: Path) -> list:
    """[{world rank: indices served}, ...] per worker group, in start order (tests/_probe_data.py's files)."""
    infos = sorted((json.loads(p.read_text()) for p in probe.glob("worker-*.json")), key=lambda i: i["started"])
    size = infos[0]["world_size"]
    return [{info["world_rank"]: [int(i) for i in (probe / f"indices-{info['world_rank']}-{info['pid']}.txt")
                                  .read_text().split()] for info in infos[first:first + size]}
            for first in range(0, len(infos), size)]


def _assert_same_weights(path: Path, reference: dict) -> None:
    weights = torch.load(path)
    assert weights.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def reference(site):
    """The undisturbed 1-worker run's weights (the two-worker split trains the same steps: test_two_node.py)."""
    (one,), _, _ = _drive(site, "one", [{"kind": "fit", "weights": str(site.root / "one.pt"), "config": {
        **MLP, "num_workers": 1, "name": "one", "storage_path": str(site.shared)}}])
    assert one["ok"] and one["history"][-1]["step"] == EPOCHS * STEPS_PER_EPOCH, one
    return torch.load(site.root / "one.pt")


def test_losing_the_worker_node_costs_at_most_k_steps_and_ends_with_the_reference_weights(site, reference):
    probe = site.root / "probe-lost"
    probe.mkdir()
    kill_after = STEPS_PER_EPOCH * PER_RANK_STEP + 12 * PER_RANK_STEP  # loading step 13 of epoch 2
    (probe / "plan.json").write_text(json.dumps({"action": "kill_node", "node_ip": WORKER_IP,
                                                 "after_samples": kill_after}))
    (lost,), replaced, output = _drive(site, "lost", [{"kind": "fit", "weights": str(site.root / "lost.pt"), "config": {
        **MLP, "dataset": "_probe_data:digits", "data_root": str(probe), "num_workers": 2,
        "placement": "STRICT_SPREAD", "max_failures": 1, "checkpoint_every_n_steps": K, "name": "lost",
        "storage_path": str(site.shared)}}])
    assert lost["ok"] and replaced == 1, (lost, replaced)
    first, second = _attempts(probe)
    epoch = STEPS_PER_EPOCH * PER_RANK_STEP  # one rank's samples of an epoch
    for rank in (0, 1):
        epoch2 = first[rank][epoch:]  # the killed group's part of epoch 2
        resumed = second[rank][:len(second[rank]) - (EPOCHS - 2) * epoch]  # the rest of epoch 2, after the restart
        assert len(resumed) % PER_RANK_STEP == 0 and 0 < len(resumed) < epoch
        resumed_at = STEPS_PER_EPOCH - len(resumed) // PER_RANK_STEP  # steps of epoch 2 the checkpoint held
        assert (STEPS_PER_EPOCH + resumed_at) % K == 0, resumed_at  # a step checkpoint: mid-epoch
        served_twice = len(epoch2) - resumed_at * PER_RANK_STEP  # read by both groups: trained, or in flight
        assert epoch2[resumed_at * PER_RANK_STEP:] == resumed[:served_twice]  # the same order, continued
        assert 0 <= served_twice <= K * PER_RANK_STEP, served_twice
        print(f"rank {rank}: resumed after global step {STEPS_PER_EPOCH + resumed_at}; steps read twice "
              f"(trained twice, or in flight at the kill): {served_twice / PER_RANK_STEP:g} (K={K})")
    assert [h["attempt"] for h in lost["history"]] == [0, 1, 1, 1, 1]
    assert lost["history"][-1]["step"] == EPOCHS * STEPS_PER_EPOCH
    assert re.search(rf"resuming at step {STEPS_PER_EPOCH + resumed_at} \(\d+/{STEPS_PER_EPOCH} steps of epoch 2",
                     output), output[-3000:]
    _assert_same_weights(site.root / "lost.pt", reference)


def test_a_preemption_saves_restarts_without_max_failures_and_ends_with_the_reference_weights(site, reference):
    if not site.cluster.worker.alive():
        site.cluster.start_worker_node()
    watcher = site.cluster.worker.popen([f"{VENV_BIN}/raytrain-mgpu", "spot-watch", "--grace-s", str(GRACE_S),
                                         "--address", site.cluster.address],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = site.shared / "spot"
    timeline = {}

    def act():
        """SIGTERM spot-watch once epoch 1's checkpoint exists; kill the node when spot-watch exits."""
        if "sigterm" not in timeline and any(run.glob("checkpoint_*/meta.json")):
            watcher.send_signal(signal.SIGTERM)
            timeline["sigterm"] = time.monotonic()
        elif "sigterm" in timeline and "killed" not in timeline and watcher.poll() is not None:
            site.cluster.worker.lose()  # the machine goes at the deadline
            timeline["killed"] = time.monotonic()

    try:
        (spot,), replaced, output = _drive(site, "spot", [{"kind": "fit", "weights": str(site.root / "spot.pt"), "config": {
            **MLP, "dataset": "_probe_data:slow_digits", "num_workers": 2, "placement": "STRICT_SPREAD",
            "max_failures": 0, "name": "spot", "storage_path": str(site.shared)}}], act=act)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    watch_output = watcher.stdout.read()
    print(watch_output)
    assert spot["ok"], spot
    assert watcher.returncode == 0 and "drained (preemption)" in watch_output, watch_output
    assert "killed" in timeline and replaced == 1, (timeline, replaced)
    print(f"spot-watch exited {timeline['killed'] - timeline['sigterm']:.1f} s after SIGTERM (grace {GRACE_S} s)")
    notice = re.search(r"preempted \(node [0-9a-f]{12}, deadline in (\d+) s\): saved step (\d+)", output)
    resume = re.search(r"resuming at step (\d+)", output)
    assert notice and resume, output[-5000:]
    saved, resumed = int(notice.group(2)), int(resume.group(1))
    assert 0 <= int(notice.group(1)) <= GRACE_S
    # The notice's step checkpoint, or an epoch checkpoint written after it, before the deadline.
    assert resumed == saved or (resumed > saved and resumed % STEPS_PER_EPOCH == 0), (saved, resumed)
    assert output.index(notice.group(0)) < output.index(resume.group(0))
    attempts = [h["attempt"] for h in spot["history"]]
    assert attempts[0] == 0 and attempts[-1] == 1 and sorted(attempts) == attempts, attempts
    assert spot["history"][-1]["step"] == EPOCHS * STEPS_PER_EPOCH
    print(f"preempted: saved step {saved}, resumed at step {resumed}")
    _assert_same_weights(site.root / "spot.pt", reference)
