"""A real two-node cluster: head and worker node in separate network namespaces (see _netns.py).

The cluster is the one the three two-node modules share (tests/_two_node_site.py); this module
works in a folder of its own under it. Each test runs its own driver process (tests/_fit_driver.py,
in the head's namespace), and compares with the 1-worker run's weights computed in the test's own
process (tests/_reference.py: the same numbers as a fit through Ray, tests/test_loaders.py):

- a storage path only the head can see is refused at start, naming the node;
- one the worker node cannot write, on a node that joins after the driver's check (the head alone then: nothing
  to compare), is refused by that node's worker before its first step: an elastic run of 1 to 2 workers, whose
  one worker parks on the head until the node has joined (tests/_elastic_probe.py), fails naming the node and the
  path;
- an ``ingest="ray_data"`` stream's Ray Data tasks run on the node that ``ray start --labels`` labelled
  ``ray-subcluster=ingest`` (data/parquet_stream.INGEST_LABEL), seen in the GCS's task events;
- (a 2-worker ``ddp`` run over both nodes that loses its worker node, its shards and its weights:
  tests/test_two_node_spot.py, which runs it with step checkpoints;)
- a 2-stage ``pipeline`` run with one stage actor per node (activations and gradients over
  rtm0), whose worker node the test kills once epoch 1's checkpoint is published and a stage
  actor is parked before its first batch of epoch 2 (tests/_elastic_probe.py: the run cannot end
  first, however slow the machine); the stage actor group is rebuilt on the new node, resumes,
  and ends with the reference weights.

Namespaces need root, ``ip`` and ``unshare``: without them the tests skip with the reason,
except on CI (``CI=true``), where that is a failure. Nothing is created at collection.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from _fit_driver import STREAM_TASKS
from _netns import HEAD_IP, WORKER_IP
from _reference import train_one_worker

pytest_plugins = ["_two_node_site"]  # the ``two_node`` fixture: the cluster the three two-node modules share
pytestmark = [pytest.mark.netns, pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="_probe_data:digits", batch_size=64,
           optimizer="sgd", lr=0.1, seed=3, epochs=2, use_gpu=False)
STEPS_PER_EPOCH = 1438 // 64
DRIVER_TIMEOUT_S = 400


class _Site:
    """The shared cluster and this module's folders: its own, shared storage, the head-only folder."""

    def __init__(self, site):  # tests/_two_node_site.TwoNodeSite
        self.site, self.cluster = site, site.cluster
        self.root = site.module("two_node")
        self.shared, self.private = self.root / "shared", site.private


@pytest.fixture(scope="module")
def site(two_node):
    return _Site(two_node)


def _drive(site: _Site, name: str, steps: list, kill_when: Callable[[], bool] = None,
           join_when: Callable[[], bool] = None) -> tuple:
    """Run ``steps`` in a driver in the head's namespace; (results, worker-node replacements). ``join_when``: the
    head alone at the start, and the worker node joins once ``join_when()`` holds."""
    if join_when is None:
        site.site.ensure_worker_node()  # lost by the previous test, or by another module's
    else:
        site.site.lose_worker_node()
    folder = site.root / f"driver-{name}"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps({"steps": steps}))
    results_file, log = folder / "results.json", folder / "driver.log"
    # A node joining later: a group asked for on a view of the cluster that still has the lost node (Ray's
    # autoscaling coordinator lags the GCS) gives up after 20 s and is asked again (tests/test_two_node_elastic.py).
    start_timeout_s = "300" if join_when is None else "20"
    with open(log, "w") as out:
        driver = site.cluster.python(["tests/_fit_driver.py", str(folder / "plan.json"), str(results_file)],
                                     extra_env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": start_timeout_s},
                                     cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT)
        try:
            replaced = _wait(driver, site.cluster, kill_when, join_when, DRIVER_TIMEOUT_S)
        finally:
            if driver.poll() is None:
                driver.kill()
    assert driver.returncode == 0 and results_file.is_file(), log.read_text()[-5000:]
    results = json.loads(results_file.read_text())
    assert len(results) == len(steps), log.read_text()[-5000:]
    print(f"{name}: driver steps (s):", [r["seconds"] for r in results])
    return results, replaced


def _wait(proc: subprocess.Popen, cluster, kill_when, join_when, timeout_s: float) -> int:
    """Wait for the driver. Start the worker node once ``join_when()`` holds (None: it is up); whenever it is
    gone after that (killed by a probe or here), start a new one in its place; kill it here once ``kill_when()``
    holds. Returns the replacements."""
    replaced, killed, joined = 0, False, join_when is None
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the driver did not finish within {timeout_s:.0f} s")
        if not joined:
            if join_when():
                cluster.start_worker_node()
                joined = True
        elif not cluster.worker.alive():
            cluster.start_worker_node()  # the lost machine is replaced
            replaced += 1
        elif not killed and kill_when is not None and kill_when():
            cluster.worker.lose()
            killed = True
        time.sleep(0.1)
    return replaced


def _probe(site: _Site, name: str, plan: dict = None) -> Path:
    probe = site.root / f"probe-{name}"
    probe.mkdir()
    if plan:
        (probe / "plan.json").write_text(json.dumps(plan))
    return probe


def _assert_same_weights(path: Path, reference: dict, atol: float) -> None:
    weights = torch.load(path)
    assert weights.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-4, atol=atol, msg=key)


@pytest.fixture(scope="module")
def reference():
    """The 1-worker reference run's weights, in this process."""
    weights, _, _, history = train_one_worker({**MLP, "dataset": "digits", "num_workers": 1})
    assert history[-1]["step"] == 2 * STEPS_PER_EPOCH
    return weights


def test_storage_path_only_the_head_sees_is_refused_naming_the_node(site):
    results, _ = _drive(site, "private", [
        {"kind": "check_storage", "storage_path": str(site.private)},
        {"kind": "fit", "config": {**MLP, "dataset": "digits", "num_workers": 2, "placement": "STRICT_SPREAD",
                                   "name": "private", "storage_path": str(site.private)}}])
    storage_check, refused_fit = results
    assert not storage_check["ok"]
    assert f"node {WORKER_IP}: does not see" in storage_check["error"], storage_check
    assert "not reachable from every node" in storage_check["error"]
    assert not refused_fit["ok"] and "not reachable from every node" in refused_fit["error"], refused_fit
    # Refused at start: fit checks the data and the model on the driver, then probes every node as the
    # storage check before it did (both timed inside the same driver, after its imports and ray.init),
    # so a slower machine slows both alike; training first would add a worker group's start and an epoch.
    assert refused_fit["seconds"] < 2 * storage_check["seconds"] + 10, (refused_fit, storage_check)


def test_pipeline_with_a_stage_per_node_survives_losing_the_worker_node(site, reference):
    # The first stage actor of the first group parks before its first batch of epoch 2 (tests/_elastic_probe.py),
    # so the run cannot end before the node is killed; the restarted group reads epoch 2 only (22 batches).
    probe = _probe(site, "pipe")
    first_of_epoch_2 = STEPS_PER_EPOCH + 1
    (probe / "parks.json").write_text(json.dumps({"parks": [{"name": "lost", "read": first_of_epoch_2}]}))
    published = site.shared / "pipe" / "checkpoint_epoch000001" / "meta.json"  # written last: the epoch's checkpoint
    (pipe,), replaced = _drive(site, "pipe", [{"kind": "fit", "weights": str(site.root / "pipe.pt"), "config": {
        **MLP, "dataset": "_elastic_probe:parked_stage_digits", "data_root": str(probe), "strategy": "pipeline",
        "num_stages": 2, "num_microbatches": 4, "schedule": "1f1b", "placement": "STRICT_SPREAD", "max_failures": 1,
        "name": "pipe", "storage_path": str(site.shared)}}],
        kill_when=lambda: published.exists() and any(probe.glob("parked-lost-*")))
    assert not list(probe.glob("timeout-*")), sorted(p.name for p in probe.glob("timeout-*"))
    assert pipe["ok"], pipe
    assert replaced == 1, f"the worker node was lost {replaced} time(s), not once"
    # One stage per node, both attempts; the lost node cost epoch 2 only.
    assert [(h["epoch"], h["attempt"]) for h in pipe["history"]] == [(1, 0), (2, 1)], pipe["history"]
    for h in pipe["history"]:
        assert sorted(h["node_ip_per_rank"]) == [HEAD_IP, WORKER_IP], h
    assert pipe["history"][-1]["step"] == 2 * STEPS_PER_EPOCH
    assert Path(pipe["checkpoint_path"]).is_relative_to(site.shared)
    _assert_same_weights(site.root / "pipe.pt", reference, atol=2e-5)


def test_a_streams_ray_data_tasks_run_on_the_node_labelled_ray_subcluster_ingest(site):
    """The worker node started again with the label of cluster.yaml's ``cpu`` type: an ``ingest="ray_data"``
    stream read in the driver on the head (whose CPU is free: where Ray puts a task without a selector first)
    finds the label in the GCS's node table and runs every task of the stream on that node."""
    from raytrain_mgpu.bench.data import write_images
    from raytrain_mgpu.data.parquet_stream import INGEST_LABEL

    site.site.lose_worker_node()
    site.cluster.start_worker_node(labels=dict([INGEST_LABEL]))  # the next test loses it again
    data = site.shared / "parquet"
    write_images(str(data), 1024, (3, 8, 8), seed=0)
    # 4 decode blocks (data/parquet_stream.DECODE_ROWS): without the selector Ray Data spreads its tasks over both
    # nodes, from_numpy's first on the driver's
    (stream,), _ = _drive(site, "ingest", [{"kind": "stream", "data_root": str(data), "samples": 1024}])
    assert stream["ok"] and stream["read"] == 1024, stream
    key, value = INGEST_LABEL
    labelled = [node for node, about in stream["nodes"].items() if about["labels"].get(key) == value]
    assert [stream["nodes"][node]["ip"] for node in labelled] == [WORKER_IP], stream["nodes"]
    assert {task["name"] for task in stream["tasks"]} == set(STREAM_TASKS), stream["tasks"]
    where = [(task["name"], stream["nodes"].get(task["node_id"], {}).get("ip", f"node {task['node_id']!r}"))
             for task in stream["tasks"]]
    print(f"{len(where)} Ray Data tasks on {sorted({ip for _, ip in where})}")
    assert {ip for _, ip in where} == {WORKER_IP}, where
    assert all(task["label_selector"] == dict([INGEST_LABEL]) for task in stream["tasks"]), stream["tasks"]


def test_a_node_that_joins_after_the_drivers_storage_check_and_cannot_write_it_fails_the_run_naming_it(site):
    """The head alone at the start: the driver's check (one task per node) has one node and passes. The run's one
    worker parks at step 2 on the head, the worker node joins (the storage path is read-only there), the elastic
    run grows to 2 workers, and the new node's worker fails its own check before its first step: the run fails
    with that node and the path named, within its failure budget (``max_failures=1``)."""
    probe = _probe(site, "late")
    (probe / "parks.json").write_text(json.dumps({"batch_size": MLP["batch_size"],
                                                  "parks": [{"name": "grow", "step": 2, "world_size": 1}]}))
    (late,), _ = _drive(site, "late", [{"kind": "fit", "config": {
        **MLP, "dataset": "_elastic_probe:parked_digits", "data_root": str(probe), "num_workers": [1, 2],
        "max_failures": 1, "elastic_resize_interval_s": 1.0, "name": "late", "storage_path": str(site.private)}}],
        join_when=lambda: any(probe.glob("parked-grow-*")))
    assert not list(probe.glob("timeout-*")), sorted(p.name for p in probe.glob("timeout-*"))
    assert not late["ok"], late
    named = f"node {WORKER_IP} cannot write and read TrainConfig.storage_path: {site.private / 'late'} ("
    assert named in late["error"], late["error"]
    assert "Read-only file system" in late["error"], late["error"]  # the cause, as the node's file system said it
    workers = sorted((json.loads(p.read_text()) for p in probe.glob("worker-*.json")), key=lambda w: w["started"])
    print("worker processes (world size, rank, node):",
          [(w["world_size"], w["world_rank"], w["node_ip"]) for w in workers])
    assert [(w["world_size"], w["node_ip"]) for w in workers if w["world_size"] == 1] == [(1, HEAD_IP)], workers
    on_the_new_node = [w for w in workers if w["node_ip"] == WORKER_IP]
    assert 1 <= len(on_the_new_node) <= 2, workers  # the first 2-worker group, and at most one retry of it
