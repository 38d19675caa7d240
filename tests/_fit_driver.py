"""A driver process for tests that run ``fit`` from elsewhere (another network namespace, or
a Ray instance of its own whose settings differ from the shared test instance's).

    RAY_ADDRESS=host:port python tests/_fit_driver.py plan.json results.json
    python tests/_fit_driver.py plan.json results.json   # plan.json has "local_ray": {ray.init kwargs}

``plan.json`` lists steps, run in order in one Ray connection::

    {"steps": [{"kind": "check_storage", "storage_path": "/x"},
               {"kind": "fit", "config": {TrainConfig fields}, "weights": "/out/w.pt"}]}

A first fit step with ``"own_ray": true`` runs before the driver connects: ``fit`` starts (and
stops) a local Ray of its own, as in a script without ``ray.init``; its entry says whether Ray was
left running (``ray_left_running``).

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
from raytrain_mgpu.planning import preflight


def _run(step: dict) -> dict:
    if step["kind"] == "check_storage":
        preflight.check_storage_reachable(step["storage_path"])
        return {}
    result = rtm.fit(rtm.TrainConfig(**step["config"]))
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
                entry["ray_left_running"] = ray.is_initialized()
            results.append(entry)
            with open(results_path, "w") as f:
                json.dump(results, f)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
