"""What every reader shares: the :class:`Datasets` a builder returns, the one pixel
normalisation (:class:`PixelNormaliser`), compact ``uint8`` image arrays
(:class:`ImageArrayDataset`) and the file helpers of downloadable datasets.

The readers (``digits``, ``cifar10``, ...) import from here, never from the package
``raytrain_mgpu.data``, which imports them: no cycle. The package re-exports these names.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["Datasets", "ImageArrayDataset", "PixelNormaliser", "data_root_folder", "find_files", "find_or_download",
           "download_with_torchvision", "split_validation", "validation_size"]

logger = logging.getLogger(__name__)


class Datasets(NamedTuple):
    """What a dataset builder returns."""

    train: Dataset
    """Map-style; an item is ``(x, y)``: a tensor and a class index, or tensors, tuples or dicts of
    tensors for either (``raytrain_mgpu.engine.batches``: a dict ``x`` is passed to the model as keyword arguments)."""
    test: Dataset
    input_shape: tuple
    """Shape of one ``x``, e.g. ``(1, 8, 8)``; for a dict (or tuple) ``x``, a dict (tuple) of shapes."""
    num_classes: Optional[int]
    """Classes of a classification dataset; None for anything else (then no ``accuracy`` by default)."""
    val: Optional[Dataset] = None
    """The validation split, if any: what ``monitor``, ``keep_best`` and early stopping rank epochs on
    (``TrainConfig.val_fraction`` holds one out of ``train`` instead: :func:`split_validation`)."""
    seq_len: Optional[int] = None
    """A language model's tokens per sample (``text``, ``synthetic_text``, ``text_file``): the epoch rows then add
    ``tokens_per_s`` and, with the ``cross_entropy`` loss, ``perplexity`` (``engine/loop.py``)."""


def validation_size(train_size: int, fraction: float) -> int:
    """Samples ``val_fraction`` holds out of a training split of ``train_size`` (at least one)."""
    return max(1, round(train_size * fraction))


def split_validation(train: Dataset, fraction: float, seed: int) -> Tuple[Dataset, Dataset]:
    """``(train, val)``: ``fraction`` of ``train``'s samples, drawn by ``seed``, held out as validation.

    Done once on the whole split, before any worker takes its shard, so every worker count trains and
    validates on the same samples; each part keeps the reader's order (sorted indices), so a reader
    that loads rows in ranges (Parquet) still does."""
    size = len(train)
    held_out = validation_size(size, fraction)
    if held_out >= size:
        raise ValueError(f"TrainConfig.val_fraction={fraction}: holds out {held_out} of the training split's {size} "
                         f"samples, leaving none to train on. Lower val_fraction, or use more data.")
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(train, sorted(order[held_out:])), Subset(train, sorted(order[:held_out]))


class PixelNormaliser:
    """``(pixels / max_value - mean) / std`` in float32, per channel when ``mean`` has one
    value per channel.

    Every reader (original files and their Parquet conversion) goes through this one
    function, so a model trained on one source sees bit-identical inputs from the other.
    """

    def __init__(self, max_value: float, mean: Sequence[float], std: Sequence[float], shape: tuple):
        mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        if len(mean) != len(std) or not mean:
            raise ValueError(f"normalisation mean={mean} and std={std} must be non-empty and of the same "
                             f"length. Give one value, or one per channel.")
        per_channel = len(mean) > 1
        if per_channel and (len(shape) < 2 or shape[0] != len(mean)):
            raise ValueError(f"normalisation has {len(mean)} values but samples of shape {shape} have "
                             f"{shape[0] if shape else 0} channels. Give one value, or one per channel.")
        view = (len(mean),) + (1,) * (len(shape) - 1) if per_channel else ()
        self.max_value, self.mean_values, self.std_values = float(max_value), mean, std
        self._mean = torch.tensor(mean, dtype=torch.float32).reshape(view)
        self._std = torch.tensor(std, dtype=torch.float32).reshape(view)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalise one sample or a batch (leading batch dimension broadcasts)."""
        # One fresh float32 copy, then in place: a third of the memory traffic of
        # `(x / m - mean) / std`, which allocates a temporary per operation.
        return pixels.to(torch.float32, copy=True).div_(self.max_value).sub_(self._mean).div_(self._std)


class ImageArrayDataset(Dataset):
    """Images held as a compact ``uint8`` array ``(N, *shape)``, normalised per item.

    Holding ``uint8`` and normalising on access costs a few microseconds per item and
    keeps a quarter of the memory of a float32 copy (CIFAR-10 train: 150 MiB vs 600 MiB),
    which matters because every worker holds its own copy. ``convert_to_parquet`` writes
    ``images`` unchanged, so the Parquet copy normalises identically.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, normaliser: PixelNormaliser):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels; they must match one to one.")
        self.images = np.ascontiguousarray(images)
        if not self.images.flags.writeable:  # torch.from_numpy warns on read-only memory
            self.images = self.images.copy()
        self.labels = np.asarray(labels, dtype=np.int64)
        self.normaliser = normaliser

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.normaliser(torch.from_numpy(self.images[index])), int(self.labels[index])

    def __getitems__(self, indices: Sequence[int]) -> list:
        # DataLoader calls this for a whole batch: one gather and one normalisation
        # instead of one per item.
        indices = np.asarray(indices, dtype=np.int64)
        batch = self.normaliser(torch.from_numpy(self.images[indices]))
        return list(zip(batch.unbind(0), self.labels[indices].tolist()))


# ----------------------------------------------------------------------------- file helpers
# Shared by the readers of downloadable datasets (fashion_mnist, cifar10).


def data_root_folder(cfg: "DataConfig", what: str) -> str:
    """``cfg.data_root`` as an absolute local path, or a ValueError saying what to put there."""
    if not cfg.data_root:
        raise ValueError(f"TrainConfig.data_root=None: dataset {cfg.dataset!r} reads {what} from a "
                         f"folder. Set data_root to that folder (download=True fetches the files into it).")
    return os.path.abspath(os.path.expanduser(cfg.data_root))


def find_files(dataset: str, folders: Sequence[str], names: Sequence[str], allow_gz: bool,
               download_hint: str) -> dict[str, str]:
    """Map each file name to its path in the first folder holding it (``name`` preferred
    over ``name.gz``); a ValueError lists every missing file and every folder searched."""
    found, missing = {}, []
    for name in names:
        candidates = [name, name + ".gz"] if allow_gz else [name]
        paths = [os.path.join(f, c) for c in candidates for f in folders]
        path = next((p for p in paths if os.path.isfile(p)), None)
        if path is None:
            missing.append(name + ("[.gz]" if allow_gz else ""))
        else:
            found[name] = path
    if missing:
        raise ValueError(f"{dataset}: missing file(s) {', '.join(missing)}; searched folder(s) "
                         f"{', '.join(folders)}. Copy the files into one of these folders, or set "
                         f"download=True to fetch them with torchvision (needs internet). {download_hint}")
    return found


def find_or_download(cfg: "DataConfig", dataset: str, class_name: str, root: str, folders: Sequence[str],
                     names: Sequence[str], allow_gz: bool, download_hint: str) -> dict[str, str]:
    """:func:`find_files` in ``folders``; with files missing and ``cfg.download``, fetched first with
    ``torchvision.datasets.<class_name>`` into ``root`` (``cfg.data_root``: :func:`data_root_folder`)."""
    try:
        return find_files(dataset, folders, names, allow_gz=allow_gz, download_hint=download_hint)
    except ValueError:
        if not cfg.download:
            raise
    download_with_torchvision(dataset, class_name, root, where=" or ".join(folders))
    return find_files(dataset, folders, names, allow_gz=allow_gz, download_hint=download_hint)


def download_with_torchvision(dataset: str, class_name: str, root: str, where: str) -> None:
    """Fetch a dataset into ``root`` with ``torchvision.datasets.<class_name>``.

    A file lock makes concurrent callers on one machine (several workers) download once.
    """
    # late: torchvision.datasets is ~1 s of import, only when downloading (filelock: a torch dependency)
    import filelock
    import torchvision.datasets

    logger.info("%s: downloading into %s with torchvision", dataset, root)
    try:
        os.makedirs(root, exist_ok=True)
        with filelock.FileLock(os.path.join(root, f".{dataset}.download.lock")):
            getattr(torchvision.datasets, class_name)(root, train=True, download=True)
    except Exception as exc:  # torchvision raises RuntimeError, URLError, OSError, ...
        raise ValueError(f"{dataset}: download into {root} failed ({type(exc).__name__}: {exc}). The "
                         f"machine may be offline. Put the files by hand into {where} and run again "
                         f"(download=False is then enough).") from exc


def generated_sizes(cfg: "DataConfig", dataset: str, classes: str, default_classes: int,
                    default_samples: int) -> Tuple[int, int]:
    """``(num_classes, num_samples)`` of a generated dataset (``synthetic``, ``synthetic_text``), checked:
    a test split of a quarter needs 4 samples, a loss over classes 2 of them (``classes``: what they are)."""
    num_classes = cfg.num_classes or default_classes
    num_samples = cfg.num_samples or default_samples
    if num_samples < 4:
        raise ValueError(f"TrainConfig.num_samples={num_samples}: {dataset} needs at least 4 samples (the test "
                         f"split is a quarter). Set num_samples to 4 or more.")
    if num_classes < 2:
        raise ValueError(f"TrainConfig.num_classes={num_classes}: {dataset} needs at least 2 {classes}. Set "
                         f"num_classes to 2 or more.")
    return num_classes, num_samples
