"""A user's own Ray Datasets: ``TrainConfig(dataset={"train": ds, "val": ds, "test": ds}, collate=fn)``.

The data: scikit-learn's digits as rows ``{"pixels": 64 floats, "label": int}`` (any columns: the user's),
collated into the two-input example's dict batches (``examples/two_inputs.py``: inputs ``{"image",
"profile"}``, targets ``{"digit", "odd"}``), for its model, loss and metrics, which we did not shape for
Ray Data. The same rows, collated the same way, are also handed to the loader path by a dataset factory:
the Ray Data run must train what the loader trains.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu import Datasets
from raytrain_mgpu.data.ray_datasets import CollatedSamples, RayDataSplits

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


def _fields(**overrides) -> dict:
    from examples import two_inputs

    # One full-batch step an epoch: each worker's equal share of the stream is one micro-batch, so the
    # gradient is the mean over every training row whatever order Ray Data read them in.
    return dict(model=two_inputs.two_input_net, model_kwargs={"hidden": 16}, loss=two_inputs.digit_and_parity,
                metrics=[two_inputs.digit_accuracy, two_inputs.parity_accuracy], num_classes=10,
                batch_size=1280, optimizer="sgd", lr=0.5, epochs=3, seed=0, **overrides)


# ----------------------------------------------------------------------------- no Ray


class FakeDataset:
    """What the config check sees of a Ray Dataset (duck-typed: the check imports no Ray)."""

    def streaming_split(self, *args, **kwargs):
        raise AssertionError("not read by the config check")

    def iter_batches(self, *args, **kwargs):
        raise AssertionError("not read by the config check")


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
     r"checkpoint_every_n_steps=5 with Ray Datasets: a step checkpoint would have to keep the stream's position"),
])
def test_ray_datasets_are_checked_with_the_config_naming_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        rtm.TrainConfig(**overrides)


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
