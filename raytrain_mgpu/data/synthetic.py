"""``synthetic``: deterministic, learnable classification data of any shape.

Each class has a fixed random prototype; a sample is ``(prototype[y] + noise) / sqrt(2)``
(about unit variance), so a model can learn it and accuracy rises above chance. Labels
are drawn up front (8 bytes a sample); the noise of sample ``i`` is generated on access
from its own seed, so a 60000 x 1x28x28 set costs no memory and about 8 us an item
(measured on one CPU core), and item ``i`` is the same in every process and epoch.

Everything derives from ``cfg.seed``. Train and test share the prototypes and use
different label and noise streams.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_mgpu.data.base import Datasets, generated_sizes

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

DEFAULT_INPUT_SHAPE = (1, 28, 28)
DEFAULT_NUM_CLASSES = 10
DEFAULT_NUM_SAMPLES = 4096
# Prototypes are precomputed up to this many floats (64 MiB); beyond, e.g. 1000 classes
# of 3x224x224, each item regenerates its prototype (one more randn per item).
MAX_PRECOMPUTED_PROTOTYPE_ELEMENTS = 16 * 2**20
_TRAIN, _TEST = 0, 1


class SyntheticDataset(Dataset):
    """Prototype-plus-noise samples, generated per item from ``(seed, split, index)``."""

    def __init__(self, num_samples: int, input_shape: tuple, num_classes: int, seed: int, split: int):
        self.input_shape, self.num_classes = tuple(input_shape), num_classes
        # One well-mixed 64-bit base seed per (seed, split, stream); item i uses base + i.
        # Two streams overlap only if their bases lie within num_samples of each other
        # (chance ~ num_samples / 2**64). Prototypes are shared by the splits.
        self._label_base = _base_seed(seed, split, "labels")
        self._noise_base = _base_seed(seed, split, "noise")
        self._prototype_base = _base_seed(seed, _TRAIN, "prototype")
        generator = torch.Generator().manual_seed(self._label_base)
        self.labels = torch.randint(num_classes, (num_samples,), generator=generator)
        self._prototypes: Optional[torch.Tensor] = None
        if num_classes * math.prod(self.input_shape) <= MAX_PRECOMPUTED_PROTOTYPE_ELEMENTS:
            self._prototypes = torch.stack([self._make_prototype(c) for c in range(num_classes)])

    def _make_prototype(self, label: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self._prototype_base + label) % 2**64)
        return torch.randn(self.input_shape, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index %= len(self)
        label = int(self.labels[index])
        prototype = self._prototypes[label] if self._prototypes is not None else self._make_prototype(label)
        generator = torch.Generator().manual_seed((self._noise_base + index) % 2**64)
        noise = torch.randn(self.input_shape, generator=generator)
        return (prototype + noise) * (1 / math.sqrt(2)), label


def _base_seed(seed: int, split: int, stream: str) -> int:
    tag = {"labels": 0, "noise": 1, "prototype": 2}[stream]
    return int(np.random.SeedSequence([seed % 2**63, split, tag]).generate_state(1, np.uint64)[0])


def _settings(cfg: "DataConfig") -> tuple[tuple, int, int]:
    input_shape = tuple(cfg.input_shape) if cfg.input_shape else DEFAULT_INPUT_SHAPE
    num_classes, num_samples = generated_sizes(cfg, "synthetic", "classes", DEFAULT_NUM_CLASSES, DEFAULT_NUM_SAMPLES)
    return input_shape, num_classes, num_samples


def build(cfg: "DataConfig") -> Datasets:
    input_shape, num_classes, num_samples = _settings(cfg)
    train = SyntheticDataset(num_samples, input_shape, num_classes, cfg.seed, _TRAIN)
    test = SyntheticDataset(num_samples // 4, input_shape, num_classes, cfg.seed, _TEST)
    return Datasets(train, test, input_shape, num_classes)


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    input_shape, num_classes, _ = _settings(cfg)
    return input_shape, num_classes
