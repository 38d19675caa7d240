"""Regression: scikit-learn's bundled diabetes data, a small MLP, ``loss="mse"``, ``metrics=["mae"]``.

Run from the repository root (2 data-parallel CPU workers, about a minute on 2 cores)::

    python -m examples.regression

The target is a disease-progression score one year after baseline (442 patients, 10
features), standardised with the training split's mean and std, so predicting the mean
scores a test MAE of about 0.8 (printed as the baseline) and a model that learns scores
clearly less. The dataset has no classes (``num_classes=None``): the run reports
``train_mae``/``test_mae`` and no accuracy.

``fit`` gets the factories as ``"examples.regression:<function>"``; this folder is not an
installed package, so ``fit`` ships it to the Ray workers with the job.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import raytrain_mgpu as rtm
from raytrain_mgpu import Datasets

TRAIN_FRACTION = 0.8
SPLIT_SEED = 0  # the same split in every run, whatever TrainConfig.seed


def _split() -> tuple:
    """``(train_x, train_y, test_x, test_y)`` as float32 arrays, standardised with the train split's statistics."""
    from sklearn.datasets import load_diabetes  # bundled with scikit-learn: no download

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    train, test = order[: int(round(TRAIN_FRACTION * len(y)))], order[int(round(TRAIN_FRACTION * len(y))):]
    x_mean, x_std = x[train].mean(axis=0), x[train].std(axis=0)
    y_mean, y_std = y[train].mean(), y[train].std()
    x, y = ((x - x_mean) / x_std).astype(np.float32), ((y - y_mean) / y_std).astype(np.float32)
    return x[train], y[train], x[test], y[test]


def diabetes(cfg) -> Datasets:
    """The dataset factory: gets the run's ``DataConfig``, returns train and test splits of ``(features, target)``."""
    train_x, train_y, test_x, test_y = _split()
    return Datasets(TensorDataset(torch.from_numpy(train_x), torch.from_numpy(train_y)),
                    TensorDataset(torch.from_numpy(test_x), torch.from_numpy(test_y)),
                    input_shape=(train_x.shape[1],), num_classes=None)  # None: regression, no accuracy


def mlp(input_shape, hidden: int = 32) -> nn.Module:
    """The model factory: gets ``input_shape`` (it names it) and ``hidden`` from ``model_kwargs``; one output."""
    return nn.Sequential(nn.Linear(input_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def baseline_mae() -> float:
    """The test MAE of predicting the training mean (0 after standardising) for every patient."""
    _, _, _, test_y = _split()
    return float(np.abs(test_y).mean())


def main(epochs: int = 20, storage_path: str | None = None, stream=None) -> rtm.TrainResult:
    """Train on 2 CPU workers and print the final test MAE against the baseline; returns the result."""
    cfg = rtm.TrainConfig(
        model="examples.regression:mlp", model_kwargs={"hidden": 32},
        dataset="examples.regression:diabetes",
        loss="mse", metrics=["mae"],
        strategy="ddp", num_workers=2, use_gpu=False, cpus_per_worker=1,
        optimizer="adamw", lr=3e-3, weight_decay=1e-2, batch_size=32, epochs=epochs, seed=0,
        name="regression", storage_path=storage_path or tempfile.mkdtemp(prefix="raytrain-example-"))
    result = rtm.fit(cfg, stream=stream)
    print(f"test_mae {result.metrics['test_mae']:.3f} (predicting the mean: {baseline_mae():.3f}); "
          f"run folder {result.path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--storage-path", default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    main(args.epochs, args.storage_path)
