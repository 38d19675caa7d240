"""Where a Parquet stream's Ray Data tasks run (``data/parquet_stream.placement``) and what the driver says and
refuses about it (``transports/ray_data.check_cpus_left``).

Without Ray: the choice on made-up clusters (``ray.nodes()``'s entries, ``Capacity`` as the driver reads it):
CPU ingest nodes (label ``ray-subcluster=ingest``) where one is up, else the CPUs beside the training processes,
printed in the banner's line with each stream's share, and refused where there is none. With the shared Ray
(one small stream per case, in this process): every task of the stream, ``from_numpy``'s included, carries the
label selector the choice made and runs on the node it names; with no ingest node, the tasks carry none. On a real
node started with the label, in a two-node cluster: tests/test_two_node.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.data import parquet_stream
from raytrain_mgpu.data.parquet_stream import INGEST_LABEL, Placement, placement
from raytrain_mgpu.driver.cluster import Capacity
from raytrain_mgpu.strategies.plan import build_plan
from raytrain_mgpu.transports.ray_data import check_cpus_left

INGEST = dict([INGEST_LABEL])


def node(cpus: float, gpus: float = 0, labels: dict = None, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}, "Labels": labels or {}}


def test_the_tasks_go_to_the_cpu_ingest_nodes_that_are_up_else_beside_the_training_processes():
    gpu_node = node(48, 4)
    # one machine, or GPU nodes only: the CPUs the training processes' placement group does not hold
    assert placement([node(4)], held_cpus=2) == Placement(None, 2.0, 0)
    assert placement([gpu_node, gpu_node], held_cpus=8) == Placement(None, 88.0, 0)
    # CPU ingest nodes up: there, all of their CPUs; the GPU nodes' CPUs stay the workers'
    ingest = [gpu_node, node(16, labels=INGEST), node(16, labels=INGEST)]
    assert placement(ingest, held_cpus=8) == Placement(INGEST, 32.0, 2)
    # a lost ingest node (not alive), or a labelled node without a CPU, takes no task
    assert placement([gpu_node, node(16, labels=INGEST, alive=False), node(0, labels=INGEST)], 8) == Placement(
        None, 40.0, 0)
    assert placement([node(2)], held_cpus=2).cpus == 0  # nothing beside: the driver refuses such a run
    # a CPU-only run's workers on an ingest node: its CPUs they hold are not the stream's; one left with less
    # than a CPU takes no task (the tasks go beside the training processes instead)
    shared = [dict(node(4), NodeID="a"), dict(node(16, labels=INGEST), NodeID="b")]
    assert placement(shared, held_cpus=6, held_by_node={"b": 6}) == Placement(INGEST, 10.0, 1)
    assert placement(shared, held_cpus=16, held_by_node={"b": 16}) == Placement(None, 4.0, 0)


def test_the_banner_says_where_the_tasks_run_and_each_streams_share_and_a_run_with_no_cpu_is_refused():
    cfg = rtm.TrainConfig(dataset="parquet", data_root="/data", ingest="ray_data", num_workers=2, use_gpu=False)
    machine = Capacity(alive=({"CPU": 4.0},))
    assert check_cpus_left(cfg, build_plan(cfg), machine) == (
        "ingest: Ray Data's tasks on 2 CPU beside the training processes' 2 (1 per stream, 2 stream(s))")
    pipe = cfg.replace(strategy="pipeline", num_stages=2, num_microbatches=2, num_workers=1)  # its first stage reads
    assert check_cpus_left(pipe, build_plan(pipe), machine).endswith("processes' 2 (2 per stream, 1 stream(s))")
    assert check_cpus_left(cfg.replace(ingest="loader"), build_plan(cfg), machine) is None
    # 2 workers on 2 CPUs: nothing to reserve, refused naming the CPUs (tests/test_ray_ingest.py has the fixes)...
    laptop = Capacity(alive=({"CPU": 2.0},))
    with pytest.raises(ValueError, match=r"the training processes hold 2 of the cluster's 2 CPU"):
        check_cpus_left(cfg, build_plan(cfg), laptop)
    # ... unless a CPU ingest node is up: the stream decodes there
    nodes = [node(2), node(16, labels=INGEST)]
    with_ingest = Capacity(alive=({"CPU": 2.0}, {"CPU": 16.0}))
    assert check_cpus_left(cfg, build_plan(cfg), with_ingest, nodes) == (
        "ingest: Ray Data's tasks on 1 CPU ingest node(s) (16 CPU, label ray-subcluster=ingest); the training "
        "processes keep their nodes' CPUs")
    # a CPU-only run whose workers take every CPU, the ingest node's too: refused, ingest node or not
    busy = cfg.replace(num_workers=18, batch_size=126)  # a CPU each
    with pytest.raises(ValueError, match=r"the training processes hold 18 of the cluster's 18 CPU"):
        check_cpus_left(busy, build_plan(busy), with_ingest, nodes)


def test_the_stream_dataset_carries_the_placement_and_leaves_the_process_context_as_it_was():
    import ray.data

    context = ray.data.DataContext.get_current()
    before = (context.execution_options.label_selector, context.execution_options.resource_limits.cpu)
    with parquet_stream._stream_context(Placement({"a": "b"}, 3.0, 1)):
        options = ray.data.DataContext.get_current().execution_options
        assert (options.label_selector, options.resource_limits.cpu, options.preserve_order) == ({"a": "b"}, 3, True)
    with parquet_stream._stream_context(Placement(None, 0.5, 0)):  # under a CPU: Ray Data's own limit
        assert ray.data.DataContext.get_current().execution_options.resource_limits.cpu == before[1]
    after = ray.data.DataContext.get_current().execution_options
    assert (after.label_selector, after.resource_limits.cpu) == before


def _stream_tasks(ray, since_ms: int, expected: set, timeout_s: float = 60.0) -> list:
    """The finished tasks of the stream started at ``since_ms`` (Ray's task events reach the state API within
    about a second); waits until every kind in ``expected`` is there, ``timeout_s`` at most."""
    from ray.util.state import list_tasks

    deadline = time.monotonic() + timeout_s
    while True:
        # By name, filtered where Ray keeps the events: the whole suite's shared instance holds more tasks than one
        # listing returns (10,000), and an unfiltered listing fails on the truncation.
        tasks = [t for name in sorted(expected)
                 for t in list_tasks(address=ray.get_runtime_context().gcs_address, detail=True, limit=10_000,
                                     filters=[("name", "=", name), ("state", "=", "FINISHED")],
                                     raise_on_missing_output=False)
                 if (t.creation_time_ms or 0) >= since_ms]
        if expected <= {t.name for t in tasks} or time.monotonic() > deadline:
            return tasks
        time.sleep(0.5)


@pytest.mark.ray
def test_every_task_of_a_stream_runs_on_the_ingest_node_it_was_placed_on(ray_session, tmp_path, monkeypatch):
    """The shared instance is one node without the ingest label: here its own node-id label stands for it."""
    from raytrain_mgpu.bench.data import write_images
    from raytrain_mgpu.data import build_datasets

    ray = ray_session
    root = str(tmp_path / "parquet")
    write_images(root, 96, (3, 8, 8), seed=0)
    stream = parquet_stream.stream_source(build_datasets(rtm.TrainConfig(dataset="parquet", data_root=root).data).train)
    expected = {"ndarray_to_block", "MapBatches(_read)", "MapBatches(_decode)"}

    def run() -> list:
        since = int(time.time() * 1000)
        dataset = stream.dataset(np.arange(80), epoch=0)
        assert sum(len(batch["y"]) for batch in dataset.iter_batches(batch_size=16)) == 80
        tasks = _stream_tasks(ray, since, expected)
        assert expected <= {t.name for t in tasks}, sorted({t.name for t in tasks})
        return tasks

    this_node = ray.get_runtime_context().get_node_id()
    monkeypatch.setattr(parquet_stream, "INGEST_LABEL", ("ray.io/node-id", this_node))
    for task in run():
        assert task.label_selector == {"ray.io/node-id": this_node} and task.node_id == this_node, task
    monkeypatch.undo()  # the real label: no node of the shared instance has it, so the tasks go anywhere
    assert all(not task.label_selector for task in run())
