"""What a user's laptop meets: a Ray that declares only the machine's real CPUs.

The shared test instance declares 4 CPUs (and 4 emulated GPUs) on a 2-core machine, so no test
there meets the resources a user has. Here, in a subprocess, local Rays started the way a user's
script starts them (the CPUs they detect; 2 fake GPUs under the emulation, computed on CPU) run
each runner and the Ray Data path once:

- Ray Train workers: an elastic ``num_workers=(1, 3)`` ddp run with ``use_gpu=True``, which Ray's
  elastic policy starts with the 2 workers the 2 fake GPUs have room for, ending with one worker's
  weights (tests/test_elastic.py's arithmetic), in a script without ``ray.init``: ``fit`` starts the
  local Ray itself and keeps it up for the next ``fit`` of the script (shut down at exit);
- the runs below, the script's next ``fit`` calls, on the Ray the first one kept. The pipeline's actor
  group: 2 stages, one CPU each (every CPU of a 2-core machine);
- Ray Data streaming into 1 Ray Train worker, with a CPU left for Ray Data's read tasks;
- those two runs train what a user's script defines in its ``__main__`` (the driver's model class,
  dataset function, loss, metric and optimizer functions: tests/_fit_driver.py), which Ray sends to
  the stage actors and the Ray Train worker by value;
- the runs that would leave Ray Data no CPU (a worker per CPU; a 2-stage pipeline whose stages hold every
  CPU: on a 2-core machine 2 workers, and 2 stages of one CPU), refused before any bundle is placed
  instead of waiting for ever (what a user saw before: ``2.0/2.0 CPU used``, a pending ``{'CPU': 1.0}``
  read task, nothing printed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray._private.utils
import torch
from _emulation_checks import check_devices
from _reference import one_worker_weights
from _ray_nodes import base_env

import raytrain_mgpu as rtm
from raytrain_mgpu.data.convert import convert_to_parquet
from raytrain_mgpu.engine.devices import EMULATE_ENV

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="sgd", lr=0.1, epochs=2,
             use_gpu=False)  # the CPU runs beside the emulated GPUs' elastic one
CPUS = ray._private.utils.get_num_cpus()  # what a local Ray declares on this machine
# The elastic run: at most 3 workers, room for 2 (the 2 fake GPUs); the micro-batch is fixed by the max count
# (66 / (3 x 2) = 11), so each of the 2 accumulates 3 micro-batches a step (tests/test_elastic.py's arithmetic).
ELASTIC = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=66, grad_accum_steps=2, optimizer="sgd",
               lr=0.1, seed=3, epochs=1, max_steps=4)


@pytest.fixture(scope="module")
def laptop_runs():
    root = Path(tempfile.mkdtemp(prefix="rtmcpu-", dir="/tmp"))  # short: Ray's socket paths
    try:
        # digits as raw pixel bytes (`raytrain-mgpu data convert`): the decode of PNG/JPEG is
        # tests/test_ray_ingest.py's; here the point is the CPUs.
        convert_to_parquet(rtm.TrainConfig(dataset="digits").data, str(root / "parquet"), rows_per_file=500)
        storage = str(root / "results")
        # 1 epoch: that Ray Data streams beside the worker on the real CPUs; its epochs restart, and
        # 2 workers stream an equal split, on the shared instance (tests/test_ray_ingest.py).
        stream = dict(SMALL, dataset="parquet", data_root=str(root / "parquet"), ingest="ray_data", epochs=1,
                      storage_path=storage)
        mine = {"model": "Net", "loss": "smooth_loss", "metrics": ["hits"], "optimizer": "momentum_sgd"}
        width = {"model_kwargs": {"width": 32}}
        # No ray.init before it: fit starts a local Ray of its own, as a script without one does, and keeps it
        # up for the next fits of the script: the runs after it (one script, one Ray start).
        own = [{"kind": "fit", "own_ray": True, "config": dict(ELASTIC, dataset="digits", num_workers=[1, 3],
                                                               use_gpu=True, name="elastic", storage_path=storage),
                "weights": str(root / "elastic.pt")}]
        shared = [
            {"kind": "fit", "config": dict(SMALL, **width, strategy="pipeline", num_stages=2, num_microbatches=2,
                                           name="pipe", storage_path=storage),
             "objects": {**mine, "dataset": "digit_tensors"}, "weights": str(root / "pipe.pt")},
            {"kind": "fit", "config": dict(stream, **width, num_workers=1, name="stream"), "objects": mine},
            # every CPU held by the training processes, whatever the machine: a worker per CPU; 2 stages of
            # half the CPUs or more (2 workers and 2 stages of one CPU on 2 cores)
            {"kind": "fit", "config": dict(stream, num_workers=CPUS, batch_size=32 * CPUS, name="stream-2")},
            {"kind": "fit", "config": dict(stream, strategy="pipeline", num_stages=2, num_microbatches=2,
                                           cpus_per_worker=(CPUS + 1) // 2, name="stream-pipe")},
        ]
        (root / "home").mkdir()
        env = base_env(root / "home", RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(root), **{EMULATE_ENV: "2"})
        steps = own + shared
        (root / "plan.json").write_text(json.dumps({"steps": steps}))
        done = subprocess.run([sys.executable, "tests/_fit_driver.py", str(root / "plan.json"),
                               str(root / "results.json")], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        results = json.loads((root / "results.json").read_text())
        assert len(results) == len(steps), done.stderr[-4000:]
        runs = dict(zip([s["config"]["name"] for s in steps], results))
        for name in ("pipe", "stream"):  # what the run folder recorded of the objects, read before it goes
            run = runs[name]
            run["recorded"] = json.loads((Path(run["path"]) / "run.json").read_text()) if run["ok"] else None
        yield {**runs, "elastic.pt": str(root / "elastic.pt"), "pipe.pt": str(root / "pipe.pt")}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.ray  # a Ray of its own, in a subprocess
def test_each_runner_trains_on_the_real_cpus(laptop_runs):
    cpus = os.cpu_count()
    pipe, elastic = laptop_runs["pipe"], laptop_runs["elastic"]
    assert pipe["ok"] and elastic["ok"], (pipe, elastic, f"{cpus} CPUs")
    assert [row["epoch"] for row in pipe["history"]] == [1, 2]
    # the driver's own metric function ("hits") measured on the last stage, its loss trained the stages
    assert pipe["history"][-1]["test_hits"] > 0.5 and pipe["history"][-1]["train_loss"] < pipe["history"][0]["train_loss"]
    assert "test_accuracy" not in pipe["history"][-1] or pipe["history"][-1]["test_accuracy"] is None
    recorded = pipe["recorded"]  # the run folder names each object and hashes its source (a resume compares it)
    for field, name in (("model", "Net"), ("dataset", "digit_tensors"), ("optimizer", "momentum_sgd")):
        assert re.fullmatch(rf"<object __main__:{name} sha256:[0-9a-f]{{16}}>", recorded[field]), recorded
    # load_model() rebuilt the driver's Net (its layer names) with the stages' weights
    assert sorted(torch.load(laptop_runs["pipe.pt"], weights_only=True)) == ["1.bias", "1.weight", "3.bias", "3.weight"]
    row = elastic["history"][-1]
    check_devices(row, workers=2, per_worker=1)  # grown to both fake GPUs; the CPUs held nothing back
    assert row["workers"] == 2 and row["step"] == 4
    assert sorted(d for ds in row["devices_per_rank"] for d in ds) == ["cuda:0", "cuda:1"]
    # 2 of at most 3 workers train what one worker does (2 micro-batches of 33 a step), computed here
    one = one_worker_weights(**ELASTIC, num_workers=1)
    weights = torch.load(laptop_runs["elastic.pt"], weights_only=True)
    assert weights.keys() == one.keys()
    for key, value in one.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # fit started that Ray itself (no ray.init before it) with the fake GPUs, and kept it up for the script's
    # next fit (cluster.keep_ray_started: shut down at exit)
    assert elastic["ray_left_running"] is True


@pytest.mark.ray
def test_ray_data_trains_beside_one_worker_and_a_run_without_a_spare_cpu_is_refused(laptop_runs):
    stream = laptop_runs["stream"]
    assert stream["ok"], stream
    assert [row["step"] for row in stream["history"]] == [1438 // 64]
    # one epoch of SGD from scratch has learnt (10 classes): the driver's Net, loss, metric and optimizer
    assert stream["history"][-1]["test_hits"] > 0.6
    assert stream["recorded"]["model"].startswith("<object __main__:Net sha256:")
    for name, held, fix in (("stream-2", CPUS, "lower num_workers or cpus_per_worker"),
                            ("stream-pipe", 2 * ((CPUS + 1) // 2), "lower num_workers or num_stages or cpus_per_worker")):
        refused = laptop_runs[name]
        assert not refused["ok"] and refused["error"].startswith(
            f"ValueError: ingest='ray_data': the training processes hold {held} of the cluster's {CPUS} CPU"), refused
        assert fix in refused["error"] and not refused.get("history")
