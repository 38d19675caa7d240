"""A driver process for tests that run ``fit`` from elsewhere (another network namespace, or
a Ray instance of its own whose settings differ from the shared test instance's).

    RAY_ADDRESS=host:port python tests/_fit_driver.py plan.json results.json
    python tests/_fit_driver.py plan.json results.json   # plan.json has "local_ray": {ray.init kwargs}

``plan.json`` lists steps, run in order in one Ray connection::

    {"steps": [{"kind": "check_storage", "storage_path": "/x"},
               {"kind": "fit", "config": {TrainConfig fields}, "weights": "/out/w.pt"}]}

A first fit step with ``"own_ray": true`` runs before the driver connects: ``fit`` starts a local Ray
of its own, as in a script without ``ray.init``, and keeps it for the steps after it, which run on it (shut down
when this process exits); its entry says whether Ray was left running (``ray_left_running``).

A ``stream`` step (``{"kind": "stream", "data_root": "/parquet", "samples": 80}``) reads that many samples of a
Parquet folder's training split as an ``ingest="ray_data"`` run's stream (``data/parquet_stream.py``), here in the
driver, and gives where each of its Ray Data tasks ran: ``tasks`` (name, node id, label selector) and ``nodes``
(node id: address, labels).

A fit step's ``"objects"`` (``{"model": "Net", "loss": "smooth_loss", "metrics": ["hits"]}``) replaces those
fields with the classes and functions of that name defined below, in this script's ``__main__``: what a
user's driver script or notebook hands ``TrainConfig``, which Ray must send to its processes by value.

After every step ``results.json`` holds one entry per finished step: ``ok``, ``seconds``,
``error`` ("Type: message") or, for a fit, ``history``, ``path``, ``checkpoint_path``
(and the trained weights saved to ``weights``).
"""

import json
import os
import sys
import time

import ray
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.driver import preflight

# ----------------------------------------------------------------------------- a user's objects, in __main__


class Net(torch.nn.Sequential):
    """A two-layer classifier of the digits; a sequence of blocks, so the pipeline can split it."""

    def __init__(self, input_shape, num_classes, width=32):
        pixels = int(torch.tensor(input_shape).prod())
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(pixels, width), torch.nn.ReLU(),
                         torch.nn.Linear(width, num_classes))


def digit_tensors(cfg):
    """The digits as a user holds them: two TensorDatasets of pixels in [0, 1]."""
    from torch.utils.data import TensorDataset

    from raytrain_mgpu.data.base import Datasets
    from raytrain_mgpu.data.digits import load_split

    train_x, train_y, test_x, test_y = load_split()
    pixels = lambda images: torch.tensor(images, dtype=torch.float32) / 16  # noqa: E731 (shipped by value too)
    return Datasets(TensorDataset(pixels(train_x), torch.tensor(train_y)),
                    TensorDataset(pixels(test_x), torch.tensor(test_y)), (1, 8, 8), 10)


def smooth_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, label_smoothing=0.05)


def hits(outputs, targets):
    return (outputs.argmax(1) == targets).sum(), targets.numel()


def momentum_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.5)


def _objects(names: dict) -> dict:
    here = globals()
    return {k: [here[n] for n in v] if isinstance(v, list) else here[v] for k, v in names.items()}


STREAM_TASKS = ("ndarray_to_block", "MapBatches(_read)", "MapBatches(_decode)")  # from_numpy's, read's, decode's


def _stream(data_root: str, samples: int, timeout_s: float = 60.0) -> dict:
    """Read ``samples`` samples of the stream, then the Ray Data tasks this driver's job ran, once the GCS has
    every kind of them and each finished (task events reach it within about a second, later on a busy machine).
    From the GCS's own task events: a cluster without a dashboard has no state API."""
    import numpy as np
    from ray._private.state import state
    from ray.core.generated.common_pb2 import TaskStatus

    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.data.parquet_stream import stream_source

    cfg = rtm.TrainConfig(dataset="parquet", data_root=data_root, ingest="ray_data")
    stream = stream_source(build_datasets(cfg.data).train)
    read = sum(len(batch["y"]) for batch in stream.dataset(np.arange(samples), epoch=0).iter_batches(batch_size=16))
    job = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + timeout_s
    while True:
        events = [e for e in state._get_all_task_events()
                  if e.job_id.hex() == job and e.task_info.name in STREAM_TASKS]
        tasks = [{"name": e.task_info.name,
                  "node_id": (e.state_updates.node_id or e.task_info.node_id).hex(),
                  "label_selector": dict(e.task_info.label_selector)} for e in events]
        finished = all(TaskStatus.FINISHED in e.state_updates.state_ts_ns for e in events)
        if ({t["name"] for t in tasks} >= set(STREAM_TASKS) and finished) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    nodes = {n["NodeID"]: {"ip": n["NodeManagerAddress"], "labels": n.get("Labels") or {}}
             for n in ray.nodes() if n.get("Alive")}
    return {"read": read, "tasks": tasks, "nodes": nodes}


def _run(step: dict) -> dict:
    if step["kind"] == "check_storage":
        preflight.check_storage_reachable(step["storage_path"])
        return {}
    if step["kind"] == "stream":
        return _stream(step["data_root"], step["samples"])
    result = rtm.fit(rtm.TrainConfig(**{**step["config"], **_objects(step.get("objects", {}))}))
    if step.get("weights"):
        torch.save(result.load_model().state_dict(), step["weights"])
    return {"history": result.history, "path": result.path, "checkpoint_path": result.checkpoint_path}


def main(plan_path: str, results_path: str) -> None:
    plan = json.loads(open(plan_path).read())
    steps = plan["steps"]
    results, connected = [], False
    try:
        for step in steps:
            if step.get("own_ray"):
                assert not connected, "an own_ray step must come before every step that connects"
            elif not connected:
                if "local_ray" in plan:  # a fresh local instance, never one already running on the machine
                    ray.init(address="local", log_to_driver=False, **plan["local_ray"])
                else:
                    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
                connected = True
            start = time.monotonic()
            try:
                entry = {"ok": True, **_run(step)}
            except Exception as exc:  # reported to the test, which decides
                entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            entry["seconds"] = round(time.monotonic() - start, 1)
            if step.get("own_ray"):
                entry["ray_left_running"] = connected = ray.is_initialized()  # the steps after it use that Ray
            results.append(entry)
            with open(results_path, "w") as f:
                json.dump(results, f)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
