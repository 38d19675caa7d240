"""Loader workers (``loader_workers``): the same samples in the same order, so the same weights as 0 workers.

The engine (``engine/loop.py`` with ``engine/loaders.py``'s loader) runs here without Ray, in this
process (the in-process runner: tests/_reference.train_one_worker), on the digits with a small CNN that has dropout (so a DataLoader that
drew from the training process's random stream would show) and a seeded augmentation. Then:

- 0, 2 (persistent) and 2 (restarted each epoch) loader workers give bit-identical weights;
- a dataset with ``prefetch`` (as ``parquet``) serves each epoch's rows to its loader workers
  (``test_loaders:strict_prefetch_data`` raises on a row it was not told about);
- a run stopped after epoch 1 and resumed from its checkpoint (weights, optimizer, random stream
  restored; the loader and its workers new) equals an uninterrupted one;
- one Ray ``fit`` (``runner="ray"``, one Ray Train worker) with ``loader_workers=1`` ends with the
  in-process run's weights, bit for bit (its model built for the resized inputs); it also carries the
  Ray Train runner's per-step scalars' check.

A 2-stage pipeline on Ray whose first stage reads with a loader worker and a seeded user transform,
ending with the weights of one process reading without workers, is ``tests/test_pipeline_ray.py``'s
first run (one actor group for that and the pipeline's checkpoints and resume).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.engine.loaders import train_loader

CPU = torch.device("cpu")
STEPS_PER_EPOCH = 1438 // 64  # digits' training split in BASE's batches


def dropout_cnn(input_shape, num_classes):
    """Dropout draws from the training process's generator every step."""
    return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(),
                         nn.Linear(4 * input_shape[1] * input_shape[2], num_classes))


class _StrictPrefetch(torch.utils.data.Dataset):
    """Serves only the rows of the last ``prefetch`` call: a loader worker with an old copy fails."""

    def __init__(self, dataset):
        self.dataset, self.rows = dataset, frozenset()

    def prefetch(self, indices):
        self.rows = frozenset(int(i) for i in indices)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        if index not in self.rows:
            raise RuntimeError(f"row {index} was not prefetched for this epoch")
        return self.dataset[index]


def strict_prefetch_data(cfg):
    digits = build_datasets(rtm.TrainConfig(dataset="digits", seed=cfg.seed).data)
    return digits._replace(train=_StrictPrefetch(digits.train))


BASE = dict(model="test_loaders:dropout_cnn", dataset="digits", strategy="ddp", num_workers=1, use_gpu=False,
            batch_size=64, optimizer="sgd", lr=0.1, seed=5, epochs=2, cpus_per_worker=1, grad_clip_norm=1.0,
            # digits are 8 x 8: the model is built for the resized 12 x 12 inputs
            train_transform="resize:12+random_crop_flip", test_transform="resize:12")


def _train_locally(fields: dict, epochs: int = 2, storage=None):
    """``fields``' epochs in this process (the in-process runner): ``(weights, optimizer state, rng state)``; with
    ``storage``, a run folder there (a later call with more epochs resumes from its checkpoint)."""
    from _reference import train_one_worker  # here: the Ray workers import this module for its model, not _reference

    return train_one_worker(fields, epochs, storage)[:3]


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


class _WhoLoads(torch.utils.data.Dataset):
    """Each sample says which process loaded it: its pid and its DataLoader worker id (-1: none)."""

    def __len__(self):
        return 256  # the test loader's batches are at least 64: 4 of them, so both workers load one

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([os.getpid(), -1 if info is None else info.id]), 0


@pytest.mark.parametrize("persistent", [True, False])
def test_loader_workers_load_in_their_own_processes(persistent):
    """The equality tests above pass with no worker at all: this one fails unless loader_workers start."""
    from raytrain_mgpu.engine.loaders import test_loader

    cfg = rtm.TrainConfig(loader_workers=2, persistent_workers=persistent).data
    sampler = DistributedSampler(_WhoLoads(), 1, 0, shuffle=True, seed=0, drop_last=True)
    for loader in (train_loader(cfg, _WhoLoads(), sampler, 8, CPU), test_loader(cfg, _WhoLoads(), 0, 1, 8)):
        loaded = torch.cat([x for x, _ in loader])
        assert os.getpid() not in set(loaded[:, 0].tolist())  # nothing loaded in the training process
        assert set(loaded[:, 1].tolist()) == {0, 1} and len(set(loaded[:, 0].tolist())) == 2


class _CollectsGarbage(torch.utils.data.Dataset):
    """Each load runs a full collection in the loader worker (what its own collector does sooner or later)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        import gc

        gc.collect()
        return torch.tensor([index]), 0


def _load_after_a_group_became_garbage(out: str) -> None:
    """In a process of its own: a gloo group that only a garbage cycle still holds when ``train_loader`` forks its
    worker (a wrapped model's, after ``destroy_process_group``), as in a process that trained before it loads."""
    import gc
    import multiprocessing

    import torch.distributed as dist

    multiprocessing.set_start_method("fork", force=True)  # Linux's default (this process came from a forkserver)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    group = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(1), group=group)  # its threads have run
    cycle = [group]
    cycle.append(cycle)
    gc.disable()  # the cycle is still there at the fork, as when no full collection ran in between
    del group, cycle
    dist.destroy_process_group()
    sampler = DistributedSampler(_CollectsGarbage(), 1, 0, shuffle=False, drop_last=True)
    loader = train_loader(rtm.TrainConfig(loader_workers=1).data, _CollectsGarbage(), sampler, 4, CPU)
    loader.timeout = 30  # a worker stuck in the group's destructor fails the iteration instead of hanging it
    try:
        outcome = str(sorted(int(x) for batch, _ in loader for x in batch))
    except RuntimeError as exc:  # "DataLoader timed out", or its worker "killed by signal"
        outcome = str(exc)
    with open(out, "w") as f:
        f.write(outcome)


def test_a_loader_worker_never_frees_a_process_group_it_inherited(tmp_path):
    """A worker forked while garbage still held a gloo group collected it and ran ``~ProcessGroupGloo`` on threads
    that do not exist in the fork: it hung (a condition variable waited on by them) or aborted. The worker is forked
    with the parent's objects frozen (``engine/loaders.worker_context``): its collector never frees them."""
    import _forkserver

    out = tmp_path / "outcome"
    process = _forkserver.process(_load_after_a_group_became_garbage, (str(out),))
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
    assert out.read_text() == str(list(range(8))), out.read_text()


@pytest.fixture(scope="module")
def no_workers():
    return _train_locally(BASE)[0]


@pytest.mark.parametrize("persistent", [True, False])
def test_two_loader_workers_train_the_same_weights_as_none(no_workers, persistent):
    weights = _train_locally({**BASE, "loader_workers": 2, "persistent_workers": persistent, "prefetch_factor": 3})[0]
    _assert_equal(weights, no_workers, f"2 loader workers (persistent={persistent}) vs 0")


def test_the_augmentation_and_the_dropout_matter(no_workers):
    """The equalities above are not trivial: the transform changes the weights."""
    plain = _train_locally({**BASE, "train_transform": "resize:12"})[0]
    assert not torch.equal(plain["4.weight"], no_workers["4.weight"])


def test_loader_workers_see_each_epochs_prefetched_rows():
    fields = {**BASE, "dataset": "test_loaders:strict_prefetch_data"}
    reference = _train_locally(fields)[0]
    _assert_equal(_train_locally({**fields, "loader_workers": 2})[0], reference, "prefetching dataset, 2 workers")


def test_a_resumed_run_with_loader_workers_equals_an_uninterrupted_one(no_workers, tmp_path):
    from _reference import steps_trained, train_one_worker

    fields = {**BASE, "loader_workers": 2}
    first = train_one_worker(fields, 1, str(tmp_path))[3]
    with steps_trained() as steps:
        resumed, _, _, history = train_one_worker(fields, 2, str(tmp_path))
    # a resume: epoch 1's row kept from the first attempt, epoch 2 (steps 23-44) trained by the second alone
    assert [row["attempt"] for row in history] == [0, 1] and history[:1] == first
    assert steps == list(range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1))
    _assert_equal(resumed, no_workers, "stopped after epoch 1 and resumed vs uninterrupted")


def test_fit_with_a_loader_worker_ends_with_the_local_weights(ray_session, storage, no_workers, monkeypatch):
    """Also the Ray Train runner's per-step scalars (tests/test_step_scalars.py): rank 0's, once an epoch
    (``log_every_n_steps`` = its 22 steps), reach the driver's printer and agree with the epoch rows."""
    from test_step_scalars import check_train_scalars

    from raytrain_mgpu.driver.progress import ProgressPrinter

    received: list = []
    monkeypatch.setattr(ProgressPrinter, "scalars", lambda self, step, values: received.append((step, values)))
    result = rtm.fit(rtm.TrainConfig(**BASE, loader_workers=1, name="loader-workers", storage_path=storage,
                                     log_every_n_steps=STEPS_PER_EPOCH, runner="ray"))
    assert result.startup["ray_s"] > 0 and result.history[0]["node_id_per_rank"]  # through Ray Train
    check_train_scalars(received, result.history, every=STEPS_PER_EPOCH)
    model = result.load_model()
    assert model[4].in_features == 4 * 12 * 12  # built for the resized inputs
    _assert_equal(model.state_dict(), no_workers, "one Ray Train worker vs the in-process runner")
