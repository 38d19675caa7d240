"""Contrastive learning under ``ddp2``: InfoNCE with in-batch negatives over a node's whole batch.

Run from the repository root (2 workers, each standing in for a node with 2 CPU "devices";
about a minute on 2 cores)::

    python -m examples.contrastive

Each sample is two augmented views (a random shift of up to one pixel, pixel noise, random
dropped pixels) of one of scikit-learn's bundled 8x8 digits. An MLP embeds every view;
InfoNCE asks each first view to pick its own second view among the batch's second views,
so the other samples of the batch are its negatives. The loss therefore needs the batch
at once: under ``ddp2`` each worker (a node) scatters its batch over its devices,
gathers the embeddings and computes the loss once on the node's whole batch (``ddp``
would compute it per GPU, ``dp_balanced`` per device, each with fewer negatives).

How two views reach the model when a batch is one input tensor and one target tensor: they
are stacked in the input, ``input_shape=(2, 64)``; the model embeds both
(``(N, 2, 64) -> (N, 2, dim)``) and the loss and metric split them (``outputs[:, 0]``,
``outputs[:, 1]``). Structured batches (tuples or dicts of tensors) are not supported yet.
The targets are the digits' labels: InfoNCE ignores them; the ``same_digit`` metric reads them.

Metrics are ``(sum, count)`` pairs, so the epoch values are exact over workers and devices:

- ``retrieval_accuracy``: the share of first views whose nearest second view in the batch is
  their own (chance is 1 / the node batch: 1/64 here);
- ``same_digit``: the share whose nearest second view shows the same digit (chance about 0.1).
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

PIXELS = 64
TEMPERATURE = 0.1
TRAIN_FRACTION = 0.8
SPLIT_SEED = 0  # the same split in every run
TEST_VIEWS_SEED = 1  # the test split's views are drawn once: every evaluation sees the same pairs


def augment(images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random view of each ``(N, 8, 8)`` image in [0, 1]: shifted by up to a pixel, noisy, some pixels dropped."""
    n = len(images)
    padded = F.pad(images, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (2, n), generator=generator)
    rows = (dy[:, None] + torch.arange(8))[:, :, None]  # (N, 8, 1)
    cols = (dx[:, None] + torch.arange(8))[:, None, :]  # (N, 1, 8)
    shifted = padded[torch.arange(n)[:, None, None], rows, cols]
    noisy = shifted + 0.1 * torch.randn(shifted.shape, generator=generator)
    kept = torch.rand(shifted.shape, generator=generator) > 0.1
    return (noisy * kept).reshape(n, PIXELS)


class TwoViews(Dataset):
    """Items ``(views: (2, 64) float32, label)``; new random views on every access, or fixed ones with ``seed``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, seed: int | None = None):
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0)  # digits' pixels are 0..16
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.fixed = None
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
            self.fixed = torch.stack([augment(self.images, generator), augment(self.images, generator)], dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if self.fixed is not None:
            return self.fixed[index], self.labels[index]
        image = self.images[index].expand(2, 8, 8)  # the workers seed torch's generator: runs repeat
        return augment(image), self.labels[index]


def digit_views(cfg) -> Datasets:
    """The dataset factory: pairs of views of the digits, 80/20 split; no classes (the loss is not a classifier's)."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(bunch.target))
    cut = int(round(TRAIN_FRACTION * len(order)))
    images, labels = bunch.images, bunch.target
    return Datasets(TwoViews(images[order[:cut]], labels[order[:cut]]),
                    TwoViews(images[order[cut:]], labels[order[cut:]], seed=TEST_VIEWS_SEED),
                    input_shape=(2, PIXELS), num_classes=None)


class PairEncoder(nn.Module):
    """Embeds both views of each sample with one MLP: ``(N, 2, 64) -> (N, 2, dim)``, unit length."""

    def __init__(self, pixels: int, hidden: int, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(pixels, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dim))

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        n, num_views, pixels = views.shape
        return F.normalize(self.mlp(views.reshape(n * num_views, pixels)), dim=1).reshape(n, num_views, -1)


def encoder(input_shape, hidden: int = 128, dim: int = 32) -> nn.Module:
    """The model factory: ``input_shape`` is ``(2, 64)``; ``hidden`` and ``dim`` come from ``model_kwargs``."""
    return PairEncoder(input_shape[1], hidden, dim)


def _similarities(outputs: torch.Tensor) -> torch.Tensor:
    """``(N, N)``: first view i against second view j (the embeddings are unit length)."""
    return outputs[:, 0] @ outputs[:, 1].T


def info_nce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss: each first view's positive is its own second view, the batch's others are negatives (and back)."""
    logits = _similarities(outputs) / TEMPERATURE
    own = torch.arange(len(outputs), device=outputs.device)
    return (F.cross_entropy(logits, own) + F.cross_entropy(logits.T, own)) / 2


def retrieval_accuracy(outputs: torch.Tensor, targets: torch.Tensor):
    """``(sum, count)``: first views whose nearest second view in the batch is their own."""
    own = torch.arange(len(outputs), device=outputs.device)
    return (_similarities(outputs).argmax(dim=1) == own).sum(), len(outputs)


def same_digit(outputs: torch.Tensor, targets: torch.Tensor):
    """``(sum, count)``: first views whose nearest second view in the batch shows the same digit."""
    return (targets[_similarities(outputs).argmax(dim=1)] == targets).sum(), len(outputs)


def main(epochs: int = 15, storage_path: str | None = None, stream=None) -> rtm.TrainResult:
    """Train with ``ddp2`` (2 workers x 2 CPU stand-in devices) and print the test retrieval accuracy."""
    cfg = rtm.TrainConfig(
        model="examples.contrastive:encoder", model_kwargs={"hidden": 128, "dim": 32},
        dataset="examples.contrastive:digit_views",
        loss="examples.contrastive:info_nce",
        metrics=["examples.contrastive:retrieval_accuracy", "examples.contrastive:same_digit"],
        strategy="ddp2", num_workers=2, gpus_per_worker=2, use_gpu=False, cpus_per_worker=1,
        optimizer="adamw", lr=3e-3, batch_size=128, epochs=epochs, seed=0,
        name="contrastive", storage_path=storage_path or tempfile.mkdtemp(prefix="raytrain-example-"))
    result = rtm.fit(cfg, stream=stream)
    node_batch = cfg.batch_size // cfg.num_workers
    print(f"test_retrieval_accuracy {result.metrics['test_retrieval_accuracy']:.3f} (chance about "
          f"1/{node_batch} = {1 / node_batch:.3f}), test_same_digit {result.metrics['test_same_digit']:.3f}; "
          f"run folder {result.path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--storage-path", default=None, help="default: a new temporary folder")
    args = parser.parse_args()
    main(args.epochs, args.storage_path)
