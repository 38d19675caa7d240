"""``digits``: scikit-learn's bundled handwritten digits (1797 images, 8x8, values 0..16).

The offline default: it ships inside scikit-learn, so it needs no download. Pixels are
kept as ``uint8`` 0..16 and normalised as ``(p / 16 - MEAN) / STD``.

The train/test split (80/20) comes from a fixed permutation with seed 0, independent of
``cfg.seed``, so the test set is the same in every run and accuracies are comparable.
"""

from __future__ import annotations

import gzip
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raytrain_mgpu.data.base import Datasets, ImageArrayDataset, PixelNormaliser

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

logger = logging.getLogger(__name__)

INPUT_SHAPE = (1, 8, 8)
NUM_CLASSES = 10
MAX_VALUE = 16
# Mean and std of the train split's pixels scaled to [0, 1] (tests recompute them).
MEAN = (0.3054,)
STD = (0.3760,)
TRAIN_FRACTION = 0.8
SPLIT_SEED = 0


def normaliser() -> PixelNormaliser:
    return PixelNormaliser(MAX_VALUE, MEAN, STD, INPUT_SHAPE)


def bundled_csv() -> Path:
    """scikit-learn's own copy of the digits (``sklearn/datasets/data/digits.csv.gz``: 64 pixels
    and the label per row), found without importing scikit-learn: its import costs every
    training process about 0.7 s of CPU (measured on a 2-core machine), for a 1797-row file."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("dataset 'digits' ships inside scikit-learn, which is not installed here: "
                                  "pip install scikit-learn (a dependency of raytrain-mgpu)")
    return Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_images, train_labels, test_images, test_labels)`` as uint8 / int64 arrays:
    ``sklearn.datasets.load_digits()``'s rows and order (tests/test_data.py compares them)."""
    with gzip.open(bundled_csv()) as csv:
        rows = np.loadtxt(csv, delimiter=",")
    images = rows[:, :-1].astype(np.uint8).reshape(-1, *INPUT_SHAPE)  # values are whole 0..16
    labels = rows[:, -1].astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    num_train = int(round(TRAIN_FRACTION * len(labels)))
    train, test = order[:num_train], order[num_train:]
    return images[train], labels[train], images[test], labels[test]


def build(cfg: "DataConfig") -> Datasets:
    train_x, train_y, test_x, test_y = load_split()
    logger.debug("digits: %d train / %d test images", len(train_y), len(test_y))
    norm = normaliser()
    return Datasets(ImageArrayDataset(train_x, train_y, norm), ImageArrayDataset(test_x, test_y, norm),
                    INPUT_SHAPE, NUM_CLASSES)


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    """Nothing to read: the data ships with scikit-learn."""
    return INPUT_SHAPE, NUM_CLASSES
