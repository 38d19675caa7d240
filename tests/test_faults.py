"""Faults: a killed worker, a kill during a checkpoint save, a stalled rank, bad inputs.

The faults are injected from inside the workers by ``_probe_data:digits`` (a user dataset
factory that ``fit`` ships to the workers), so they hit at a chosen sample count rather
than at a wall-clock time that depends on the machine's load.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import _probe_data
import raytrain_mgpu as rtm
import raytrain_mgpu.cluster
import raytrain_mgpu.loop
from raytrain_mgpu import api, preflight
from raytrain_mgpu.data.convert import convert_to_parquet

from _ray_nodes import free_port

REPO = Path(__file__).resolve().parents[1]

# As in test_fit: no BatchNorm or dropout, so runs that see the same batches agree exactly.
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="sgd", lr=0.1, seed=3,
           num_workers=2, epochs=3)
STEPS_PER_EPOCH = 1438 // 64          # digits' train split, global batch 64
PER_RANK_EPOCH = STEPS_PER_EPOCH * 32  # samples one of two ranks serves per epoch


def _probe(tmp_path: Path, **plan) -> Path:
    probe = tmp_path / "probe"
    probe.mkdir()
    if plan:
        (probe / "plan.json").write_text(json.dumps(plan))
    return probe


def _served(probe: Path, rank: int) -> list:
    """Per worker process of ``rank`` (in start order): the training indices it served."""
    infos = sorted((json.loads(p.read_text()) for p in probe.glob(f"worker-{rank}-*.json")),
                   key=lambda info: info["started"])
    return [[int(i) for i in (probe / f"indices-{rank}-{info['pid']}.txt").read_text().split()] for info in infos]


@pytest.fixture
def fault_hooks(monkeypatch):
    """Workers run loop.train_worker with raytrain_mgpu.faults' hooks (stuck-rank names,
    waiting for each report to be collected); a pass-through once loop.py applies them."""
    monkeypatch.setattr(raytrain_mgpu.loop, "train_worker", _probe_data.guarded_train_worker)


@pytest.fixture(scope="module")
def survivor(ray_session, tmp_path_factory):
    """One run through two faults: rank 1 is SIGKILLed half-way through epoch 2 (no cleanup,
    like the OOM killer); after the restart, rank 0 is SIGKILLed while uploading the
    checkpoint of epoch 3, half of its bytes written."""
    root = tmp_path_factory.mktemp("survivor")
    probe = root / "probe"
    probe.mkdir()
    (probe / "plan.json").write_text(json.dumps([
        {"action": "kill_process", "rank": 1, "after_samples": PER_RANK_EPOCH + PER_RANK_EPOCH // 2},
        {"action": "kill_in_save", "rank": 0, "after_saves": 1, "after": "kill_process"}]))
    cfg = rtm.TrainConfig(**MLP, dataset="_probe_data:digits", data_root=str(probe), max_failures=2,
                          name="survivor", storage_path=str(root / "results"))
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(raytrain_mgpu.loop, "train_worker", _probe_data.guarded_train_worker)
        result = rtm.fit(cfg, stream=printed)
    return result, probe, printed.getvalue()


def test_killed_workers_restart_from_the_last_checkpoint_and_finish_like_an_undisturbed_run(survivor):
    result, probe, printed = survivor
    assert (probe / "done-kill_process").exists() and (probe / "done-kill_in_save").exists()

    # Attempt 0 finished epoch 1; attempt 1 resumed from it and finished epoch 2; attempt 2
    # resumed from epoch 2 (epoch 3's checkpoint was never completed) and finished.
    assert [(h["epoch"], h["attempt"], h["step"]) for h in result.history] == [
        (1, 0, STEPS_PER_EPOCH), (2, 1, 2 * STEPS_PER_EPOCH), (3, 2, 3 * STEPS_PER_EPOCH)]
    assert pq.read_table(f"{result.path}/history.parquet").column("attempt").to_pylist() == [0, 1, 2]

    # Epoch 3 was trained twice, from the same checkpoint: identical results prove that
    # weights, optimizer, RNG and data order all came back exactly.
    epoch3 = [line.split() for line in printed.splitlines() if line.startswith("epoch   3/3")]
    assert len(epoch3) == 2 and epoch3[1][-2:] == ["[restart", "2]"]
    assert epoch3[0][2:10] == epoch3[1][2:10]  # step, loss, test_loss, test_acc and their values

    # What each worker process trained on: every epoch after a restart exactly once, the
    # in-flight one again from its start, in the same order.
    for rank in (0, 1):
        first, second, third = _served(probe, rank)
        assert PER_RANK_EPOCH < len(first) < 2 * PER_RANK_EPOCH     # killed in epoch 2
        assert len(second) == 2 * PER_RANK_EPOCH                      # epochs 2 and 3
        assert len(third) == PER_RANK_EPOCH                           # epoch 3 again
        assert second[:len(first) - PER_RANK_EPOCH] == first[PER_RANK_EPOCH:]
        assert third == second[PER_RANK_EPOCH:]


def test_a_kill_during_a_save_leaves_no_checkpoint_that_resume_would_pick(survivor):
    result, probe, _ = survivor
    half_written = Path((probe / "done-kill_in_save").read_text())
    assert json.loads((half_written / "meta.json").read_text())["epoch"] == 3
    assert (half_written / "model.pt").stat().st_size > 0
    with pytest.raises(Exception):  # cut in half: unreadable
        torch.load(half_written / "model.pt", weights_only=True)
    # Ray Train never registered it: not in its snapshot, not what a resume would load.
    snapshot = (Path(result.path) / "checkpoint_manager_snapshot.json").read_text()
    assert half_written.name not in snapshot
    latest_name = json.loads(snapshot)["latest_checkpoint_result"]["checkpoint_dir_name"]
    latest = Path(result.path) / latest_name
    assert latest.name != half_written.name
    assert json.loads((latest / "meta.json").read_text())["epoch"] == 3


def test_stalled_rank_is_named_within_the_collective_timeout(ray_session, storage, tmp_path, fault_hooks):
    # Rank 1 hangs in its data loader half-way through epoch 1; rank 0 waits in DDP's
    # gradient all-reduce. gloo alone would say "Timed out waiting 5000ms for recv" on rank 0.
    probe = _probe(tmp_path, action="stall", rank=1, after_samples=PER_RANK_EPOCH // 2)
    cfg = rtm.TrainConfig(**{**MLP, "epochs": 1}, dataset="_probe_data:digits", data_root=str(probe),
                          collective_timeout_s=5, name="stalled", storage_path=storage)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 5 s \(collective_timeout_s\) because rank 1 "
                                           r"\(node [\d.]+, pid \d+\) never joined it") as failure:
        rtm.fit(cfg)
    assert time.monotonic() - start < 120  # instead of the 30 minutes of the default timeout
    stalled = json.loads(next(probe.glob("worker-1-*.json")).read_text())
    assert f"pid {stalled['pid']})" in str(failure.value)
    assert "py-spy dump" in str(failure.value)


# ----------------------------------------------------------------------------- bad inputs


def _wired(module, name: str) -> bool:
    import inspect

    return name in inspect.getsource(module)


def test_ray_address_pointing_to_nothing_fails_in_seconds():
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no Ray cluster answers at '{dead}'.*unset RAY_ADDRESS"):
        preflight.probe_ray_address(dead)
    assert time.monotonic() - start < 5  # ray.init alone retries for over 5 minutes
    if not _wired(raytrain_mgpu.cluster, "probe_ray_address"):
        pytest.skip("cluster.connect does not call preflight.probe_ray_address yet: through fit "
                    "this would wait minutes")
    # What fit does first, in a fresh process (this one may already be connected to Ray).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_ADDRESS": dead,
           "RAY_AUTH_MODE": "disabled"}
    connect = "from raytrain_mgpu.cluster import connect; connect(None, verbose=False, local_has_gpu_check=False)"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", connect], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and f"ConnectionError: no Ray cluster answers at '{dead}'" in done.stderr
    assert time.monotonic() - start < 30


def test_resume_from_a_checkpoint_of_another_strategy_is_refused_and_keeps_the_run(survivor):
    ref, _, _ = survivor
    run = Path(ref.path)
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(ValueError, match=r"written by strategy='ddp', but this run has strategy='fsdp'.*"
                                         r"Use another `name`"):
        rtm.fit(ref.config.replace(strategy="fsdp", epochs=4))
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written, nothing deleted
    assert ref.load_model() is not None

    # The pipeline runner keeps checkpoints of its own and does not look at Ray Train's:
    # the run-folder check refuses for it, whichever runner wrote the checkpoints.
    pipeline = ref.config.replace(strategy="pipeline", num_stages=2)
    with pytest.raises(ValueError, match=r"written by strategy='ddp', but this run has strategy='pipeline'"):
        preflight.check_run_folder(pipeline)
    preflight.check_run_folder(ref.config.replace(epochs=4))  # the same run may go on
    if _wired(api, "check_run_folder"):
        with pytest.raises(ValueError, match=r"strategy='pipeline'"):
            rtm.fit(pipeline)
        assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.parametrize("damage", ["truncated", "not parquet"])
def test_damaged_dataset_file_fails_before_ray_starts(tmp_path, monkeypatch, damage):
    def no_ray(*args, **kwargs):
        raise AssertionError("fit connected to Ray before checking the data")

    monkeypatch.setattr(api, "connect", no_ray)
    paths = convert_to_parquet(rtm.TrainConfig(dataset="digits").data, str(tmp_path / "pq"))
    train = Path(next(p for p in paths if Path(p).parent.name == "train"))
    data = train.read_bytes()
    train.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"label,image\n1,0 0 0\n")
    with pytest.raises(ValueError, match=r"cannot be read .*Point data_root at intact Parquet files"):
        rtm.fit(rtm.TrainConfig(dataset="parquet", data_root=str(tmp_path / "pq"), storage_path=str(tmp_path)))
