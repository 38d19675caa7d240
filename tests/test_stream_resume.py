"""The ``parquet`` stream's planned order (``engine/stream.py``, ``data/parquet_stream.py``): exact and resumable.

Without Ray: the planned order is ``DistributedSampler``'s for a split of one window, keeps whole row groups
together beyond it, and gives every optimizer step the same samples at any worker count; a resumed epoch's
share starts at its step. With the shared Ray (a local Ray Data execution in this process): the stream gives
exactly the loader path's samples, transformed and held out alike, in the sampler's order. Through Ray Train
(the few runs the guarantees need): a stream killed after step 35 resumes at its step-30 checkpoint and ends
with the loader path's weights (a split of one window: the loader path's order), so with the uninterrupted run's;
2 workers end with 1 worker's; one run resumes twice, at a time-based checkpoint and at a preemption notice's.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler
from raytrain_mgpu.engine.stream import PlannedSampler, PlannedStream, planned_order

STEPS_PER_EPOCH = 1294 // 64  # digits' 1,438 training rows less val_fraction=0.1's 144, global batch 64: 20


# ----------------------------------------------------------------------------- the order, without Ray


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_split_of_one_window_streams_in_the_loader_paths_order_and_resumes_at_its_step(replicas):
    data = list(range(1000))
    for rank in range(replicas):
        planned = PlannedSampler(data, [0, 300, 700], num_replicas=replicas, rank=rank, seed=5)
        loader = ResumableSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=5, drop_last=True)
        for sampler in (planned, loader):
            sampler.resume_at(epoch=2, skip=24)
        for epoch in (1, 2, 3):
            planned.set_epoch(epoch)
            loader.set_epoch(epoch)
            assert list(planned) == list(loader), (rank, epoch)
            assert len(planned) == len(list(planned)) == len(data) // replicas - (24 if epoch == 2 else 0)


def test_a_larger_split_keeps_row_groups_together_and_every_step_its_samples_at_any_worker_count():
    starts = list(range(0, 1000, 50))  # 20 row groups of 50 samples
    orders = [planned_order(1000, 7, epoch, starts, window_rows=200) for epoch in (0, 1)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(1000))  # every sample once an epoch
        for window in order.reshape(5, 200):  # 4 whole row groups a window
            assert len({int(i) // 50 for i in window}) == 4
    assert not torch.equal(orders[0], orders[1]) and torch.equal(orders[0], planned_order(1000, 7, 0, starts, 200))
    assert not torch.equal(orders[0], torch.randperm(1000, generator=torch.Generator().manual_seed(7)))
    batch, steps = 60, 1000 // 60

    def step_samples(replicas: int) -> list:
        shares = []
        for rank in range(replicas):
            sampler = PlannedSampler(list(range(1000)), starts, window_rows=200, num_replicas=replicas, rank=rank,
                                     seed=7)
            shares.append(list(sampler))
        per_rank = batch // replicas
        return [sorted(i for share in shares for i in share[s * per_rank:(s + 1) * per_rank]) for s in range(steps)]

    assert step_samples(1) == step_samples(2) == step_samples(3)  # step s: positions [s*B, (s+1)*B), any R
    resumed = PlannedSampler(list(range(1000)), starts, window_rows=200, num_replicas=2, rank=1, seed=7)
    resumed.resume_at(0, 7 * batch // 2)
    whole = PlannedSampler(list(range(1000)), starts, window_rows=200, num_replicas=2, rank=1, seed=7)
    assert list(resumed) == list(whole)[7 * batch // 2:]  # a resume after step 7 continues the share there


class FakeSource:
    """What the stream asks of its source: the indices and the epoch, once an iteration."""

    def __init__(self):
        self.asked = []

    def batches(self, indices, epoch, micro_batch):
        self.asked.append((list(indices), epoch))
        for start in range(0, len(indices) - micro_batch + 1, micro_batch):
            rows = torch.tensor(indices[start:start + micro_batch])
            yield rows, rows


def test_the_stream_asks_for_the_steps_of_the_epoch_only_and_a_resumed_epoch_for_the_rest():
    sampler = PlannedSampler(list(range(100)), None, num_replicas=2, rank=0, seed=1)
    source = FakeSource()
    stream = PlannedStream(sampler, micro_batch=8, num_batches=5, source=source)  # 5 of the share's 6 batches
    sampler.set_epoch(3)
    batches = [x for x, _ in stream]
    assert len(stream) == len(batches) == 5 and source.asked[-1] == (list(sampler)[:40], 3)
    sampler.resume_at(3, 16)
    assert len(stream) == 3 and [x.tolist() for x, _ in stream] == [b.tolist() for b in batches[2:]]
    assert source.asked[-1] == (list(sampler)[:24], 3)


# ----------------------------------------------------------------------------- the samples, on the shared Ray


def _png_parquet(root: Path) -> str:
    from test_ray_ingest import write_png_parquet

    folder = root / "png"
    if not folder.exists():
        write_png_parquet(folder)
    return str(folder)


@pytest.mark.ray
def test_the_stream_gives_the_loader_paths_samples_in_the_planned_order_transformed_and_held_out_alike(
        ray_session, tmp_path, monkeypatch):
    from raytrain_mgpu.data import parquet_stream

    cfg = rtm.TrainConfig(dataset="parquet", data_root=_png_parquet(tmp_path), ingest="ray_data",
                          train_transform="random_crop_flip", val_fraction=0.1, seed=4)
    train = build_datasets(cfg.data).train  # the loader path's: TransformedDataset(Subset(ParquetImageDataset))
    source = parquet_stream.stream_source(train)
    # Several read tasks and windows of whole row groups (a split of 1,294 is one window by default).
    monkeypatch.setattr(parquet_stream, "READ_ROWS", 100)
    sampler = PlannedSampler(train, source.run_starts(), window_rows=300, num_replicas=2, rank=1, seed=cfg.seed)
    sampler.set_epoch(2)
    sampler.resume_at(2, 64)
    stream = PlannedStream(sampler, micro_batch=32, num_batches=STEPS_PER_EPOCH, source=source)  # 2 x 32 a step
    got = list(stream)
    indices = list(sampler)[:len(got) * 32]
    assert len(got) == STEPS_PER_EPOCH - 2 and len(indices) == len(set(indices))
    train.set_epoch(2)  # the transform's seed: (seed, epoch, index), as the loader path draws it
    want = [train[i] for i in indices]
    assert torch.equal(torch.cat([y for _, y in got]), torch.tensor([y for _, y in want]))
    assert torch.equal(torch.cat([x for x, _ in got]), torch.stack([x for x, _ in want]))  # bit for bit
    plain = torch.stack([train.dataset[i][0] for i in indices[:32]])
    assert not torch.equal(got[0][0], plain)  # the crops and flips did apply


# ----------------------------------------------------------------------------- through Ray Train


def wait_until_registered(run: Path, step: int, timeout_s: float = 60) -> None:
    """Until Ray Train has registered a checkpoint of ``step`` (or later) in ``run`` (its latest: an upload still under
    way when its rank dies is lost by design: docs/reliability.md), at most ``timeout_s``."""
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            snapshot = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
            name = snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
            if json.loads((run / name / "meta.json").read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or being replaced
            pass
        time.sleep(0.1)


class _DieOnce(nn.Module):
    """Inside a Ray actor, records each training forward (``forwards-<pid>``) and SIGKILLs its process on the
    ``after_forwards``-th, once per probe folder (``died``): a worker lost in the middle of a step. It waits first
    (up to 60 s) until Ray Train has registered a checkpoint of step ``registered`` in ``run`` (an upload still
    under way when its rank dies is lost by design: docs/reliability.md)."""

    def __init__(self, probe: str, after_forwards: int, run: str = "", registered: int = 0):
        super().__init__()
        self.probe, self.after_forwards, self.forwards = Path(probe), after_forwards, 0
        self.run, self.registered = Path(run), registered

    def forward(self, x):
        import ray

        if self.training and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            self.forwards += 1
            with open(self.probe / f"forwards-{os.getpid()}", "a") as record:
                record.write(f"{time.time()}\n")
            if self.forwards == self.after_forwards and not (self.probe / "died").exists():
                wait_until_registered(self.run, self.registered)
                (self.probe / "died").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return x


def mlp_dying_once(input_shape, num_classes, probe: str, after_forwards: int, **wait) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes),
                         _DieOnce(probe, after_forwards, **wait))


def _stream_fields(data_root: str, probe: Path, **overrides) -> dict:
    """``random_crop_flip`` for 8x8 digits, as a callable that records where it ran (``probe/transform``)."""
    from test_ray_ingest import RecordingTransform
    from torchvision.transforms import v2

    (probe / "transform").mkdir(parents=True, exist_ok=True)
    crop_flip = RecordingTransform(str(probe / "transform"),
                                   v2.Compose([v2.RandomCrop((8, 8), padding=4), v2.RandomHorizontalFlip()]))
    return {**dict(model=mlp_dying_once, model_kwargs={"probe": str(probe), "after_forwards": 10**9},
                   dataset="parquet", data_root=data_root, train_transform=crop_flip, val_fraction=0.1, batch_size=64,
                   optimizer="sgd", lr=0.1, momentum=0.9, seed=3, epochs=2, num_workers=1, use_gpu=False), **overrides}


def applied_in(probe: Path) -> set:
    from test_ray_ingest import applied_in

    return applied_in(probe)


def _forwards(probe: Path) -> list:
    """Training forwards of each worker process, in the order the processes started."""
    records = sorted(probe.glob("forwards-*"), key=lambda path: path.stat().st_mtime)
    return [len(path.read_text().split()) for path in records]


def _assert_weights(result, want: dict, rtol: float) -> None:
    got = result.load_model().state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=rtol * float(value.abs().max()), msg=key)


@pytest.mark.ray
@pytest.mark.slow
def test_a_stream_killed_after_step_35_resumes_at_its_step_30_checkpoint_and_ends_like_the_loader_path(
        ray_session, tmp_path, storage):
    """PNG Parquet, 1 worker, crops and flips, a validation split, step checkpoints every 10 steps: the worker is
    SIGKILLed in step 36 and ``max_failures=1`` restarts it from the step-30 checkpoint; it trains steps 31-40
    only and ends with the weights of the loader path's uninterrupted run (one window: the same order)."""
    from _reference import train_one_worker

    root, probe = _png_parquet(tmp_path), tmp_path / "probe"
    want, _, _, loaded = train_one_worker(_stream_fields(root, tmp_path / "unused", ingest="loader"))
    fields = _stream_fields(root, probe, ingest="ray_data", checkpoint_every_n_steps=10, max_failures=1)
    # the first forward is the FLOPs count's, on a copy of the model (engine/observe.py); the 36th its own is step 36's
    fields["model_kwargs"].update(after_forwards=36, run=f"{storage}/stream-killed", registered=30)
    result = rtm.fit(rtm.TrainConfig(**fields, name="stream-killed", storage_path=storage))
    assert applied_in(probe / "transform") == {"task"}  # Ray Data's tasks cropped and flipped, the worker none
    assert (probe / "died").exists() and _forwards(probe) == [1 + 36, 1 + 2 * STEPS_PER_EPOCH - 30]
    _assert_weights(result, want, rtol=1e-6)
    assert [(row["step"], row["attempt"]) for row in result.history] == [(20, 0), (40, 1)]
    for row, reference in zip(result.history, loaded):  # the resumed epoch's sums continued from the checkpoint
        for key in ("train_loss", "val_loss", "test_accuracy"):
            assert row[key] == pytest.approx(reference[key], rel=1e-6), key


@pytest.mark.ray
@pytest.mark.slow
def test_two_workers_killed_mid_epoch_resume_on_one_worker_from_a_second_driver_with_one_workers_weights(
        ray_session, tmp_path, storage):
    """2 workers stream and take step checkpoints; one is SIGKILLed in step 36 with no retry left, so ``fit``
    fails. The same run started again from another driver, on 1 worker (2 -> 1 mid-epoch: the micro-batch
    doubles, the global batch stays), resumes at the step-30 checkpoint, trains steps 31-40 only and ends with
    1 worker's weights (the loader path's, uninterrupted) up to the order of the sums."""
    from _reference import train_one_worker

    root, probe = _png_parquet(tmp_path), tmp_path / "probe"
    want, _, _, _ = train_one_worker(_stream_fields(root, tmp_path / "unused", ingest="loader"))
    fields = _stream_fields(root, probe, ingest="ray_data", checkpoint_every_n_steps=10, num_workers=2)
    fields["model_kwargs"].update(after_forwards=36, run=f"{storage}/stream-two", registered=30)
    # No retry left: the run fails, its checkpoints kept. The error is the killed worker's death or the survivor's
    # lost peer (gloo's "Connection reset by peer"), whichever Ray Train reports first: the note is in both.
    with pytest.raises(Exception, match=r"training run 'stream-two' failed\. Checkpoints written so far are kept"):
        rtm.fit(rtm.TrainConfig(**fields, name="stream-two", storage_path=storage))
    assert (probe / "died").exists()
    before = set(probe.glob("forwards-*"))
    result = rtm.fit(rtm.TrainConfig(**{**fields, "num_workers": 1}, name="stream-two", storage_path=storage))
    assert applied_in(probe / "transform") == {"task"}  # Ray Data's tasks cropped and flipped, the workers none
    (resumed,) = set(probe.glob("forwards-*")) - before
    assert len(resumed.read_text().split()) == 1 + 2 * STEPS_PER_EPOCH - 30  # the FLOPs count's, then steps 31-40
    assert [row["step"] for row in result.history] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    _assert_weights(result, want, rtol=1e-4)


class _Disturbances(nn.Module):
    """Inside a Ray Train worker, records each training forward (``forwards-<pid>``, the FLOPs count's first) and
    acts once where ``script`` says: ``[(turn, forward, action, arg), ...]``, ``turn`` the worker process's place
    among the run's (0 for the first attempt's: one worker at a time), ``forward`` its count of forwards. Actions:
    ``("sleep", s)``; ``("kill", step)``: SIGKILL once Ray Train registered a checkpoint of ``step``;
    ``("notice", None)``: this worker's preemption info, as Ray Train's watcher hands it to the workers of a node
    drained for preemption (``mark_preempt``), with a deadline 10 minutes away; ``("reclaim", step)``: once a
    checkpoint of ``step`` is registered, the same notice with a deadline of now (a second drain, as the cloud
    reclaims the node), then wait for Ray Train to tear the worker down."""

    def __init__(self, probe: str, run: str, script: list):
        super().__init__()
        self.probe, self.run = Path(probe), run
        self.script = {(turn, forward): (action, arg) for turn, forward, action, arg in script}

    def forward(self, x):
        import ray

        if self.training and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            mine = self.probe / f"forwards-{os.getpid()}"
            turn = sum(1 for path in self.probe.glob("forwards-*") if path != mine)
            with open(mine, "a") as record:
                record.write(f"{time.time()}\n")
            action = self.script.get((turn, len(mine.read_text().split())))
            if action is not None:
                self._act(*action)
        return x

    def _act(self, action: str, arg) -> None:
        import ray
        from ray.train.v2._internal.execution.context import get_train_context
        from ray.train.v2.api.preemption import PreemptionInfo

        if action == "sleep":
            time.sleep(arg)
            return
        if action in ("kill", "reclaim"):
            wait_until_registered(Path(self.run), arg)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        node = ray.get_runtime_context().get_node_id()
        deadline_ms = int(time.time() * 1000) + (600_000 if action == "notice" else 0)
        get_train_context().preemption_context.preemption_info = PreemptionInfo(deadline_ms, {node: [0]})
        if action == "reclaim":
            time.sleep(120)  # torn down by Ray Train at the deadline


def mlp_disturbed(input_shape, num_classes, probe: str, run: str, script: list) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes),
                         _Disturbances(probe, run, script))


INTERVAL_S = 6.0  # checkpoint_every_n_minutes=0.1: ten steps here take under a second unless made to (a slow start
# that makes the check at step 10 find one due only adds a checkpoint there)


@pytest.mark.ray
@pytest.mark.slow
def test_a_stream_resumes_at_a_time_based_checkpoint_then_at_a_preemption_notices_and_ends_like_the_loader_path(
        ray_session, tmp_path, storage):
    """PNG Parquet, 1 worker, 3 epochs of 20 steps, ``checkpoint_every_n_minutes=0.1`` and no step checkpoints.
    Step 25 takes 6.5 s, so the check at step 30 finds the time-based checkpoint due: it saves step 30; the
    worker is SIGKILLed in step 36 and ``max_failures=1`` restarts it there. The restarted worker gets a preemption
    notice in step 45 (Ray Train's preemption info, deadline far): the check at step 50 saves step 50 and the
    driver prints the notice; once that is registered the deadline moves to now, Ray Train tears the group down and
    restarts it (a preemption: not counted against ``max_failures``) at step 50. Each attempt trains exactly its
    steps and the run ends with the loader path's uninterrupted weights."""
    import io

    from _reference import train_one_worker

    root, probe = _png_parquet(tmp_path), tmp_path / "probe"
    reference = _stream_fields(root, tmp_path / "unused", ingest="loader", epochs=3)
    want, _, _, loaded = train_one_worker(reference)
    run = f"{storage}/stream-time-notice"
    script = [(0, 1 + 25, "sleep", INTERVAL_S + 0.5), (0, 1 + 36, "kill", 30),  # forward 1: the FLOPs count's
              (1, 1 + 45 - 30, "notice", None), (1, 1 + 56 - 30, "reclaim", 50)]
    fields = {**_stream_fields(root, probe, ingest="ray_data", epochs=3, checkpoint_every_n_minutes=INTERVAL_S / 60,
                               max_failures=1),
              "model": mlp_disturbed, "model_kwargs": {"probe": str(probe), "run": run, "script": script}}
    output = io.StringIO()
    result = rtm.fit(rtm.TrainConfig(**fields, name="stream-time-notice", storage_path=storage), stream=output)
    assert _forwards(probe) == [1 + 36, 1 + 56 - 30, 1 + 60 - 50]
    printed = output.getvalue()
    assert re.search(r"preempted \(node [0-9a-f]{12}, deadline in \d+ s\): saved step 50", printed), printed
    assert "resuming at step 30 (10/20 steps of epoch 2 done)" in printed, printed
    assert "resuming at step 50 (10/20 steps of epoch 3 done)" in printed, printed
    assert [(row["step"], row["attempt"]) for row in result.history] == [(20, 0), (40, 1), (60, 2)]
    _assert_weights(result, want, rtol=1e-6)
    for row, reference_row in zip(result.history, loaded, strict=True):
        for key in ("train_loss", "val_loss", "test_accuracy"):
            assert row[key] == pytest.approx(reference_row[key], rel=1e-6), key
