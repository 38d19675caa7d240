"""A real two-node run: head and worker node in separate network namespaces (see _netns.py).

One driver process (tests/_fit_driver.py, in the head's namespace) runs, in order:

1. the storage check on a path only the head can see;
2. a 1-worker reference run;
3. a 2-worker ``ddp`` run with ``STRICT_SPREAD``, during which the worker node is killed
   (every Ray process on it, SIGKILL) half-way through epoch 2; the test starts a new
   worker node in its place and the run resumes from the last checkpoint;
4. a 2-stage ``pipeline`` run with ``STRICT_SPREAD`` (one stage actor per node, activations
   and gradients over rtm0), whose worker node the test kills as soon as epoch 1's
   checkpoint exists; the stage actor group is rebuilt on the new node and resumes.

Both runs end with the 1-worker run's weights.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

import raytrain_mgpu.api
from _netns import HEAD_IP, IFNAME, WORKER_IP, TwoNodeCluster, unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

REPO = Path(__file__).resolve().parents[1]
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="_probe_data:digits", batch_size=64,
           optimizer="sgd", lr=0.1, seed=3, epochs=2)
STEPS_PER_EPOCH = 1438 // 64
PER_RANK_EPOCH = STEPS_PER_EPOCH * 32


def _attempts(probe: Path) -> list:
    """Worker processes grouped by attempt (world size each, in start order):
    [{world rank: (info, indices served)}, ...], from the probe's files."""
    infos = sorted((json.loads(p.read_text()) for p in probe.glob("worker-*.json")), key=lambda i: i["started"])
    size = infos[0]["world_size"]
    attempts = []
    for first in range(0, len(infos), size):
        group = {}
        for info in infos[first:first + size]:
            text = (probe / f"indices-{info['world_rank']}-{info['pid']}.txt").read_text()
            group[info["world_rank"]] = (info, [int(i) for i in text.split()])
        attempts.append(group)
    return attempts


def _wait(proc: subprocess.Popen, cluster: TwoNodeCluster, kill_when: Path, timeout_s: float) -> int:
    """Wait for the driver. Whenever the worker node is gone (killed by a probe or here), start
    a new one in its place; kill it here once ``kill_when`` exists. Returns the replacements."""
    replaced, killed = 0, False
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the driver did not finish within {timeout_s:.0f} s")
        if not cluster.worker.alive():
            cluster.start_worker_node()  # the lost machine is replaced
            replaced += 1
        elif not killed and kill_when.exists():
            cluster.worker.lose()
            killed = True
        time.sleep(0.1)
    return replaced


def test_ddp_and_pipeline_on_two_nodes_equal_one_worker_and_survive_losing_a_node():
    root = Path(tempfile.mkdtemp(prefix="rtm2n-", dir="/tmp"))  # short: Ray's socket paths live below
    shared, private = root / "shared", root / "private"
    probe_one, probe_two = root / "probe-one", root / "probe-two"
    for folder in (shared, probe_one, probe_two):
        folder.mkdir()
    (probe_two / "plan.json").write_text(json.dumps(
        {"action": "kill_node", "node_ip": WORKER_IP, "after_samples": PER_RANK_EPOCH + PER_RANK_EPOCH // 2}))
    steps = [
        {"kind": "check_storage", "storage_path": str(private)},
        {"kind": "fit", "weights": str(root / "one.pt"),
         "config": {**MLP, "num_workers": 1, "data_root": str(probe_one), "name": "one", "storage_path": str(shared)}},
        {"kind": "fit", "weights": str(root / "two.pt"), "fault_hooks": True,
         "config": {**MLP, "num_workers": 2, "placement": "STRICT_SPREAD", "max_failures": 1,
                    "data_root": str(probe_two), "name": "two", "storage_path": str(shared)}},
        {"kind": "fit", "weights": str(root / "pipe.pt"),  # >= 0.2 s a step: the kill lands mid-epoch
         "config": {**MLP, "dataset": "_probe_data:slow_digits", "strategy": "pipeline", "num_stages": 2,
                    "num_microbatches": 4, "schedule": "1f1b", "placement": "STRICT_SPREAD", "max_failures": 1,
                    "name": "pipe", "storage_path": str(shared)}},
    ]
    if "check_storage_reachable" in inspect.getsource(raytrain_mgpu.api):  # fit itself checks
        steps.insert(1, {"kind": "fit", "config": {**MLP, "num_workers": 2, "placement": "STRICT_SPREAD",
                                                    "name": "private", "storage_path": str(private)}})
    (root / "plan.json").write_text(json.dumps({"steps": steps}))
    results_file, log = root / "results.json", root / "driver.log"
    started = time.monotonic()
    try:
        with TwoNodeCluster(root / "cluster", private_dirs=[private]) as cluster, open(log, "w") as out:
            print(f"two-node cluster up in {time.monotonic() - started:.0f} s")
            driver = cluster.python(["tests/_fit_driver.py", str(root / "plan.json"), str(results_file)],
                                    extra_env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"},
                                    cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT)
            try:
                replaced = _wait(driver, cluster, shared / "pipe" / "checkpoint_epoch000001" / "meta.json",
                                 timeout_s=540)
            finally:
                if driver.poll() is None:
                    driver.kill()
        results = json.loads(results_file.read_text())
        print("driver steps (s):", [r["seconds"] for r in results])
        assert driver.returncode == 0 and len(results) == len(steps), log.read_text()[-5000:]
        storage_check, *checked_fit, one, two, pipe = results

        # A storage path the worker node does not see is refused at start, naming the node.
        assert not storage_check["ok"]
        assert f"node {WORKER_IP}: does not see" in storage_check["error"], storage_check
        assert "not reachable from every node" in storage_check["error"]
        for refused in checked_fit:
            assert not refused["ok"] and "not reachable from every node" in refused["error"]
            assert refused["seconds"] < 60

        assert one["ok"] and two["ok"] and pipe["ok"], (one, two, pipe, log.read_text()[-5000:])
        assert replaced == 2, f"the worker node was lost {replaced} time(s), not once per run"

        # Two nodes: node ranks 0 and 1, their own IPs, gloo on the namespace's interface.
        (single,), = [list(a.values()) for a in _attempts(probe_one)]
        first, restarted_group = _attempts(probe_two)
        for group in (first, restarted_group):
            nodes = sorted((info["node_rank"], info["node_ip"]) for info, _ in group.values())
            assert [r for r, _ in nodes] == [0, 1] and {ip for _, ip in nodes} == {HEAD_IP, WORKER_IP}, nodes
            assert all(info["gloo_ifname"] == IFNAME for info, _ in group.values())

        # Epoch 1's shards: disjoint, and together exactly what the single worker trained on.
        epoch1 = {rank: set(indices[:PER_RANK_EPOCH]) for rank, (_, indices) in first.items()}
        assert not epoch1[0] & epoch1[1]
        assert epoch1[0] | epoch1[1] == set(single[1][:2 * PER_RANK_EPOCH])
        # The restarted group trained epoch 2 once, in the same order as the killed one.
        for rank, (_, indices) in restarted_group.items():
            assert len(indices) == PER_RANK_EPOCH
            in_flight = first[rank][1][PER_RANK_EPOCH:]
            assert indices[:len(in_flight)] == in_flight

        # The run lost a node in epoch 2, resumed from epoch 1's checkpoint on the new node,
        # and ends where the single worker ends, with its checkpoint in the shared folder.
        assert [(h["epoch"], h["attempt"]) for h in two["history"]] == [(1, 0), (2, 1)]
        assert two["history"][-1]["step"] == one["history"][-1]["step"] == 2 * STEPS_PER_EPOCH
        assert Path(two["checkpoint_path"]).is_relative_to(shared) and Path(two["checkpoint_path"]).is_dir()
        w_one, w_two = torch.load(root / "one.pt"), torch.load(root / "two.pt")
        for key in w_one:
            torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-4, atol=1e-5)

        # The pipeline: one stage per node, both attempts; the lost node cost epoch 2 only,
        # the run resumed from epoch 1's checkpoint and ends with the single worker's weights.
        assert [(h["epoch"], h["attempt"]) for h in pipe["history"]] == [(1, 0), (2, 1)], pipe["history"]
        for h in pipe["history"]:
            assert sorted(h["node_ip_per_rank"]) == [HEAD_IP, WORKER_IP], h
        assert pipe["history"][-1]["step"] == 2 * STEPS_PER_EPOCH
        assert Path(pipe["checkpoint_path"]).is_relative_to(shared)
        w_pipe = torch.load(root / "pipe.pt")
        for key in w_one:
            torch.testing.assert_close(w_pipe[key], w_one[key], rtol=1e-4, atol=2e-5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
