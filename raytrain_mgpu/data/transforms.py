"""Per-sample transforms of the input ``x`` (``train_transform`` / ``test_transform``), seeded per sample.

A spec is one or more parts joined with ``+``, applied left to right:

- ``random_crop_flip``: ``RandomCrop(size of the input, padding=4)`` and ``RandomHorizontalFlip()``
  (torchvision v2), the CIFAR recipe. The padding is 0 of the normalised input, i.e. the mean.
- ``resize:<n>``: ``Resize((n, n))`` (bilinear, antialiased), e.g. ``resize:96`` as d2l does for
  Fashion-MNIST; it changes ``input_shape``, and the model is built for the new one.
- ``pkg.module:function``: ``function()`` returns a callable on one input tensor (the normalised
  float ``x``); the same factory rules as ``model`` (a config file needs ``allow_code``).

Seeding: the transforms draw from torch's global CPU generator; :class:`TransformedDataset` seeds it
by ``(seed, epoch, sample index)`` for each call and restores it afterwards, so a sample gets the same
augmentation in the same epoch whatever the number of workers or loader workers, or the step a run
resumed at, and the training process's own random stream is untouched. It costs about 10 us a sample
(``tests/test_transforms.py`` measures it).

The epoch reaches the dataset through the indices: ``engine/loaders.py`` hands the DataLoader
``(epoch, index)`` pairs, which persistent loader workers receive like any index.
``set_epoch`` sets the epoch of plain integer indices (evaluation, your own loops).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

from raytrain_mgpu.config.factories import check_factory_spec, load_factory

__all__ = ["TransformedDataset", "build_transform", "check_transform_spec", "factory_parts", "sample_seed",
           "transformed_shape"]

_RECIPES = ("random_crop_flip", "resize:<n>")
_FIX = ("Write e.g. 'random_crop_flip', 'resize:96', 'resize:96+random_crop_flip' or 'my_augment:build' "
        "(a function returning a callable on one input tensor), or from Python pass the callable itself.")


def _parts(spec: str) -> list:
    return [part.strip() for part in spec.split("+")]


def factory_parts(spec) -> list:
    """The ``module:function`` parts of a spec (what may name code), or the transform object itself."""
    if callable(spec) and not isinstance(spec, str):
        return [spec]
    if not isinstance(spec, str):
        return []
    return [part for part in _parts(spec) if ":" in part and not part.startswith("resize:")]


def check_transform_spec(field: str, spec) -> None:
    """Parse ``spec`` without importing anything; ValueError names the field, the part and the fix."""
    import re

    if spec is None or (callable(spec) and not isinstance(spec, str)):  # from Python: the transform itself
        return
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"TrainConfig.{field}={spec!r}: must be a transform spec or None. {_FIX}")
    for part in _parts(spec):
        if part == "random_crop_flip":
            continue
        if part.startswith("resize:"):
            size = part[len("resize:"):]
            if not size.isdigit() or int(size) < 1:
                raise ValueError(f"TrainConfig.{field}={spec!r}: {part!r} needs a positive whole size, e.g. "
                                 f"'resize:96'. {_FIX}")
            continue
        if ":" in part and re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", part):
            check_factory_spec(part, field)
            continue
        raise ValueError(f"TrainConfig.{field}={spec!r}: {part!r} is not one of {list(_RECIPES)} or a "
                         f"'package.module:function'. {_FIX}")


def _one(part: str, shape: tuple, field: str) -> Callable:
    from torchvision.transforms import v2  # late: loads torch; the config checks import this module

    if part == "random_crop_flip":
        if len(shape) < 2:
            raise ValueError(f"TrainConfig.{field}: 'random_crop_flip' needs image inputs (C, H, W); this "
                             f"dataset's input_shape is {shape}. Remove the transform.")
        return v2.Compose([v2.RandomCrop(tuple(shape[-2:]), padding=4), v2.RandomHorizontalFlip()])
    if part.startswith("resize:"):
        size = int(part[len("resize:"):])
        return v2.Resize((size, size), antialias=True)
    transform = load_factory(part, field)()
    if not callable(transform):
        raise ValueError(f"TrainConfig.{field}={part!r}: the factory returned {type(transform).__name__}, not a "
                         f"callable. Return a function or a torchvision transform that takes one input tensor.")
    return transform


def build_transform(spec: str, input_shape: tuple, field: str) -> tuple:
    """``(callable on one x, the shape it returns)`` for a spec and an input of ``input_shape``."""
    import torch  # late: loads torch; the config checks import this module

    if not (isinstance(input_shape, tuple) and all(isinstance(d, int) for d in input_shape)):
        raise ValueError(f"TrainConfig.{field}={spec!r}: transforms apply to one input tensor, but this "
                         f"dataset's inputs are structured ({input_shape}). Transform them in your dataset.")
    steps, shape = [], tuple(input_shape)
    for part in ([spec] if callable(spec) and not isinstance(spec, str) else _parts(spec)):
        step = part if callable(part) else _one(part, shape, field)  # an object from Python: the transform
        with torch.random.fork_rng(devices=[]):
            try:
                shape = tuple(step(torch.zeros(shape)).shape)  # a probe: the shape after this part
            except TypeError as exc:  # the user's callable cannot take one tensor: named here, before Ray
                raise ValueError(f"TrainConfig.{field}={spec!r}: {getattr(step, '__name__', step)!r} must take one "
                                 f"input tensor and return a tensor, but calling it with a {shape} tensor raised "
                                 f"TypeError: {exc}. {_FIX}") from exc
        steps.append(step)
    return (steps[0] if len(steps) == 1 else _Chain(steps)), shape


class _Chain:
    def __init__(self, steps: Sequence[Callable]):
        self.steps = list(steps)

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


def transformed_shape(train_spec: Optional[str], test_spec: Optional[str], input_shape: tuple) -> tuple:
    """The input shape the model sees; both splits must agree (the same model evaluates the test split)."""
    train = build_transform(train_spec, input_shape, "train_transform")[1] if train_spec else input_shape
    test = build_transform(test_spec, input_shape, "test_transform")[1] if test_spec else input_shape
    if train != test:
        raise ValueError(f"TrainConfig.train_transform={train_spec!r} and test_transform={test_spec!r} turn "
                         f"inputs of shape {input_shape} into {train} (train) and {test} (test); one model "
                         f"sees both. Give both the same resize, e.g. test_transform='resize:{train[-1]}'.")
    return train


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed from (seed, epoch, index): independent streams for neighbouring samples and epochs."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TransformedDataset:
    """``dataset`` with ``transform`` applied to each sample's ``x``, seeded per (seed, epoch, index).

    An index is an int (the epoch of :meth:`set_epoch`) or an ``(epoch, index)`` pair.
    """

    def __init__(self, dataset, transform: Callable, seed: int, epoch: int = 0):
        self.dataset, self.transform, self.seed, self.epoch = dataset, transform, seed, epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def _apply(self, x, epoch: int, index: int):
        import torch  # late: loads torch; the config checks import this module

        # The CPU generator only, saved and restored around the call: about 5 us. torch.manual_seed
        # also seeds every CUDA device (about 200 us a call), and the inputs are on the CPU here.
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(sample_seed(self.seed, epoch, index))
        try:
            return self.transform(x)
        finally:
            generator.set_state(state)

    def _split(self, item) -> tuple:
        return (int(item[0]), int(item[1])) if isinstance(item, tuple) else (self.epoch, int(item))

    def __getitem__(self, item):
        epoch, index = self._split(item)
        x, y = self.dataset[index]
        return self._apply(x, epoch, index), y

    def __getitems__(self, items: Sequence) -> list:
        pairs = [self._split(item) for item in items]
        indices = [index for _, index in pairs]
        getitems = getattr(self.dataset, "__getitems__", None)  # one batched read where the reader has it
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return [(self._apply(x, epoch, index), y) for (epoch, index), (x, y) in zip(pairs, samples)]
