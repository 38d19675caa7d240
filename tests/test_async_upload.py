"""Asynchronous checkpoint upload (``transports/ray_train/uploads.py``): training goes on while Ray
Train uploads, and every guarantee of the synchronous upload still holds.

One Ray run with step checkpoints every 5 steps and two faults (``_probe_data``'s plan), each followed by a
restart: rank 0, its uploads slowed, is SIGKILLed in the middle of its third upload (step 15's); in the
restarted group, rank 1 is SIGKILLed inside epoch 2, in step 35, once step 30's checkpoint is registered.
Checked over all of its processes: batches were trained during the uploads, uploads ran one at a time in
report order, the driver's ``on_checkpoint`` (told by Ray Train's controller) got persisted, loadable checkpoints
once each and in order, the first restart resumed from the last complete checkpoint (not the half-written one) and the second from the
step checkpoint inside the epoch, each restarted rank trained exactly the rest after it (a reclaimed node
cost at most K steps), and the run ended with the weights and the epoch rows of the undisturbed run (2 ddp
replicas emulated in the test's process, ``tests/_reference.py``: bit for bit what a 2-worker fit trains).
The run trains with a user's optimizer factory whose state the resume must restore exactly.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.transports.ray_train import uploads as ray_uploads
from raytrain_mgpu.driver.callbacks import Callback
from raytrain_mgpu.checkpointing.run_folder import RAY_TRAIN_SNAPSHOT, RunFolder

EVERY = 5  # checkpoint_every_n_steps
# The user's own optimizer (RMSprop with momentum, from tests/test_factories.py: fit ships its module):
# its state (running averages, momentum buffers) must come back on resume for the weights to be
# bit-equal (a plain SGD keeps none).
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="test_factories:rmsprop",
           optimizer_kwargs={"alpha": 0.9, "momentum": 0.5}, lr=0.01, seed=3,
           num_workers=2, use_gpu=False, epochs=2, checkpoint_every_n_steps=EVERY, num_checkpoints_to_keep=20)
STEPS_PER_EPOCH = 1438 // 64  # 22
SAVED_AT = [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]  # step checkpoints, and the epoch ends 22 and 44
RESUMED_AT = 30  # the second restart's: the last step checkpoint before rank 1's kill in step 35
UPLOAD_S = 0.5


# ---------------------------------------------------------------------------- no Ray


class _Sink:
    """The run's progress channel: what is put in, and a drain that hands it out ``late`` drains later."""

    def __init__(self, late: int = 0):
        self.events, self.late = [], late
        self.put = SimpleNamespace(remote=lambda kind, payload: self.events.append((kind, payload)))
        self.drain = SimpleNamespace(remote=self._drain)

    def _drain(self):
        self.late -= 1
        if self.late >= 0:
            return []
        events, self.events = self.events, []
        return events


def test_ray_trains_controller_announces_each_registered_checkpoint_by_its_storage_uri():
    from raytrain_mgpu.transports.ray_train.driver import run_config

    cfg = rtm.TrainConfig(storage_path="s3://bucket/runs", name="r")
    sink = _Sink()
    (announcer,) = run_config(cfg, sink).callbacks  # what run_train_workers hands Ray Train's controller
    announcer.after_report(None, [{"epoch": 1}], None)  # a report without a checkpoint: nothing to tell
    announcer.after_report(None, [{"epoch": 1}], SimpleNamespace(path="bucket/runs/r/checkpoint_epoch000001"))
    assert sink.events == [("checkpoint", "s3://bucket/runs/r/checkpoint_epoch000001")]
    local = run_config(rtm.TrainConfig(storage_path="/tmp/runs", name="r"), sink).callbacks[0]
    local.after_report(None, [{}], SimpleNamespace(path="/tmp/runs/r/checkpoint_epoch000002"))
    assert sink.events[-1] == ("checkpoint", "/tmp/runs/r/checkpoint_epoch000002")
    gone = SimpleNamespace(put=SimpleNamespace(remote=lambda *event: 1 / 0))  # the driver's mailbox is gone
    run_config(cfg, gone).callbacks[0].after_report(None, [{}], SimpleNamespace(path="bucket/runs/r/c"))  # no raise


def test_the_driver_waits_for_the_last_announcement_a_bounded_time(monkeypatch):
    """The controller's announcement is not ordered with the run's end: after the run, the driver drains until
    the last checkpoint's is delivered (on_checkpoint called), and gives up with a warning after the bound."""
    from raytrain_mgpu.driver import progress

    monkeypatch.setattr(progress.ray, "get", lambda events, timeout=None: events)
    seen = []
    sink = _Sink(late=3)  # delivered at the fourth drain
    pump = progress.SinkPump(sink, SimpleNamespace(checkpoint=seen.append), stall_timeout_s=0)
    sink.put.remote("checkpoint", "/runs/r/checkpoint_epoch000002")
    assert pump.wait_for_checkpoint("/runs/r/checkpoint_epoch000002", timeout_s=30)
    assert seen == ["/runs/r/checkpoint_epoch000002"]
    started = time.monotonic()
    assert not pump.wait_for_checkpoint("/runs/r/checkpoint_epoch000003", timeout_s=0.3)  # never announced
    assert time.monotonic() - started < 5


def test_the_driver_waits_for_no_announcement_of_a_checkpoint_an_earlier_fit_registered():
    """A resumed fit that registered no checkpoint of its own (every save skipped) ends with the one it resumed
    from: its announcement came in the earlier fit, and this one does not wait for it."""
    from raytrain_mgpu.transports.attempt import _registered_before

    assert _registered_before("/runs/r/checkpoint_epoch000003", {"resumed_from": "/runs/r/checkpoint_epoch000003/"})
    assert not _registered_before("/runs/r/checkpoint_epoch000004", {"resumed_from": "s3://b/r/checkpoint_epoch000003"})
    assert not _registered_before("/runs/r/checkpoint_epoch000001", {"resumed_from": None})  # a new run
    assert not _registered_before("/runs/r/checkpoint_epoch000001", None)  # no start-up event


def test_a_save_waits_for_the_previous_upload_then_for_the_controller_to_take_its_report(monkeypatch):
    """One upload in flight at most, and a failure after the wait resumes from the previous checkpoint."""
    latest, collected = {"path": None}, []
    monkeypatch.setattr(ray.train, "get_checkpoint",
                        lambda: None if latest["path"] is None else SimpleNamespace(path=latest["path"]))
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: collected.append("collected"))
    ray_uploads.wait_for_previous(None)  # a rank's first save: nothing to wait for
    waiting = threading.Thread(target=ray_uploads.wait_for_previous, args=("checkpoint_b",), daemon=True)
    waiting.start()
    waiting.join(timeout=0.3)
    latest["path"] = "/storage/run/checkpoint_a/"  # an older one persisted: still waiting
    waiting.join(timeout=0.3)
    assert waiting.is_alive() and collected == ["collected"]
    latest["path"] = "/storage/run/checkpoint_b/"
    waiting.join(timeout=30)
    assert not waiting.is_alive() and collected == ["collected", "collected"]


def test_the_last_save_of_a_run_uploads_synchronously(monkeypatch, storage, gloo_group):
    """Nothing is left to overlap with: the train function must not return before its last checkpoint is
    registered. Any other save is asynchronous. The engine's saves of epochs 1 and 2 of 2 on ranks 0 and 1,
    through the Ray Train transport (Ray Train's calls faked, tests/test_wiring.py)."""
    from test_wiring import ray_train_engine

    from raytrain_mgpu.engine.run_state import RunState
    from raytrain_mgpu.transports.ray_train import store as ray_store

    modes, latest = [], {}

    def report(metrics, checkpoint=None, **upload):  # Ray Train, its uploads done at once
        modes.append(None if checkpoint is None else upload["checkpoint_upload_mode"])
        if checkpoint is not None:
            latest["checkpoint"] = SimpleNamespace(path=f"{storage}/run/{upload['checkpoint_dir_name']}")

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: None)
    monkeypatch.setattr(ray_store, "wait_until_report_collected", lambda: None)
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: None))
    for rank in (0, 1):
        for epoch in (1, 2):
            state = RunState(epoch=epoch, step=10 * epoch, history=[{"epoch": e} for e in range(1, epoch + 1)])
            monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)  # set up as a new run's
            engine = ray_train_engine(dict(epochs=2), rank, 2, state, storage)
            monkeypatch.setattr(ray.train, "get_checkpoint", lambda: latest.get("checkpoint"))
            engine.checkpoints.saver.save({"epoch": epoch})
    assert modes == [ray.train.CheckpointUploadMode.ASYNC, ray.train.CheckpointUploadMode.SYNC, None, None]


# ---------------------------------------------------------------------------- Ray


class _Announced(Callback):
    """Each on_checkpoint: the path, and its step read back from storage at that moment."""

    def __init__(self):
        self.seen = []

    def on_checkpoint(self, path):
        ckpt_format.load_model_state(path)  # complete when announced: its model loads
        self.seen.append((path, ckpt_format.read_meta(path)["step"]))


def _fit(tmp_path: Path, name: str, plan: list):
    probe = tmp_path / f"probe-{name}"
    probe.mkdir()
    (probe / "plan.json").write_text(json.dumps(plan))
    announced = _Announced()
    cfg = rtm.TrainConfig(**MLP, dataset="_probe_data:digits", data_root=str(probe), max_failures=2, name=name,
                          storage_path=str(tmp_path / "results"), callbacks=[announced])
    return rtm.fit(cfg), probe, announced


def _uploads(probe: Path) -> list:
    return [json.loads(line) for line in (probe / "uploads.jsonl").read_text().splitlines()]


def _batches(probe: Path) -> list:
    """Per rank-0 process (in start order): the times it read its training batches."""
    files = sorted(probe.glob("batches-*.txt"), key=lambda p: float(p.read_text().split()[0]))
    return [[float(t) for t in p.read_text().split()] for p in files]


def _served(probe: Path, rank: int) -> list:
    """Per worker process of ``rank`` (in start order): the training indices it served."""
    infos = sorted((json.loads(p.read_text()) for p in probe.glob(f"worker-{rank}-*.json")),
                   key=lambda info: info["started"])
    return [[int(i) for i in (probe / f"indices-{rank}-{info['pid']}.txt").read_text().split()] for info in infos]


@pytest.mark.slow  # one fit with two restarts and 10 half-second uploads: 40-80 s on 2 cores
def test_a_kill_mid_upload_and_a_rank_killed_mid_epoch_resume_from_the_last_complete_checkpoints_bit_equal(
        ray_session, tmp_path):
    from _reference import train_replicas

    from raytrain_mgpu.checkpointing.contents import checkpoint_name

    run = tmp_path / "results" / "two-faults"
    result, probe, announced = _fit(tmp_path, "two-faults", [
        {"action": "slow_uploads", "rank": 0, "upload_s": UPLOAD_S, "kill_in_upload": 3},
        # in the group restarted from step 10: rank 1 in step 35 (its process's 25th batch), once Ray Train has
        # registered step 30's checkpoint (rank 0 reports it after its upload; a rank lost before the controller
        # registers it resumes from the checkpoint before, by design: docs/reliability.md)
        {"action": "kill_process", "rank": 1, "after": "kill_in_upload", "after_samples": (34 - SAVED_AT[1]) * 32 + 5,
         "after_registered_step": RESUMED_AT, "run": str(run)}])
    assert (probe / "done-kill_in_upload").exists() and (probe / "done-kill_process").exists()
    # The third upload (step 15's checkpoint) was cut in half; checkpoint names are the step's, so the save
    # redone after the restart uploaded into the same folder, whole.
    half = Path((probe / "done-kill_in_upload").read_text())
    assert half.name == checkpoint_name(0, SAVED_AT[2])
    snapshot = json.loads((Path(result.path) / RAY_TRAIN_SNAPSHOT).read_text())
    assert json.loads((half / "meta.json").read_text())["step"] == SAVED_AT[2]
    torch.load(half / "model.pt", weights_only=True)  # whole again: the redone save's
    assert [(h["epoch"], h["step"], h["attempt"]) for h in result.history] == [
        (1, STEPS_PER_EPOCH, 1), (2, 2 * STEPS_PER_EPOCH, 2)]

    # The first restart began after the last complete upload (step 10), not from the half-written one; the
    # second at step 30, inside epoch 2: rank 0's last process read steps 31-44 only.
    killed_in_upload, killed_rank_1, last = _batches(probe)
    assert len(last) == 2 * STEPS_PER_EPOCH - RESUMED_AT
    # What rank 1 trained on: each restarted process exactly the rest after its checkpoint, in the same order.
    first, second, third = _served(probe, 1)
    assert len(first) >= SAVED_AT[2] * 32  # it had trained step 15 when rank 0 was killed uploading its checkpoint
    assert second[:len(first) - SAVED_AT[1] * 32] == first[SAVED_AT[1] * 32:]
    redone = (RESUMED_AT - SAVED_AT[1]) * 32  # rank 1's samples of steps 11-30 in its second process
    assert len(third) == (2 * STEPS_PER_EPOCH - RESUMED_AT) * 32
    assert third[:len(second) - redone] == second[redone:]  # the same order: redone steps only
    lost_steps = math.ceil((len(second) - redone) / 32)
    assert 0 < lost_steps <= EVERY, lost_steps

    # Every complete upload, over all processes: steps 5 and 10, then after each restart the rest; one at a time,
    # in report order (names sort by epoch and step).
    uploads = _uploads(probe)
    names = [Path(u["dest"]).name for u in uploads]
    assert len(uploads) == len(SAVED_AT) and names == sorted(names), names
    assert all(a["end"] <= b["start"] for a, b in zip(uploads, uploads[1:]))
    # Rank 0 trained while its asynchronous uploads ran: all but the last save's (synchronous), and those a
    # restart cut short of batches (the last of the group rank 1's kill stopped).
    batches = killed_in_upload + killed_rank_1 + last
    overlapped = [u for u in uploads[:-1] if any(u["start"] < t < u["end"] for t in batches)]
    assert len(overlapped) >= len(uploads) - 3, (len(overlapped), len(uploads))
    assert not any(uploads[-1]["start"] < t < uploads[-1]["end"] for t in batches)

    # The driver heard of checkpoints once each, in order, each complete when announced; those after the
    # last restart all of them (a checkpoint registered just before a kill may go unannounced).
    steps = [step for _, step in announced.seen]
    assert steps == sorted(set(steps)) and set(steps) <= set(SAVED_AT) and steps[-3:] == SAVED_AT[-3:], steps
    assert [Path(path).name for path, _ in announced.seen] == [names[SAVED_AT.index(step)] for step in steps]
    assert announced.seen[-1][0] == result.checkpoint_path

    # What a resume loads: Ray Train's latest, the newest complete checkpoint, which is the result.
    newest = RunFolder(result.path).newest_checkpoint()
    assert newest.uri == result.checkpoint_path and newest.name == names[-1] and newest.meta["step"] == SAVED_AT[-1]
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == names[-1]

    # The weights and the epoch rows are the undisturbed run's (2 ddp replicas emulated in this process), bit
    # for bit: a resume that rebuilt the user's RMSprop without its state would diverge from the first step on,
    # one that lost the resumed epoch's sums would show other rows.
    want, undisturbed_history = train_replicas(MLP)
    with ckpt_format.local_checkpoint(result.checkpoint_path) as a:
        got = ckpt_format.load_model_state(a)
        saved = ckpt_format.load_train_state(a)["optimizer"]
    assert {"square_avg", "momentum_buffer"} <= set(saved["state"][0])  # RMSprop's own state, checkpointed
    assert saved["param_groups"][0]["alpha"] == 0.9
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert len(undisturbed_history) == len(result.history)
    for got_row, want_row in zip(result.history, undisturbed_history):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert math.isclose(got_row[key], want_row[key], rel_tol=1e-9), key
