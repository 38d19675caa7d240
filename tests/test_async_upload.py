"""Asynchronous checkpoint upload (``transports/ray_uploads.py``): training goes on while Ray
Train uploads, and every guarantee of the synchronous upload still holds.

One Ray run, the same run as test_step_checkpoints (step checkpoints every 5 steps) with rank
0's uploads slowed by ``_upload_probe``, whose rank 0 is SIGKILLed in the middle of its third
upload. Checked over both of its processes: batches were trained during the uploads, uploads ran
one at a time in report order, the driver's ``on_checkpoint`` got each persisted, loadable
checkpoint once and in order, the resume point is the newest complete checkpoint, and the run
resumed from the last complete one and ended with the undisturbed run's weights (2 ddp replicas
emulated in the test's process, ``tests/_reference.py``: bit for bit what a 2-worker fit trains).
The run trains with a user's optimizer factory whose state the resume must restore exactly.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.transports import ray_uploads
from raytrain_mgpu.runtime.callbacks import Callback
from raytrain_mgpu.runtime.run_folder import RAY_TRAIN_SNAPSHOT, RunFolder

# The user's own optimizer (RMSprop with momentum, from tests/test_factories.py: fit ships its module):
# its state (running averages, momentum buffers) must come back on resume for the weights to be
# bit-equal (a plain SGD keeps none).
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="test_factories:rmsprop",
           optimizer_kwargs={"alpha": 0.9, "momentum": 0.5}, lr=0.01, seed=3,
           num_workers=2, epochs=2, checkpoint_every_n_steps=5, num_checkpoints_to_keep=20)
STEPS_PER_EPOCH = 1438 // 64  # 22
SAVED_AT = [5, 10, 15, 20, 22, 25, 30, 35, 40, 44]  # step checkpoints, and the epoch ends 22 and 44
UPLOAD_S = 0.5


# ---------------------------------------------------------------------------- no Ray


class _Reporter:
    sink = "the driver's"  # a WorkerReporter that reaches a driver (rank 0's)

    def __init__(self):
        self.paths = []

    def checkpoint(self, path):
        self.paths.append(path)


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray Train's latest checkpoint as a settable path; reports collected at once. Returns
    (latest, uploads, reporter, folder)."""
    latest = {"path": None}
    monkeypatch.setattr(ray.train, "get_checkpoint",
                        lambda: None if latest["path"] is None else SimpleNamespace(path=latest["path"]))
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: None)
    return latest, ray_uploads.Uploads(owner=None), _Reporter(), RunFolder("/storage/run")


def test_announcements_follow_the_uploads_in_order_even_when_ray_registers_two_at_once(fake_ray):
    latest, uploads, reporter, folder = fake_ray
    for name in ("checkpoint_a", "checkpoint_b", "checkpoint_c"):
        uploads.announce_when_persisted(uploads.add(name), folder, reporter)
    assert not uploads.wait_persisted(timeout_s=0.1)  # nothing uploaded yet: a new save would wait
    time.sleep(0.1)
    assert reporter.paths == []
    latest["path"] = "/storage/run/checkpoint_a"
    assert uploads.wait_persisted(0, timeout_s=5) and not uploads.wait_persisted(timeout_s=0.1)
    latest["path"] = "/storage/run/checkpoint_c"  # b and c registered between two polls
    done = threading.Thread(target=uploads.flush)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive()
    assert reporter.paths == ["/storage/run/checkpoint_a", "/storage/run/checkpoint_b", "/storage/run/checkpoint_c"]


def test_an_upload_the_announcer_never_saw_as_latest_is_announced_once_a_later_synchronous_one_is(fake_ray):
    """The race a CI run hung in: a slow announcer looks only after the run's last (synchronous)
    save has replaced the latest checkpoint; it must count as persisted, not wait for ever."""
    latest, uploads, reporter, folder = fake_ray
    uploads.announce_when_persisted(uploads.add("checkpoint_async"), folder, reporter)
    uploads.add("checkpoint_last")  # the synchronous save, reported before the announcer looked again
    latest["path"] = "/storage/run/checkpoint_last"
    assert uploads.flush(timeout_s=10)
    assert reporter.paths == ["/storage/run/checkpoint_async"]


def test_a_stuck_announcement_delays_the_end_of_a_run_by_the_flush_timeout_only(monkeypatch):
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)  # never persisted
    uploads = ray_uploads.Uploads(owner=None)
    uploads.announce_when_persisted(uploads.add("checkpoint_a"), RunFolder("/storage/run"), _Reporter())
    started = time.monotonic()
    assert not uploads.flush(timeout_s=0.3)
    assert time.monotonic() - started < 5


def test_the_last_save_of_a_run_uploads_synchronously(monkeypatch, storage, gloo_group):
    """Nothing is left to overlap with: the train function must not return with an upload
    unannounced. Any other save is asynchronous. The engine's saves of epochs 1 and 2 of 2 on ranks 0 and 1,
    through the Ray Train transport (Ray Train's calls faked, tests/test_wiring.py)."""
    from test_wiring import ray_train_engine

    from raytrain_mgpu.runtime.run_state import RunState
    from raytrain_mgpu.transports import ray_train

    modes, latest = [], {}

    def report(metrics, checkpoint=None, **upload):  # Ray Train, its uploads done at once
        modes.append(None if checkpoint is None else upload["checkpoint_upload_mode"])
        if checkpoint is not None:
            latest["checkpoint"] = SimpleNamespace(path=f"{storage}/run/{upload['checkpoint_dir_name']}")

    monkeypatch.setattr(ray.train, "report", report)
    monkeypatch.setattr(ray_uploads, "wait_until_report_collected", lambda: None)
    monkeypatch.setattr(ray_train, "wait_until_report_collected", lambda: None)
    for rank in (0, 1):
        for epoch in (1, 2):
            state = RunState(epoch=epoch, step=10 * epoch, history=[{"epoch": e} for e in range(1, epoch + 1)])
            monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)  # set up as a new run's
            engine = ray_train_engine(dict(epochs=2), rank, 2, state, storage)
            monkeypatch.setattr(ray.train, "get_checkpoint", lambda: latest.get("checkpoint"))
            engine.saver.save({"epoch": epoch})
    assert modes == [ray.train.CheckpointUploadMode.ASYNC, ray.train.CheckpointUploadMode.SYNC, None, None]


# ---------------------------------------------------------------------------- Ray


class _Announced(Callback):
    """Each on_checkpoint: the path, and its step read back from storage at that moment."""

    def __init__(self):
        self.seen = []

    def on_checkpoint(self, path):
        ckpt_format.load_model_state(path)  # complete when announced: its model loads
        self.seen.append((path, ckpt_format.read_meta(path)["step"]))


def _fit(tmp_path: Path, name: str, **plan):
    probe = tmp_path / f"probe-{name}"
    probe.mkdir()
    (probe / "plan.json").write_text(json.dumps({"upload_s": UPLOAD_S, **plan}))
    announced = _Announced()
    cfg = rtm.TrainConfig(**MLP, dataset="_upload_probe:digits", data_root=str(probe), max_failures=1, name=name,
                          storage_path=str(tmp_path / "results"), callbacks=[announced])
    return rtm.fit(cfg), probe, announced


def _uploads(probe: Path) -> list:
    return [json.loads(line) for line in (probe / "uploads.jsonl").read_text().splitlines()]


def _batches(probe: Path) -> list:
    """Per rank-0 process (in start order): the times it read its training batches."""
    files = sorted(probe.glob("batches-*.txt"), key=lambda p: float(p.read_text().split()[0]))
    return [[float(t) for t in p.read_text().split()] for p in files]


@pytest.mark.slow  # one fit with a restart and 10 half-second uploads: 40-80 s on 2 cores
def test_a_kill_in_the_middle_of_an_upload_resumes_from_the_last_complete_checkpoint_bit_equal(
        ray_session, tmp_path):
    from _reference import train_replicas

    from raytrain_mgpu.runtime.engine_checkpoint import checkpoint_name

    result, probe, announced = _fit(tmp_path, "killed-in-upload", kill_in_upload=3)
    # The third upload (step 15's checkpoint) was cut in half; checkpoint names are the step's, so the save
    # redone after the restart uploaded into the same folder, whole.
    half = Path((probe / "killed_in_upload").read_text())
    assert half.name == checkpoint_name(0, SAVED_AT[2])
    snapshot = json.loads((Path(result.path) / RAY_TRAIN_SNAPSHOT).read_text())

    # The restart began after the last complete upload (step 10), not from the half-written one: rank 0 read
    # steps 11-44 again.
    first, second = _batches(probe)
    assert len(second) == 2 * STEPS_PER_EPOCH - SAVED_AT[1]
    assert json.loads((half / "meta.json").read_text())["step"] == SAVED_AT[2]
    torch.load(half / "model.pt", weights_only=True)  # whole again: the redone save's
    assert [(h["epoch"], h["attempt"]) for h in result.history] == [(1, 1), (2, 1)]

    # Every complete upload, over both processes: steps 5 and 10, then after the restart the rest;
    # one at a time, in report order (names sort by epoch and step).
    uploads = _uploads(probe)
    names = [Path(u["dest"]).name for u in uploads]
    assert len(uploads) == len(SAVED_AT) and names == sorted(names)
    assert all(a["end"] <= b["start"] for a, b in zip(uploads, uploads[1:]))
    # Rank 0 trained while its asynchronous uploads ran (all but the last save's, synchronous).
    batches = first + second
    overlapped = [u for u in uploads[:-1] if any(u["start"] < t < u["end"] for t in batches)]
    assert len(overlapped) >= len(uploads) - 2, (len(overlapped), len(uploads))
    assert not any(uploads[-1]["start"] < t < uploads[-1]["end"] for t in batches)

    # The driver heard of each checkpoint once, in order, each complete when announced: those of
    # steps 5 and 10 (or what of them it heard before the kill), then, after the restart, the rest.
    steps = [step for _, step in announced.seen]
    assert steps[-len(SAVED_AT) + 2:] == SAVED_AT[2:] and steps[:-len(SAVED_AT) + 2] in ([], [5], [5, 10])
    assert [Path(path).name for path, _ in announced.seen] == [names[SAVED_AT.index(step)] for step in steps]
    assert announced.seen[-1][0] == result.checkpoint_path

    # What a resume loads: Ray Train's latest, the newest complete checkpoint, which is the result.
    newest = RunFolder(result.path).newest_checkpoint()
    assert newest.uri == result.checkpoint_path and newest.name == names[-1] and newest.meta["step"] == SAVED_AT[-1]
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == names[-1]

    # The weights are the undisturbed run's (2 ddp replicas emulated in this process), bit for bit: a
    # resume that rebuilt the user's RMSprop without its state would diverge from the first step on.
    want, _ = train_replicas(MLP)
    with ckpt_format.local_checkpoint(result.checkpoint_path) as a:
        got = ckpt_format.load_model_state(a)
        saved = ckpt_format.load_train_state(a)["optimizer"]
    assert {"square_avg", "momentum_buffer"} <= set(saved["state"][0])  # RMSprop's own state, checkpointed
    assert saved["param_groups"][0]["alpha"] == 0.9
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
