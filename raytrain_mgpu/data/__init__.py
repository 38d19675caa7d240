"""Datasets: one registry name -> one builder, plus the cheap driver-side check.

A builder takes the ``DataConfig`` section and returns :class:`Datasets` (train and test
map-style datasets, the shape of one sample and the number of classes). Every Ray worker
calls :func:`build_datasets` itself, so builders read files lazily or from compact
``uint8`` arrays rather than holding float copies.

:func:`check_data` runs on the driver before Ray starts: it checks that files exist and
that their headers are valid, and returns ``(input_shape, num_classes)`` so models can be
sized, without reading whole datasets.

Besides registry names, ``dataset`` may be ``"package.module:function"``: a user factory
called as ``function(cfg)`` that returns :class:`Datasets`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from raytrain_mgpu.config import DataConfig

__all__ = ["Datasets", "DATASETS", "ImageArrayDataset", "PixelNormaliser", "dataset_names",
           "check_dataset_name", "build_datasets", "check_data"]

logger = logging.getLogger(__name__)


class Datasets(NamedTuple):
    """What a dataset builder returns."""

    train: Dataset
    """Map-style; an item is ``(x: torch.Tensor, y: int)``."""
    test: Dataset
    input_shape: tuple
    """Shape of one ``x``, e.g. ``(1, 8, 8)``."""
    num_classes: int


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


def download_with_torchvision(dataset: str, class_name: str, root: str, where: str) -> None:
    """Fetch a dataset into ``root`` with ``torchvision.datasets.<class_name>``.

    A file lock makes concurrent callers on one machine (several workers) download once.
    """
    import filelock  # a torch dependency
    import torchvision.datasets  # ~1 s import; only when downloading

    logger.info("%s: downloading into %s with torchvision", dataset, root)
    try:
        os.makedirs(root, exist_ok=True)
        with filelock.FileLock(os.path.join(root, f".{dataset}.download.lock")):
            getattr(torchvision.datasets, class_name)(root, train=True, download=True)
    except Exception as exc:  # torchvision raises RuntimeError, URLError, OSError, ...
        raise ValueError(f"{dataset}: download into {root} failed ({type(exc).__name__}: {exc}). The "
                         f"machine may be offline. Put the files by hand into {where} and run again "
                         f"(download=False is then enough).") from exc


# Builders import Datasets/ImageArrayDataset from this module, so they are imported only
# after those are defined.
from raytrain_mgpu.data import cifar10, digits, fashion_mnist, parquet, synthetic, text  # noqa: E402

DATASETS: dict[str, Callable[["DataConfig"], Datasets]] = {
    "digits": digits.build,
    "synthetic": synthetic.build,
    "fashion_mnist": fashion_mnist.build,
    "cifar10": cifar10.build,
    "parquet": parquet.build,
    # --- text datasets (raytrain_mgpu/data/text.py), registered by that module's author
    "synthetic_text": text.build_synthetic_text,
    "text_file": text.build_text_file,
}
"""Registry name -> builder(cfg) -> Datasets."""

# Cheap driver-side checks: name -> check(cfg) -> (input_shape, num_classes). A dataset
# without an entry is checked by building it, which is fine when building is cheap
# (synthetic data) but reads everything otherwise: add a check for file-backed datasets.
_CHECKS: dict[str, Callable[["DataConfig"], tuple]] = {
    "digits": digits.check,
    "synthetic": synthetic.check,
    "fashion_mnist": fashion_mnist.check,
    "cifar10": cifar10.check,
    "parquet": parquet.check,
    "synthetic_text": text.check_synthetic_text,
    "text_file": text.check_text_file,
}


def dataset_names() -> list[str]:
    """Registry names, sorted."""
    return sorted(DATASETS)


def check_dataset_name(name: str) -> None:
    """Raise ``ValueError`` for an unknown registry name; ``pkg.module:function`` passes
    without being imported (it may only be importable on the workers)."""
    if ":" in name or name in DATASETS:
        return
    raise ValueError(f"TrainConfig.dataset={name!r}: unknown dataset. Valid names: "
                     f"{', '.join(dataset_names())}; or write 'package.module:function' for your "
                     f"own factory that takes the DataConfig and returns raytrain_mgpu.data.Datasets.")


def _import_factory(spec: str) -> Callable:
    from raytrain_mgpu._factory import load_factory

    return load_factory(spec, "dataset")


def build_datasets(cfg: "DataConfig") -> Datasets:
    """Build train and test datasets for a registry name or a ``pkg.module:function``."""
    check_dataset_name(cfg.dataset)
    if ":" not in cfg.dataset:
        return DATASETS[cfg.dataset](cfg)
    result = _import_factory(cfg.dataset)(cfg)
    if not isinstance(result, Datasets):
        raise ValueError(f"TrainConfig.dataset={cfg.dataset!r}: the factory returned "
                         f"{type(result).__name__}, not raytrain_mgpu.data.Datasets. Return "
                         f"Datasets(train, test, input_shape, num_classes).")
    return result


def check_data(cfg: "DataConfig") -> tuple[tuple, int]:
    """Cheap driver-side check before Ray starts; returns ``(input_shape, num_classes)``.

    Registered file-backed datasets only look at file headers and metadata (and download
    missing files first when ``download=True``). User factories are called once here, so
    a broken factory fails on the driver rather than on every worker.
    """
    check_dataset_name(cfg.dataset)
    check = _CHECKS.get(cfg.dataset)
    if check is not None:
        input_shape, num_classes = check(cfg)
    else:
        built = build_datasets(cfg)
        input_shape, num_classes = built.input_shape, built.num_classes
    logger.debug("dataset %s: input_shape=%s num_classes=%d", cfg.dataset, input_shape, num_classes)
    return tuple(input_shape), int(num_classes)
