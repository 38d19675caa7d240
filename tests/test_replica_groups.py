"""Replica groups (``fault_tolerance="replica_groups"``, ``engine/replica_groups.py``) without Ray: each group is
one engine in a local process of its own (a world of one, as Ray Train's ``TorchftConfig`` makes a worker),
torchft's lighthouse runs in the test's process, and the groups' transport is the Ray Train one
(``transports/ray_train/replica_groups.ReplicaGroupTransport``) with a local barrier instead of Ray Train's.

- two groups that lose nobody train what two ddp replicas train (``_reference.train_replicas``): the shards are
  the groups', the gradients their average;
- a group killed (SIGKILL) after its step 20 is replaced by a new process while the other trains on; the
  replacement heals from the survivor (weights, optimizer, schedule, position, history) and both end with the same
  weights, bit for bit; the survivor's rows count the steps it averaged alone (``short_steps``);
- a replacement that comes after the run ended finds itself alone and stops (``RunOver``) instead of training;
- the configurations replica groups cannot run are refused at construction, naming the field and the fix.

The Ray Train run (3 worker processes, the wall time against an uninterrupted run) is
tests/test_replica_groups_ray.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import raytrain_mgpu as rtm
import _forkserver
from _reference import train_replicas

os.environ.setdefault("RUST_LOG", "warn")  # torchft's INFO lines (a quorum a step), read when it is first imported
pytest.importorskip("torchft")

MLP = dict(model="mlp", dataset="digits", strategy="ddp", batch_size=32, lr=0.05, epochs=3, seed=0)
STEPS_PER_EPOCH = 44  # digits' 1,437 training samples over 2 shards of 16
BOUND_S = 120  # a wait's bound: far above a 5x slower machine's few seconds


def _config(storage: str, **fields) -> "rtm.TrainConfig":
    return rtm.TrainConfig(**{**MLP, "fault_tolerance": "replica_groups", "max_failures": 2, "num_workers": 2,
                              "use_gpu": False, "storage_path": storage, "name": "rg", **fields})


def _group(index: int, count: int, storage: str, lighthouse: str, barrier, out: str,
           kill_after: int, park: dict, worker_group: str = "local", fields: dict = None) -> None:
    """One replica group's process: a world of one, its engine trained to the end (or killed after step
    ``kill_after``); ``park``: wait after step ``park["step"]`` until ``park["file"]`` exists."""
    import torch.distributed as dist

    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine.devices import resolve_devices
    from raytrain_mgpu.engine.loop import Engine
    from raytrain_mgpu.engine.step import STEP_EVENTS
    from raytrain_mgpu.strategies import WorkerContext
    from raytrain_mgpu.strategies.plan import build_plan
    from raytrain_mgpu.transports.base import data_parallel_steps
    from raytrain_mgpu.transports.ray_train.replica_groups import ReplicaGroupTransport

    torch.set_num_threads(1)
    # the group's store on a port the OS picks (a port picked first and bound later may be taken in between);
    # torchft's manager finds it through MASTER_ADDR/MASTER_PORT, as Ray Train sets them
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cfg = _config(storage, **(fields or {}))
    data = build_datasets(cfg.data)
    assignment = resolve_devices(False, 1)
    ctx = WorkerContext(0, 1, 0, 1, 0, assignment.compute, assignment, replica_group=(index, count))
    outdir, pid = Path(out), os.getpid()

    class LocalTransport(ReplicaGroupTransport):
        def where(self) -> dict:
            return {}

        def replica_groups(self, device):
            groups = super().replica_groups(device)
            (outdir / f"joined-{index}-{pid}").write_text("1")  # its manager beats: the lighthouse knows it
            return groups

    def events(step: int) -> None:
        if step == kill_after:
            os.kill(pid, signal.SIGKILL)
        if park and step == park["step"]:
            (outdir / f"parked-{index}").write_text(str(step))
            deadline = time.monotonic() + BOUND_S
            while not Path(park["file"]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    STEP_EVENTS.append(events)
    transport = LocalTransport(cfg, index, count, None, worker_group=worker_group,
                               barrier=lambda: barrier.wait(BOUND_S))
    engine = Engine(cfg, build_plan(cfg, len(data.train)), data_parallel_steps(cfg, ctx, data), transport, data)
    engine.run()
    transport.run_over()
    torch.save(engine.steps.named_model().state_dict(), outdir / f"weights-{index}-{pid}.pt")
    (outdir / f"history-{index}-{pid}.json").write_text(json.dumps(engine.state.history))


@pytest.fixture
def lighthouse():
    """A lighthouse of the test's own: a group left over from another test would count as a live peer."""
    from torchft.coordination import LighthouseServer

    from raytrain_mgpu.transports.ray_train.replica_groups import LIGHTHOUSE

    server = LighthouseServer(bind="[::]:0", **LIGHTHOUSE)
    yield server.address()
    for process in _STARTED:  # none outlives its test
        if process.is_alive():
            process.kill()
            process.join(10)
    _STARTED.clear()
    server.shutdown()


_STARTED: list = []


def _start(tmp_path: Path, lighthouse: str, barrier, index: int, kill_after: int = -1, park: dict = None,
           worker_group: str = "local", fields: dict = None):
    process = _forkserver.process(_group, (index, 2, str(tmp_path / "runs"), lighthouse, barrier, str(tmp_path),
                                           kill_after, park or {}, worker_group, fields))
    process.start()
    _STARTED.append(process)
    return process


def _results(tmp_path: Path, index: int) -> list:
    return [(json.loads(h.read_text()), torch.load(h.with_name(h.name.replace("history", "weights")).with_suffix(".pt")))
            for h in sorted(tmp_path.glob(f"history-{index}-*.json"))]


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + BOUND_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path.name} not written within {BOUND_S} s"


def _train_both(tmp_path: Path, lighthouse: str, **options) -> None:
    """Both groups started together (a barrier of their own) and trained to the end."""
    barrier = _forkserver.context().Barrier(2)
    groups = [_start(tmp_path, lighthouse, barrier, index, **options) for index in (0, 1)]
    for index, process in enumerate(groups):
        _join(process, f"group {index}")


def _join(process, what: str) -> None:
    process.join(BOUND_S)
    assert process.exitcode == 0, f"{what} exited with {process.exitcode}"


@pytest.mark.timeout(300)
def test_two_groups_that_lose_nobody_train_what_two_ddp_replicas_train(tmp_path, lighthouse):
    _train_both(tmp_path, lighthouse)
    reference, reference_history = train_replicas({**MLP, "num_workers": 2})
    (history0, weights0), = _results(tmp_path, 0)
    (history1, weights1), = _results(tmp_path, 1)
    for key in reference:
        torch.testing.assert_close(weights0[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(weights0[key], weights1[key]), key
    assert [row["short_steps"] for row in history0] == [0, 0, 0], history0
    assert [row["step"] for row in history0] == [44, 88, 132]
    for row, expected in zip(history0, reference_history):  # the rows sum both groups' shards
        assert row["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5)
        assert row["test_accuracy"] == pytest.approx(expected["test_accuracy"], abs=1e-9)


@pytest.mark.timeout(300)
def test_a_killed_group_is_replaced_heals_from_the_survivor_and_both_end_equal(tmp_path, lighthouse):
    barrier = _forkserver.context().Barrier(2)
    # the survivor waits after its step 40 until the replacement's manager beats (bounded): the run cannot end first
    survivor = _start(tmp_path, lighthouse, barrier, 0, park={"step": 40, "file": str(tmp_path / "replacement")})
    lost = _start(tmp_path, lighthouse, barrier, 1, kill_after=20)
    lost.join(BOUND_S)
    assert lost.exitcode == -signal.SIGKILL, lost.exitcode
    # started once the survivor has trained alone to its step 40 (a replacement started at once may beat the
    # lighthouse's 1 s heartbeat timeout, and the survivor's quorum then waits for it instead of going on alone)
    _wait_for(tmp_path / "parked-0")
    replacement = _start(tmp_path, lighthouse, barrier, 1)
    _wait_for(tmp_path / f"joined-1-{replacement.pid}")
    (tmp_path / "replacement").write_text("1")
    _join(survivor, "the survivor")
    _join(replacement, "the replacement")
    (history0, weights0), = _results(tmp_path, 0)  # one survivor process, to the end
    (history1, weights1), = _results(tmp_path, 1)  # the replacement's (the lost one wrote nothing)
    assert [row["step"] for row in history0] == [44, 88, 132]
    for key in weights0:
        assert torch.equal(weights0[key], weights1[key]), key  # healed, then every step averaged by both
    # the epochs before it joined came with the survivor's state; every row sums both groups' samples
    assert [row["step"] for row in history1] == [44, 88, 132]
    for row0, row1 in zip(history0, history1):
        assert (row1["train_loss"], row1["samples_per_s"] > 0) == (row0["train_loss"], True)
    alone = sum(row["short_steps"] for row in history0)
    assert 20 <= alone < 132, history0  # its steps 21-40 at least: the replacement started after them
    assert history0[-1]["short_steps"] == 0, history0  # both again by the last epoch
    assert history0[-1]["test_accuracy"] > 0.8


@pytest.mark.timeout(300)
def test_when_every_group_is_lost_the_new_groups_resume_from_the_leaders_step_checkpoint(tmp_path, lighthouse):
    fields = {"checkpoint_every_n_steps": 10}
    barrier = _forkserver.context().Barrier(2)
    lost = [_start(tmp_path, lighthouse, barrier, index, kill_after=25, fields=fields) for index in (0, 1)]
    for process in lost:
        process.join(BOUND_S)
        assert process.exitcode == -signal.SIGKILL, process.exitcode
    # Ray Train's whole-group restart: a new worker group (its own marks), both groups again
    _train_both(tmp_path, lighthouse, worker_group="local2", fields=fields)
    (history0, weights0), = _results(tmp_path, 0)
    (history1, weights1), = _results(tmp_path, 1)
    assert [row["step"] for row in history0] == [44, 88, 132]
    for key in weights0:
        assert torch.equal(weights0[key], weights1[key]), key
    # resumed (attempt 1) from a step checkpoint the leading group wrote: without one it would start again at 0
    assert [row["attempt"] for row in history0] == [1, 1, 1], history0
    assert history0[0]["short_steps"] == 0


@pytest.mark.timeout(300)
def test_a_replacement_that_comes_after_the_end_stops_instead_of_training_alone(tmp_path, lighthouse):
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    _train_both(tmp_path, lighthouse)
    # Its run folder's newest checkpoint is removed, as if the replacement had read the folder before the last one
    # was published: it resumes from epoch 2, finds itself alone in its first quorum and the run marked finished.
    folder = Path(RunFolder.of(_config(str(tmp_path / "runs"))).path)
    for last in folder.glob("checkpoint_epoch000003*"):
        shutil.rmtree(last)
    late = _start(tmp_path, lighthouse, None, 1)  # the run's start mark is there: a replacement waits for nobody
    _join(late, "the late replacement")
    late_history = json.loads((tmp_path / f"history-1-{late.pid}.json").read_text())
    assert [row["step"] for row in late_history] == [44, 88], late_history  # trained nothing past its resume point


@pytest.mark.parametrize("fields, named", [
    ({"strategy": "fsdp"}, "nothing to shard inside a group"),
    ({"strategy": "dp", "num_workers": 1}, "no other group carries on"),
    ({"strategy": "pipeline", "num_stages": 2}, "actor group of its own"),
    ({"strategy": "ddp2"}, "spans several devices"),
    ({"num_workers": 1}, "at least 2"),
    ({"num_workers": (2, 2)}, "at least 2"),
    ({"max_failures": 0}, "max_failures=0"),
    ({"runner": "local"}, "runner='local'"),
    ({"strategy": "auto"}, "strategy='auto'"),
])
def test_what_replica_groups_cannot_run_is_refused_at_construction(fields, named, tmp_path):
    with pytest.raises(ValueError, match="replica_groups|strategy='auto'") as refused:
        _config(str(tmp_path), **fields)
    assert named in str(refused.value)


def test_without_torchft_the_refusal_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ValueError, match=r"raytrain-mgpu\[ft\]"):
        _config(str(tmp_path))


def test_the_ledger_counts_the_steps_averaged_by_fewer_groups():
    from raytrain_mgpu.driver.goodput import describe, summarize

    rows = [{"epoch": 1, "step": 44, "training_s": 1.0, "short_steps": 0},
            {"epoch": 2, "step": 88, "training_s": 1.0, "short_steps": 20, "dropped_steps": 1}]
    session = {"start": 0.0, "end": 5.0, "saves": 2,
               "attempts": [{"start": 0.0, "first_step": 1.0, "end": 5.0, "failed": False, "resumed": 0,
                             "reached": 88}]}
    ledger = summarize([session], rows)
    assert (ledger["short_steps"], ledger["dropped_steps"]) == (20, 1)
    assert "20 steps averaged over fewer replica groups" in describe(ledger)
    assert summarize([session], [{**row, "short_steps": 0} for row in rows])["short_steps"] == 0


@pytest.mark.parametrize("device, group", [("cuda:0", "ProcessGroupNCCL"), ("cpu", "ProcessGroupGloo")])
def test_the_groups_meet_over_nccl_on_a_gpu_and_gloo_on_cpu(device, group, monkeypatch):
    """The one CUDA decision replica groups make (a machine without a GPU records it: torchft's classes stand in)."""
    import torchft
    import torchft.checkpointing.pg_transport as pg_transport

    from raytrain_mgpu.engine.replica_groups import ReplicaGroups

    made = {}

    def recorder(name):
        def make(*args, **kwargs):
            made[name] = (args, kwargs)
            return name
        return make

    for name in ("ProcessGroupNCCL", "ProcessGroupGloo", "Manager"):
        monkeypatch.setattr(torchft, name, recorder(name))
    monkeypatch.setattr(pg_transport, "PGTransport", recorder("PGTransport"))
    ReplicaGroups(1, 2, torch.device(device), "run", timeout_s=7.0)
    assert group in made and ({"ProcessGroupNCCL", "ProcessGroupGloo"} - {group}).isdisjoint(made)
    assert made["PGTransport"][1]["device"] == torch.device(device)  # the healing state travels on that device
    manager = made["Manager"][1]
    assert (manager["pg"], manager["replica_id"], manager["use_async_quorum"]) == (group, "run-group1", False)
