"""Per-sample transforms (``train_transform`` / ``test_transform``): torchvision v2 recipes and your own
function, seeded by (seed, epoch, sample), the epoch carried to (persistent) loader workers, the input
shape updated before the model is built, the checks, and what the seeding costs per sample."""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets, check_data
from raytrain_mgpu.data.transforms import TransformedDataset, build_transform, sample_seed
from raytrain_mgpu.engine.loaders import train_loader

CPU = torch.device("cpu")


def noise():
    """A user transform factory: the returned callable draws from torch's global generator."""
    return lambda x: x + 0.5 * torch.randn_like(x)


def not_callable():
    return 3


def _images(n=32, shape=(3, 10, 10)):
    size = n * shape[0] * shape[1] * shape[2]
    return TensorDataset(torch.arange(size, dtype=torch.float32).reshape(n, *shape) / size, torch.arange(n))


def test_recipe_is_torchvisions_v2_transform_seeded_per_sample():
    from torchvision.transforms import v2  # here, not at the top: every pytest process collects this module

    transform, shape = build_transform("random_crop_flip", (3, 10, 10), "train_transform")
    data = TransformedDataset(_images(), transform, seed=7)
    reference = v2.Compose([v2.RandomCrop((10, 10), padding=4), v2.RandomHorizontalFlip()])
    for epoch, index in [(0, 3), (1, 3), (4, 17)]:
        torch.manual_seed(sample_seed(7, epoch, index))
        assert torch.equal(data[(epoch, index)][0], reference(_images()[index][0]))
    assert shape == (3, 10, 10)
    # the same sample and epoch: the same crop; another epoch or seed: (almost surely) another
    assert torch.equal(data[(2, 5)][0], data[(2, 5)][0])
    assert not torch.equal(data[(2, 5)][0], data[(3, 5)][0])
    assert not torch.equal(data[(2, 5)][0], TransformedDataset(_images(), transform, seed=8)[(2, 5)][0])
    data.set_epoch(3)  # plain indices take the epoch of set_epoch
    assert torch.equal(data[5][0], data[(3, 5)][0])


def test_the_training_processs_generator_is_untouched():
    data = TransformedDataset(_images(), build_transform("test_transforms:noise", (3, 10, 10), "t")[0], seed=0)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    data.__getitems__([(0, 1), (0, 2), (1, 1)])
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True), (2, False)])
def test_the_epoch_reaches_loader_workers(workers, persistent):
    """Each epoch's batches are the transform of (epoch, index) for the sampler's indices, also in
    persistent workers, which hold the dataset copy of the first epoch."""
    cfg = rtm.TrainConfig(loader_workers=workers, persistent_workers=persistent, seed=1).data
    data = TransformedDataset(_images(), build_transform("test_transforms:noise", (3, 10, 10), "t")[0], seed=1)
    sampler = DistributedSampler(data, 1, 0, shuffle=True, seed=1, drop_last=True)
    loader = train_loader(cfg, data, sampler, 8, CPU)
    seen = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = torch.cat([x for x, _ in loader])
        expected = torch.stack([data[(epoch, i)][0] for i in sampler])
        assert torch.equal(batches, expected), f"epoch {epoch}"
        seen.append(batches[torch.argsort(torch.tensor(list(sampler)))])  # in index order
    assert not torch.equal(seen[0], seen[1])  # another epoch, other noise


def test_resize_changes_the_input_shape_the_model_is_built_for():
    cfg = rtm.TrainConfig(dataset="digits", train_transform="resize:16+random_crop_flip", test_transform="resize:16")
    assert check_data(cfg.data) == ((1, 16, 16), 10)
    built = build_datasets(cfg.data)
    assert built.input_shape == (1, 16, 16)
    assert built.train[0][0].shape == built.test[0][0].shape == (1, 16, 16)
    with pytest.raises(ValueError, match=r"train_transform='resize:16'.*test_transform=None.*\(1, 16, 16\) \(train\)"):
        check_data(rtm.TrainConfig(dataset="digits", train_transform="resize:16").data)


@pytest.mark.parametrize("fields,message", [
    (dict(train_transform="resize:0"), r"TrainConfig.train_transform='resize:0': 'resize:0' needs a positive"),
    (dict(test_transform="flip"), r"TrainConfig.test_transform='flip': 'flip' is not one of"),
    (dict(train_transform="random_crop_flip+os:getcwd"), r"'os' is a standard-library module"),
    (dict(train_transform=""), r"TrainConfig.train_transform='': must be a transform spec or None"),
    (dict(loader_workers=-1), r"TrainConfig.loader_workers=-1: must be an integer >= 0"),
    (dict(loader_workers=True), r"TrainConfig.loader_workers=True: must be an integer >= 0"),
    (dict(prefetch_factor=4), r"TrainConfig.prefetch_factor=4: only applies with loader_workers > 0"),
    (dict(prefetch_factor=0, loader_workers=1), r"TrainConfig.prefetch_factor=0: must be a positive integer"),
    (dict(persistent_workers="no"), r"TrainConfig.persistent_workers='no': must be true or false"),
])
def test_bad_loading_fields_fail_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        rtm.TrainConfig(**fields)


def test_a_factory_must_return_a_callable_and_a_config_file_needs_allow_code(tmp_path):
    with pytest.raises(ValueError, match="returned int, not a callable"):
        build_transform("test_transforms:not_callable", (3, 10, 10), "train_transform")
    path = tmp_path / "run.yaml"
    path.write_text("train_transform: resize:96+test_transforms:noise\ntest_transform: resize:96\n")
    with pytest.raises(ValueError, match=r"train_transform\[0\]='test_transforms:noise' names code"):
        rtm.TrainConfig.from_yaml(path)
    cfg = rtm.TrainConfig.from_yaml(path, allow_code=True)
    assert "test_transforms:noise" in cfg.code_specs() and "resize:96" not in cfg.code_specs()


def test_seeding_touches_the_cpu_generator_only(monkeypatch):
    """Seeding and restoring the CPU generator around each call (a few microseconds): never ``torch.manual_seed``,
    which seeds every CUDA device too (~90 us a call even without a GPU, 8x the bare transform when it was used).
    What the seeding costs is ``raytrain-mgpu bench-data``'s to measure, not a timed test's."""
    transform = build_transform("random_crop_flip", (3, 32, 32), "train_transform")[0]
    data = TransformedDataset(_images(4, (3, 32, 32)), transform, seed=0)
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    for i in range(4):
        data[(0, i)]
    assert calls == []
