"""Two inputs, two targets: a model that takes a dict batch and a loss over a dict of heads.

Run from the repository root (about a minute on 2 CPU cores)::

    python -m examples.two_inputs                       # ddp, 2 workers
    python -m examples.two_inputs --strategy pipeline   # 2 pipeline stages, one actor each

Each sample of scikit-learn's bundled digits is given as two inputs, ``{"image": (1, 8, 8),
"profile": (16,)}`` (the image, and its row and column ink sums: a second view a tabular
branch reads), with two targets, ``{"digit": class, "odd": 0. or 1.}``. The model returns
``{"digit": logits, "odd": logit}``; the loss is cross-entropy on the digit plus binary
cross-entropy on odd/even, and the metrics are both accuracies.

What the trainer does with such batches (``raytrain_mgpu.engine.batches``): a dict input is passed
as keyword arguments, ``model(image=..., profile=...)``; every tensor goes to the device and
is split along dim 0 by the strategies and into the pipeline's micro-batches; the loss and
metrics get the outputs and targets as dicts. For the pipeline the model lists its blocks
(``blocks()``): the first takes the two inputs, the activations between stages are one tensor.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import raytrain_mgpu as rtm
from raytrain_mgpu import Datasets

TEST_FRACTION = 0.2
SPLIT_SEED = 0


class TwoViews(Dataset):
    """``({"image", "profile"}, {"digit", "odd"})`` samples of the digits."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images = torch.from_numpy(images).float().div(16.0).reshape(-1, 1, 8, 8)
        self.profiles = torch.cat([self.images.sum(dim=3), self.images.sum(dim=2)], dim=2).reshape(-1, 16) / 8
        self.labels = torch.from_numpy(labels).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        label = self.labels[i]
        return ({"image": self.images[i], "profile": self.profiles[i]},
                {"digit": label, "odd": (label % 2).float()})


def digit_views(cfg) -> Datasets:
    """The dataset factory: the same 80/20 split of the 1,797 digits in every run."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    cut = int(round((1 - TEST_FRACTION) * len(labels)))
    train, test = order[:cut], order[cut:]
    return Datasets(TwoViews(images[train], labels[train]), TwoViews(images[test], labels[test]),
                    input_shape={"image": (1, 8, 8), "profile": (16,)}, num_classes=10)


class Fuse(nn.Module):
    """The first block: a conv branch for the image and a linear branch for the profile, concatenated."""

    def __init__(self, hidden: int):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, hidden))
        self.profile = nn.Linear(16, hidden)

    def forward(self, image: torch.Tensor, profile: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.image(image), self.profile(profile)], dim=1).relu()


class Heads(nn.Module):
    def __init__(self, hidden: int, num_classes: int):
        super().__init__()
        self.digit, self.odd = nn.Linear(hidden, num_classes), nn.Linear(hidden, 1)

    def forward(self, h: torch.Tensor) -> dict:
        return {"digit": self.digit(h), "odd": self.odd(h).squeeze(1)}


class TwoInputNet(nn.Module):
    """``forward(image, profile) -> {"digit", "odd"}``, and ``blocks()`` so that it splits into stages."""

    def __init__(self, num_classes: int, hidden: int = 32):
        super().__init__()
        self.fuse = Fuse(hidden)
        self.trunk = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU())
        self.heads = Heads(hidden, num_classes)

    def forward(self, image: torch.Tensor, profile: torch.Tensor) -> dict:
        return self.heads(self.trunk(self.fuse(image, profile)))

    def blocks(self) -> list:
        return [self.fuse, self.trunk, self.heads]


def two_input_net(num_classes: int, hidden: int = 32) -> nn.Module:
    """The model factory: names ``num_classes``; ``hidden`` comes from ``model_kwargs``."""
    return TwoInputNet(num_classes, hidden)


def digit_and_parity(outputs: dict, targets: dict) -> torch.Tensor:
    """The loss: mean cross-entropy on the digit plus mean binary cross-entropy on odd/even."""
    return (F.cross_entropy(outputs["digit"], targets["digit"])
            + F.binary_cross_entropy_with_logits(outputs["odd"], targets["odd"]))


def digit_accuracy(outputs: dict, targets: dict):
    return (outputs["digit"].argmax(dim=1) == targets["digit"]).sum(), targets["digit"].numel()


def parity_accuracy(outputs: dict, targets: dict):
    return ((outputs["odd"] > 0).float() == targets["odd"]).sum(), targets["odd"].numel()


def config(strategy: str = "ddp", epochs: int = 6, storage_path: str | None = None) -> rtm.TrainConfig:
    layout = {"pipeline": {"num_workers": 1, "num_stages": 2, "num_microbatches": 4},
              "dp_balanced": {"num_workers": 1, "gpus_per_worker": 2}}.get(strategy, {"num_workers": 2})
    return rtm.TrainConfig(
        model="examples.two_inputs:two_input_net", model_kwargs={"hidden": 32},
        dataset="examples.two_inputs:digit_views",
        loss="examples.two_inputs:digit_and_parity",
        metrics=["examples.two_inputs:digit_accuracy", "examples.two_inputs:parity_accuracy"],
        strategy=strategy, use_gpu=False, cpus_per_worker=1, **layout,
        optimizer="adamw", lr=3e-3, batch_size=64, epochs=epochs, seed=0,
        name=f"two-inputs-{strategy}", storage_path=storage_path or tempfile.mkdtemp(prefix="raytrain-example-"))


def main(strategy: str = "ddp", epochs: int = 6, storage_path: str | None = None, stream=None) -> rtm.TrainResult:
    """Train and print both test accuracies; returns the result."""
    result = rtm.fit(config(strategy, epochs, storage_path), stream=stream)
    print(f"{strategy}: test_digit_accuracy {result.metrics['test_digit_accuracy']:.3f}  "
          f"test_parity_accuracy {result.metrics['test_parity_accuracy']:.3f}; run folder {result.path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "dp_balanced", "fsdp", "pipeline"])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--storage-path", default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    main(args.strategy, args.epochs, args.storage_path)
