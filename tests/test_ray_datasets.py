"""A user's own Ray Datasets: ``TrainConfig(dataset={"train": ds, "val": ds, "test": ds}, collate=fn)``.

The data: scikit-learn's digits as rows ``{"pixels": 64 floats, "label": int}`` (any columns: the user's),
collated into the two-input example's dict batches (``examples/two_inputs.py``: inputs ``{"image",
"profile"}``, targets ``{"digit", "odd"}``), for its model, loss and metrics, which we did not shape for
Ray Data. The same rows, collated the same way, are also handed to the loader path by a dataset factory:
the Ray Data run must train what the loader trains.

A materialized training split (``from_items`` gives one) trains in the planned order by position
(``data/ray_datasets.PlannedRows``): without Ray, the config checks and who may resume mid-epoch; on the shared
Ray, its micro-batches are the loader path's samples in the sampler's order, resumed and at any worker count;
through Ray Train, 2 workers killed mid-epoch resume at their step checkpoint and end with the uninterrupted
2-replica loader path's weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu import Datasets
from raytrain_mgpu.data.ray_datasets import CollatedSamples, RayDataSplits, datasets_to_split, planned

VAL_ROWS = 158  # of the digits' 1,438 training rows: 1,280 train, an even count (2 workers, one full batch each)


def _rows() -> dict:
    """``{split: (pixels, labels)}``: the two-input example's 80/20 split, its train part cut into train and val."""
    from sklearn.datasets import load_digits

    from examples.two_inputs import SPLIT_SEED, TEST_FRACTION

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    cut = int(round((1 - TEST_FRACTION) * len(labels)))
    train, test = order[:cut], order[cut:]
    val, train = train[:VAL_ROWS], train[VAL_ROWS:]
    return {name: (images[rows].astype(np.float32), labels[rows].astype(np.int64))
            for name, rows in (("train", train), ("val", val), ("test", test))}


def collate(batch: dict):
    """The user's function: columns -> the example's dict inputs and targets (what its TwoViews gives)."""
    images = torch.from_numpy(np.asarray(batch["pixels"], dtype=np.float32)).div(16.0).reshape(-1, 1, 8, 8)
    profiles = torch.cat([images.sum(dim=3), images.sum(dim=2)], dim=2).reshape(-1, 16) / 8
    labels = torch.from_numpy(np.asarray(batch["label"], dtype=np.int64))
    return {"image": images, "profile": profiles}, {"digit": labels, "odd": (labels % 2).float()}


def same_rows_for_the_loader(cfg) -> Datasets:
    """The loader path's dataset factory: the same rows, collated by the same function."""
    splits = {name: CollatedSamples(*collate({"pixels": x, "label": y})) for name, (x, y) in _rows().items()}
    return Datasets(splits["train"], splits["test"], {"image": (1, 8, 8), "profile": (16,)}, 10, val=splits["val"])


def collate_xy(batch: dict):
    """A user's plain collate: ``(images, labels)``."""
    images = torch.from_numpy(np.asarray(batch["pixels"], dtype=np.float32)).div(16.0).reshape(-1, 1, 8, 8)
    return images, torch.from_numpy(np.asarray(batch["label"], dtype=np.int64))


def xy_rows_for_the_loader(cfg) -> Datasets:
    """:func:`collate_xy`'s samples of the same rows, for the loader path."""
    splits = {name: CollatedSamples(*collate_xy({"pixels": x, "label": y})) for name, (x, y) in _rows().items()}
    return Datasets(splits["train"], splits["test"], (1, 8, 8), 10, val=splits["val"])


def _materialized(num_blocks: int = 4) -> dict:
    """The splits as ``from_items`` Datasets (materialized: ``MaterializedDataset``), ``num_blocks`` blocks each."""
    import ray.data

    return {name: ray.data.from_items([{"pixels": row, "label": int(label)} for row, label in zip(x, y)],
                                      override_num_blocks=num_blocks)
            for name, (x, y) in _rows().items()}


def _fields(**overrides) -> dict:
    from examples import two_inputs

    # One full-batch step an epoch: each worker's equal share of the stream is one micro-batch, so the
    # gradient is the mean over every training row whatever order Ray Data read them in.
    return dict(model=two_inputs.two_input_net, model_kwargs={"hidden": 16}, loss=two_inputs.digit_and_parity,
                metrics=[two_inputs.digit_accuracy, two_inputs.parity_accuracy], num_classes=10,
                batch_size=1280, optimizer="sgd", lr=0.5, epochs=3, seed=0, use_gpu=False, **overrides)


# ----------------------------------------------------------------------------- no Ray


class FakeDataset:
    """What the config check sees of a Ray Dataset (duck-typed: the check imports no Ray)."""

    def streaming_split(self, *args, **kwargs):
        raise AssertionError("not read by the config check")

    def iter_batches(self, *args, **kwargs):
        raise AssertionError("not read by the config check")


class MaterializedDataset(FakeDataset):
    """What the config check sees of ``ray.data.MaterializedDataset``: its class's name."""


@pytest.mark.parametrize("overrides,match", [
    (dict(dataset={"train": FakeDataset()}, collate=collate),
     r"a dict of Ray Datasets with the splits \['train'\]; it takes 'train' and 'test'"),
    (dict(dataset={"train": FakeDataset(), "test": FakeDataset(), "holdout": FakeDataset()}, collate=collate),
     r"splits \['holdout', 'test', 'train'\]; it takes 'train' and 'test', and 'val'"),
    (dict(dataset={"train": FakeDataset(), "test": FakeDataset()}),
     r"collate=None: Ray Datasets need a function that turns a batch \(a dict of NumPy arrays"),
    (dict(collate=collate), r"collate='test_ray_datasets:collate' is read with Ray Datasets only"),
    (dict(dataset={"train": FakeDataset(), "test": FakeDataset()}, collate=collate, val_fraction=0.1),
     r"val_fraction=0.1 does not apply to Ray Datasets: pass a 'val' Dataset instead"),
    (dict(dataset={"train": FakeDataset(), "test": FakeDataset()}, collate=collate, checkpoint_every_n_steps=5),
     r"checkpoint_every_n_steps=5 with dataset\['train'\] a FakeDataset, not materialized: a checkpoint inside an "
     r"epoch resumes at a position of the epoch's order, .* Materialize it \(dataset=\{'train': "
     r"train_ds.materialize\(\), ...\}.* or write it to Parquet"),
    (dict(dataset={"train": FakeDataset(), "test": MaterializedDataset()}, collate=collate,
          checkpoint_every_n_minutes=0.5),
     r"checkpoint_every_n_minutes=0.5 with dataset\['train'\] a FakeDataset, not materialized"),
])
def test_ray_datasets_are_checked_with_the_config_naming_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        rtm.TrainConfig(**overrides)


def test_a_materialized_training_split_takes_checkpoints_inside_an_epoch_and_its_notices_are_acted_on():
    """A materialized ``train`` plans its order: step and time checkpoints pass the checks, the record says so (Ray
    Train then splits nothing: every worker reads its own positions) and the preemption check asks for notices;
    one that streams in Ray Data's order does none of these."""
    from raytrain_mgpu.checkpointing.preemption import PreemptionCheck

    cfg = rtm.TrainConfig(dataset={"train": MaterializedDataset(), "test": FakeDataset()}, collate=collate,
                          checkpoint_every_n_steps=5, checkpoint_every_n_minutes=1.0)
    assert planned(cfg.dataset)
    for block_rows, splits, asks in (([300, 300, 200], [], True), (None, ["train"], False)):
        record = RayDataSplits(("train", "test"), 800, (64,), 10, block_rows=block_rows)
        assert planned(record) is asks and datasets_to_split(record) == splits
        cfg = rtm.TrainConfig(dataset=record, collate=collate, ingest="ray_data")
        asked, saves = [], []

        def local_notice():  # this worker's notice: there is one
            asked.append(1)
            return "notice"

        check = PreemptionCheck(cfg, every=1, get_info=lambda: "notice", local_notice=local_notice,
                                any_rank=lambda seen: seen)
        check.after_step(1, 1, 10, lambda: saves.append(1))
        assert (bool(asked), saves) == ((True, [1]) if asks else (False, [])), block_rows


def test_collated_samples_batch_back_into_what_collate_gives():
    x, y = _rows()["val"]
    samples = CollatedSamples(*collate({"pixels": x, "label": y}))
    inputs, targets = next(iter(torch.utils.data.DataLoader(samples, batch_size=7)))
    want_inputs, want_targets = collate({"pixels": x[:7], "label": y[:7]})
    assert len(samples) == VAL_ROWS and inputs.keys() == want_inputs.keys() and targets.keys() == want_targets.keys()
    for got, want in ((inputs, want_inputs), (targets, want_targets)):
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_the_record_travels_without_the_datasets_and_keeps_the_run_folders_facts():
    import pickle

    record = RayDataSplits(("train", "val", "test"), 1280, {"image": (1, 8, 8), "profile": (16,)}, 10,
                           datasets={"train": FakeDataset()})
    assert pickle.loads(pickle.dumps(record)).datasets is None  # Ray Train hands the Datasets over, not the config
    cfg = rtm.TrainConfig(dataset=record, collate=collate, ingest="ray_data", name="r")
    assert cfg.to_dict()["dataset"].startswith("<object raytrain_mgpu.data.ray_datasets:RayDataSplits sha256:")
    other = RayDataSplits(("train", "val", "test"), 1000, record.input_shape, 10)
    assert cfg.replace(dataset=other).to_dict()["dataset"] != cfg.to_dict()["dataset"]  # another row count


# ----------------------------------------------------------------------------- the shared Ray, in this process


@pytest.mark.ray
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_materialized_split_streams_the_loader_paths_samples_in_the_planned_order_resumed_at_any_count(
        ray_session, monkeypatch, replicas):
    """Positions are rows of the blocks in order: each rank's micro-batches, collated on the rank, are
    ``collate_xy`` of the loader path's rows at its sampler's indices (windows of whole blocks, several chunks of
    fetched blocks), a resumed epoch's the rest of them; and every step takes the same rows at 1 and 2 workers."""
    from raytrain_mgpu.data import ray_datasets
    from raytrain_mgpu.engine.stream import PlannedSampler, PlannedStream

    monkeypatch.setattr(ray_datasets, "CHUNK_ROWS", 96)
    train = _materialized(num_blocks=5)["train"]
    block_rows = ray_datasets._block_rows(train)
    loader = xy_rows_for_the_loader(None).train
    steps, batch, taken = len(loader) // 64, 64 // replicas, []
    for rank in range(replicas):
        rows = ray_datasets.PlannedRows(train.iterator(), collate_xy, block_rows)
        assert len(block_rows) == 5 and rows.run_starts() == [0, 256, 512, 768, 1024] and len(rows) == 1280
        sampler = PlannedSampler(rows, rows.run_starts(), window_rows=300, num_replicas=replicas, rank=rank, seed=2)
        sampler.set_epoch(1)
        sampler.resume_at(1, 3 * batch)  # after step 3
        got = list(PlannedStream(sampler, micro_batch=batch, num_batches=steps, source=rows))
        indices = list(sampler)[:len(got) * batch]
        assert len(got) == steps - 3
        want = [loader[i] for i in indices]
        assert torch.equal(torch.cat([x for x, _ in got]), torch.stack([x for x, _ in want]))
        assert torch.equal(torch.cat([y for _, y in got]), torch.tensor([int(y) for _, y in want]))
        taken.append([indices[s * batch:(s + 1) * batch] for s in range(len(got))])
    whole = PlannedSampler(list(range(1280)), [0, 256, 512, 768, 1024], window_rows=300, num_replicas=1, rank=0,
                           seed=2)
    whole.set_epoch(1)
    order = list(whole)
    for step in range(steps - 3):  # steps 4, 5, ...: positions [s*B, (s+1)*B) of the order at either count
        assert sorted(i for share in taken for i in share[step]) == sorted(order[(3 + step) * 64:(4 + step) * 64])


# ----------------------------------------------------------------------------- through Ray


@pytest.mark.ray
def test_a_users_ray_datasets_with_dict_batches_train_as_the_same_rows_through_the_loader(ray_session, storage):
    import ray.data
    from _reference import train_one_worker

    datasets = {name: ray.data.from_items([{"pixels": row, "label": int(label)} for row, label in zip(x, y)],
                                         override_num_blocks=4)
                for name, (x, y) in _rows().items()}
    # collate from this module, which Ray Train's controller cannot import (pytest put it on this process's
    # path only): it travels by value, as a driver script's __main__ objects do (_factory.send_objects_by_value)
    result = rtm.fit(rtm.TrainConfig(**_fields(), dataset=datasets, collate=collate, num_workers=2, name="raydata",
                                     storage_path=storage, monitor="val_loss"))
    weights, _, _, loaded = train_one_worker(_fields(dataset=same_rows_for_the_loader, num_workers=1))
    # The loader's one rank took the mean over all 1,280 rows; the two workers each over the 640 of their
    # equal share, averaged by DDP: the same gradient up to the order of the sums.
    got = result.load_model().state_dict()
    for key, value in weights.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert [row["step"] for row in result.history] == [1, 2, 3]
    for row, want in zip(result.history, loaded):
        assert row["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    # val and test were read whole by each worker and evaluated once over the ranks: every row counted once.
    from examples.two_inputs import digit_accuracy

    model, rows = result.load_model(), _rows()
    for split, reported in (("val", result.history[-1]["val_digit_accuracy"]),
                            ("test", result.metrics["test_digit_accuracy"])):
        inputs, targets = collate({"pixels": rows[split][0], "label": rows[split][1]})
        with torch.no_grad():
            correct, count = digit_accuracy(model(**inputs), targets)
        assert abs(int(correct) / count - reported) < 1e-9, split


@pytest.mark.ray
def test_a_pipeline_streams_a_users_ray_datasets_as_the_loader_path_trains(ray_session, storage):
    """The pipeline's driver hands each replica its share of the training stream and the evaluated splits whole
    (as Ray Train's dataset shards give a worker): a 2-stage pipeline on the Ray Datasets ends with the weights of
    one process reading the same rows through the loader (one full-batch step an epoch: the order is moot)."""
    import ray.data
    from _reference import train_one_worker

    datasets = {name: ray.data.from_items([{"pixels": row, "label": int(label)} for row, label in zip(x, y)],
                                         override_num_blocks=4)
                for name, (x, y) in _rows().items()}
    result = rtm.fit(rtm.TrainConfig(**_fields(), dataset=datasets, collate=collate, strategy="pipeline", num_stages=2,
                                     num_microbatches=4, name="raydata-pipeline", storage_path=storage))
    weights, _, _, loaded = train_one_worker(_fields(dataset=same_rows_for_the_loader))
    got = result.load_model().state_dict()
    for key, value in weights.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
    for row, want in zip(result.history, loaded):
        assert row["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
        assert row["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)  # the val split, read whole by the stages
    assert result.metrics["test_digit_accuracy"] == pytest.approx(loaded[-1]["test_digit_accuracy"], abs=1e-9)


@pytest.mark.ray
@pytest.mark.slow
def test_a_materialized_dataset_killed_mid_epoch_resumes_at_its_step_checkpoint_with_the_loader_paths_weights(
        ray_session, tmp_path, storage):
    """2 workers on a materialized Dataset (``from_items``), step checkpoints every 10 steps: a worker is SIGKILLed
    in step 36 and ``max_failures=1`` restarts the group from the step-30 checkpoint; each restarted worker trains
    steps 31-40 only, and the run ends with the weights and losses of 2 uninterrupted loader-path replicas reading
    the same rows (``train_replicas``: bit for bit a 2-worker fit)."""
    from _reference import train_replicas
    from test_stream_resume import _forwards, mlp_dying_once

    probe = tmp_path / "probe"
    probe.mkdir()
    common = dict(model=mlp_dying_once, num_classes=10, batch_size=64, optimizer="sgd", lr=0.1, momentum=0.9,
                  seed=3, epochs=2, use_gpu=False)
    want, reference = train_replicas({**common, "dataset": xy_rows_for_the_loader,
                                      "model_kwargs": {"probe": str(tmp_path), "after_forwards": 10**9}})
    kill = {"probe": str(probe), "after_forwards": 36, "run": f"{storage}/materialized", "registered": 30}
    result = rtm.fit(rtm.TrainConfig(**common, model_kwargs=kill, dataset=_materialized(), collate=collate_xy,
                                     num_workers=2, checkpoint_every_n_steps=10, max_failures=1, name="materialized",
                                     storage_path=storage))
    assert (probe / "died").exists()
    forwards = _forwards(probe)  # each step's forwards, rank 0's after its FLOPs count's
    assert len(forwards) == 4 and sorted(forwards[-2:]) == [40 - 30, 1 + 40 - 30], forwards
    assert [(row["step"], row["attempt"]) for row in result.history] == [(20, 0), (40, 1)]
    got = result.load_model().state_dict()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)
    for row, reference_row in zip(result.history, reference, strict=True):  # the resumed epoch's sums continued
        assert row["train_loss"] == pytest.approx(reference_row["train_loss"], rel=1e-6)


def test_a_materialized_splits_planned_order_does_not_depend_on_its_blocks():
    """Over 8,192 rows the planned order is cut into windows: of fixed runs of positions, not of the blocks, so a
    resume whose Dataset holds the same rows in other blocks (another driver) continues the same order."""
    from raytrain_mgpu.data.ray_datasets import PlannedRows
    from raytrain_mgpu.engine.stream import planned_order

    one, other = PlannedRows(None, None, [5000, 5000]), PlannedRows(None, None, [3000, 6000, 1000])
    assert one.run_starts() == other.run_starts()
    orders = [planned_order(10_000, seed=3, epoch=1, run_starts=rows.run_starts()) for rows in (one, other)]
    assert torch.equal(*orders) and sorted(orders[0].tolist()) == list(range(10_000))
    assert not torch.equal(orders[0], torch.randperm(10_000, generator=torch.Generator().manual_seed(4)))  # windows
