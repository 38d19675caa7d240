"""An elastic run (``num_workers=(1, 2)``) on a real two-node cluster that grows and then shrinks under it.

The cluster is the one the three two-node modules share (tests/_two_node_site.py; this module works
in a folder of its own); the test starts with the head alone (1 CPU: room for 1 worker): a worker
node left by another module is lost first, and the run starts once the GCS has declared it dead.
The run starts with 1 worker (micro-batch 32 fixed by the max count, 2 accumulation steps), which parks in epoch 2 (at step
``GROW_STEP``, tests/_elastic_probe.py); once it is parked and the step checkpoint before it is
registered, the test starts the worker node, Ray Train's elastic policy sees room for 2 and restarts
the group from that checkpoint with 2 workers (1 accumulation step each). The 2-worker group
finishes epoch 2 and parks a few steps later (at ``SHRINK_STEP``, between two step checkpoints);
once both workers are parked and the checkpoint before is registered, the test SIGKILLs the worker
node, the group fails (``max_failures=1``) and restarts with the 1 worker the head has room for.
Every event is observed (a parked file, a registered checkpoint), never waited for with a sleep:
however slow the machine, the run cannot end before the cluster has grown and shrunk under it.
The run ends with the weights of an undisturbed 1-worker run (computed in the test's own process,
tests/_reference.py: the same numbers as a fit through Ray), its history shows both counts, and
each restart cost at most ``checkpoint_every_n_steps`` steps (measured from what every worker
process read).

Namespaces need root, ``ip`` and ``unshare``: without them the tests skip with the reason,
except on CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _netns import HEAD_IP, WORKER_IP, TwoNodeCluster
from _reference import train_one_worker

pytest_plugins = ["_two_node_site"]  # the ``two_node`` fixture: the cluster the three two-node modules share
# The cluster's start (if this module runs alone) and the elastic run took 7 + 95 s on the 2-core VM:
# the bounds leave room for a machine 5x slower.
pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
EVERY = 5  # checkpoint_every_n_steps
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="sgd", lr=0.1, seed=3, epochs=3,
           use_gpu=False, num_checkpoints_to_keep=100)  # every checkpoint kept: where each attempt resumed
STEPS_PER_EPOCH = 1438 // 64
GROW_STEP = 28  # the 1-worker group parks before this step (epoch 2), 3 steps after the checkpoint at 25
SHRINK_STEP = 47  # the 2-worker group parks before this step: after epoch 2 (44), 2 steps after the one at 45
DRIVER_TIMEOUT_S = 600  # each driver: the elastic run took 95 s on the 2-core VM


@pytest.fixture(scope="module")
def site(two_node):
    return two_node.cluster, two_node.module("elastic")


def _driver(cluster: TwoNodeCluster, folder: Path, steps: list) -> subprocess.Popen:
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps({"steps": steps}))
    # A group that cannot be placed (2 workers asked on 1 node's room, before Ray's autoscaling
    # coordinator sees the lost node) gives up after 20 s and is asked again.
    return cluster.python(["tests/_fit_driver.py", str(folder / "plan.json"), str(folder / "results.json")],
                          extra_env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}, cwd=str(REPO),
                          stdout=open(folder / "driver.log", "w"), stderr=subprocess.STDOUT)


def _result(driver: subprocess.Popen, folder: Path) -> dict:
    log = (folder / "driver.log").read_text()[-5000:]
    assert driver.returncode == 0 and (folder / "results.json").is_file(), log
    (result,) = json.loads((folder / "results.json").read_text())
    assert result["ok"], result
    return result


def _registered(run: Path) -> list:
    """The checkpoints Ray Train has registered (a restart resumes from the newest of them), each its
    meta.json (step, attempt, step_in_epoch), oldest first. A checkpoint on disk whose report the
    controller had not taken when its group stopped is not one of them."""
    try:
        snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return []
    metas = []
    for result in snapshot["checkpoint_results"]:
        try:
            metas.append(json.loads((run / result["checkpoint_dir_name"] / "meta.json").read_text()))
        except (OSError, ValueError):
            continue
    return sorted(metas, key=lambda m: m["step"])


def _registered_before(metas: list, step: int, attempt: int) -> bool:
    """Whether the step checkpoint just before ``step``, saved by worker group ``attempt``, is among
    the registered ``metas`` (the group parked at ``step`` is restarted from it: tests/_elastic_probe.py)."""
    last = (step - 1) // EVERY * EVERY
    return any(m["step"] == last and m["attempt"] == attempt for m in metas)


def _parked(probe: Path, name: str) -> list:
    """The world ranks parked at the park ``name`` (tests/_elastic_probe.py's files)."""
    return sorted(int(p.name.rsplit("-", 1)[1]) for p in probe.glob(f"parked-{name}-*"))


def _attempts(probe: Path) -> list:
    """Worker groups in start order: [(world size, micro-batches rank 0 read), ...]."""
    infos = sorted((json.loads(p.read_text()) for p in probe.glob("worker-*.json")), key=lambda i: i["started"])
    groups, index = [], 0
    while index < len(infos):
        size = infos[index]["world_size"]
        group = infos[index:index + size]
        rank0 = next(i for i in group if i["world_rank"] == 0)
        batches = probe / f"batches-{rank0['pid']}.txt"
        groups.append((size, len(batches.read_text().split()) if batches.exists() else 0,
                       sorted(i["node_ip"] for i in group)))
        index += size
    return groups


def test_an_elastic_run_grows_and_shrinks_with_the_cluster_and_ends_like_one_worker(two_node, site):
    cluster, root = site
    shared = root / "shared"
    reference_weights, _, _, one_history = train_one_worker({**MLP, "dataset": "digits", "num_workers": 1,
                                                             "grad_accum_steps": 2})
    assert [row["workers"] for row in one_history] == [1] * MLP["epochs"]
    two_node.lose_worker_node()  # the head alone: room for 1 worker

    probe = root / "probe"
    probe.mkdir()
    (probe / "parks.json").write_text(json.dumps({"batch_size": MLP["batch_size"], "parks": [
        {"name": "grow", "step": GROW_STEP, "world_size": 1}, {"name": "shrink", "step": SHRINK_STEP, "world_size": 2}]}))
    run = shared / "elastic"
    driver = _driver(cluster, root / "driver-elastic", [{"kind": "fit", "weights": str(root / "elastic.pt"), "config": {
        **MLP, "dataset": "_elastic_probe:parked_digits", "data_root": str(probe), "num_workers": [1, 2],
        "checkpoint_every_n_steps": EVERY, "max_failures": 1, "elastic_resize_interval_s": 1.0,
        "name": "elastic", "storage_path": str(shared)}}])
    timeline = {}
    start, wall_start = time.monotonic(), time.time()
    try:
        while driver.poll() is None:
            assert time.monotonic() - start < DRIVER_TIMEOUT_S, "the elastic run did not finish in time"
            timed_out = sorted(p.name for p in probe.glob("timeout-*"))  # a park waited tests/_elastic_probe.PARK_S
            assert not timed_out, f"parked workers waited in vain: {timed_out}; timeline {timeline}"
            metas = _registered(run)
            if "grow" not in timeline and _parked(probe, "grow") == [0] and _registered_before(metas, GROW_STEP, 0):
                cluster.start_worker_node()  # a node joins: room for the second worker
                timeline["grow"] = time.monotonic() - start
            elif ("shrink" not in timeline and _parked(probe, "shrink") == [0, 1]
                  and any(m["attempt"] == 1 and not m.get("step_in_epoch") for m in metas)
                  and _registered_before(metas, SHRINK_STEP, 1)):
                cluster.worker.lose()  # the grown group's epoch is registered: its node is reclaimed
                timeline["shrink"] = time.monotonic() - start
            time.sleep(0.1)  # how often the events are looked for; the run waits for them, parked
    finally:
        if driver.poll() is None:
            driver.kill()
    elastic = _result(driver, root / "driver-elastic")
    started = sorted(json.loads(p.read_text())["started"] for p in probe.glob("worker-*.json"))
    print("elastic run (s after the driver started): node added %.0f, lost %.0f, run finished %.0f; worker "
          "processes started %s" % (timeline["grow"], timeline["shrink"], time.monotonic() - start,
                                     [round(t - wall_start) for t in started]))

    # 1 worker on the head, 2 on both nodes, 1 again after the worker node was lost.
    attempts = _attempts(probe)
    assert [size for size, _, _ in attempts] == [1, 2, 1], attempts
    assert attempts[1][2] == sorted([HEAD_IP, WORKER_IP]) and attempts[2][2] == [HEAD_IP]
    history = elastic["history"]
    assert [row["epoch"] for row in history] == list(range(1, MLP["epochs"] + 1))
    print("workers per epoch:", [row["workers"] for row in history])
    assert {row["workers"] for row in history} == {1, 2}, [(row["epoch"], row["workers"]) for row in history]
    assert history[-1]["step"] == MLP["epochs"] * STEPS_PER_EPOCH

    # What each restart cost: the steps the stopped group started after the checkpoint the next one resumed.
    metas = _registered(run)
    resumed_at = [0] + [max(m["step"] for m in metas if m["attempt"] < a) for a in (1, 2)]
    lost = []
    for a, (size, batches, _) in enumerate(attempts[:2]):
        reached = resumed_at[a] + math.ceil(batches / (2 // size))  # micro-batches / accumulation steps
        lost.append(reached - resumed_at[a + 1])
    print(f"steps lost at the grow and at the shrink: {lost} (checkpoint_every_n_steps={EVERY})")
    assert all(0 <= n <= EVERY for n in lost), lost

    weights = torch.load(root / "elastic.pt")
    assert weights.keys() == reference_weights.keys()
    for key in reference_weights:
        torch.testing.assert_close(weights[key], reference_weights[key], rtol=1e-4, atol=1e-5, msg=key)
