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

import importlib
import logging
from typing import TYPE_CHECKING, Callable

from raytrain_mgpu.config.names import did_you_mean
from raytrain_mgpu.config.factories import code_name, is_factory, load_factory
from raytrain_mgpu.data.lm_fields import check_text_fields
from raytrain_mgpu.data.ray_datasets import RayDataSplits, check_fields, is_ray_datasets  # no torch, no Ray
from raytrain_mgpu.data.transforms import (TransformedDataset, build_transform, check_transform_spec,
                                           transformed_shape)  # no torch until a transform is built

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig
    from raytrain_mgpu.data.base import Datasets

__all__ = ["Datasets", "DATASETS", "ImageArrayDataset", "PixelNormaliser", "dataset_names",
           "check_dataset_name", "check_data_fields", "build_datasets", "check_data"]

logger = logging.getLogger(__name__)

# Defined in data/base.py, where the readers import them from (they would form a cycle
# with this package, which registers them); loaded on first use (PEP 562), because they
# need torch and the registry's name check, which TrainConfig runs, does not.
_BASE_NAMES = frozenset({"Datasets", "ImageArrayDataset", "PixelNormaliser", "data_root_folder", "find_files",
                         "find_or_download", "download_with_torchvision", "split_validation", "validation_size"})


def __getattr__(name: str):
    if name in _BASE_NAMES:
        from raytrain_mgpu.data import base  # late: loads torch (see above)

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | _BASE_NAMES)


class _Reader:
    """``function`` of the reader module ``raytrain_mgpu.data.<module>``, imported on the
    first call: the registry costs no import of torch, pyarrow or scikit-learn."""

    __slots__ = ("module", "function")

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function

    def __call__(self, cfg: "DataConfig"):
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), self.function)(cfg)

    def __repr__(self) -> str:
        return f"<reader {__name__}.{self.module}.{self.function}>"


DATASETS: dict[str, Callable[["DataConfig"], "Datasets"]] = {
    "digits": _Reader("digits", "build"),
    "synthetic": _Reader("synthetic", "build"),
    "fashion_mnist": _Reader("fashion_mnist", "build"),
    "cifar10": _Reader("cifar10", "build"),
    "parquet": _Reader("parquet", "build"),
    # --- text datasets (raytrain_mgpu/data/text.py), registered by that module's author
    "synthetic_text": _Reader("text", "build_synthetic_text"),
    "text_file": _Reader("text", "build_text_file"),
    "text": _Reader("lm_text", "build"),  # Parquet or JSONL documents, tokenized and packed (data/lm_text.py)
}
"""Registry name -> builder(cfg) -> Datasets."""

# Cheap driver-side checks: name -> check(cfg) -> (input_shape, num_classes). A dataset
# without an entry is checked by building it, which is fine when building is cheap
# (synthetic data) but reads everything otherwise: add a check for file-backed datasets.
_CHECKS: dict[str, Callable[["DataConfig"], tuple]] = {
    "digits": _Reader("digits", "check"),
    "synthetic": _Reader("synthetic", "check"),
    "fashion_mnist": _Reader("fashion_mnist", "check"),
    "cifar10": _Reader("cifar10", "check"),
    "parquet": _Reader("parquet", "check"),
    "synthetic_text": _Reader("text", "check_synthetic_text"),
    "text_file": _Reader("text", "check_text_file"),
    "text": _Reader("lm_text", "check"),
}


def dataset_names() -> list[str]:
    """Registry names, sorted."""
    return sorted(DATASETS)


def check_dataset_name(name) -> None:
    """Raise ``ValueError`` for an unknown registry name; ``pkg.module:function`` passes
    without being imported (it may only be importable on the workers), as does a function from Python."""
    if is_factory(name) or is_ray_datasets(name) or name in DATASETS:
        return
    raise ValueError(f"TrainConfig.dataset={name!r}: unknown dataset.{did_you_mean(name, DATASETS)} Valid names: "
                     f"{', '.join(dataset_names())}; or write 'package.module:function' for your "
                     f"own factory that takes the DataConfig and returns raytrain_mgpu.data.Datasets.")


def check_data_fields(cfg) -> None:
    """The ``TrainConfig`` fields this package reads, checked before Ray starts (``config_checks.validate``):
    the dataset name, the loader workers (``engine/loaders.py``) and the transform specs (parsed, not built)."""
    check_dataset_name(cfg.dataset)
    check_text_fields(cfg)  # text_column, tokenizer, seq_len (the text dataset's)
    check_fields(cfg)  # a dict of Ray Datasets: its splits, collate, what does not apply to it
    if cfg.collate is not None and not (is_ray_datasets(cfg.dataset) or isinstance(cfg.dataset, RayDataSplits)):
        raise ValueError(f"TrainConfig.collate={code_name(cfg.collate)!r} is read with Ray Datasets only "
                         f"(dataset={{'train': ds, 'test': ds}}); the other datasets give (inputs, targets) samples "
                         f"that the DataLoader batches. Leave collate unset.")
    workers, factor = cfg.loader_workers, cfg.prefetch_factor
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"TrainConfig.loader_workers={workers!r}: must be an integer >= 0. Set 0 to load in "
                         f"the training process, or a few loader processes per worker, e.g. 2.")
    if factor is not None and (not isinstance(factor, int) or isinstance(factor, bool) or factor < 1):
        raise ValueError(f"TrainConfig.prefetch_factor={factor!r}: must be a positive integer or None. Set the "
                         f"batches each loader worker reads ahead, e.g. 2, or leave it unset.")
    if factor is not None and workers == 0:
        raise ValueError(f"TrainConfig.prefetch_factor={factor!r}: only applies with loader_workers > 0 (torch "
                         f"refuses it without workers). Set loader_workers, or leave prefetch_factor unset.")
    if not isinstance(cfg.persistent_workers, bool):
        raise ValueError(f"TrainConfig.persistent_workers={cfg.persistent_workers!r}: must be true or false. "
                         f"Write persistent_workers: true or false (YAML booleans, not quoted strings).")
    for name in ("train_transform", "test_transform"):
        check_transform_spec(name, getattr(cfg, name))


def _import_factory(spec) -> Callable:
    return load_factory(spec, "dataset")


def build_datasets(cfg: "DataConfig") -> "Datasets":
    """Build the splits for a registry name or a ``pkg.module:function``: ``val_fraction`` held out of the
    training split, the config's per-sample transforms (``data/transforms.py``) around each split (the
    validation split gets the test split's: it is evaluated, never augmented)."""
    built = _build_untransformed(cfg)
    if cfg.val_fraction is not None:
        from raytrain_mgpu.data.base import split_validation  # late: loads torch; the name check needs none

        if built.val is not None:
            raise ValueError(f"TrainConfig.val_fraction={cfg.val_fraction}: dataset {code_name(cfg.dataset)!r} "
                             f"returns a validation split of its own. Leave val_fraction unset to use it.")
        train, val = split_validation(built.train, cfg.val_fraction, cfg.seed)
        built = built._replace(train=train, val=val)
    if not (cfg.train_transform or cfg.test_transform):
        return built
    input_shape = transformed_shape(cfg.train_transform, cfg.test_transform, built.input_shape)
    train, test, val = built.train, built.test, built.val
    if cfg.train_transform:
        train = TransformedDataset(train, build_transform(cfg.train_transform, built.input_shape,
                                                          "train_transform")[0], cfg.seed)
    if cfg.test_transform:  # the evaluated splits keep epoch 0: every evaluation sees the same inputs
        transform = build_transform(cfg.test_transform, built.input_shape, "test_transform")[0]
        test = TransformedDataset(test, transform, cfg.seed)
        val = None if val is None else TransformedDataset(val, transform, cfg.seed)
    return built._replace(train=train, test=test, val=val, input_shape=input_shape)


def _build_untransformed(cfg: "DataConfig") -> "Datasets":
    from raytrain_mgpu.data.base import Datasets  # late: loads torch; the name check needs none

    check_dataset_name(cfg.dataset)
    if not is_factory(cfg.dataset):
        return DATASETS[cfg.dataset](cfg)
    result = _import_factory(cfg.dataset)(cfg)
    if not isinstance(result, Datasets):
        raise ValueError(f"TrainConfig.dataset={code_name(cfg.dataset)!r}: the factory returned "
                         f"{type(result).__name__}, not raytrain_mgpu.data.Datasets. Return "
                         f"Datasets(train, test, input_shape, num_classes).")
    return result


def _check_data_root_exists(cfg: "DataConfig") -> None:
    """A local ``data_root`` that does not exist is said so (a reader would list the files it misses in it, which
    reads as if the folder were there); ``download=True`` creates it. A URI is the reader's to check."""
    root = cfg.data_root
    if root is None or "://" in root or cfg.download:
        return
    from pathlib import Path

    path = Path(root).expanduser()
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), None)
        raise ValueError(f"TrainConfig.data_root={root!r}: no such file or folder ({path.resolve()}"
                         f"{f'; the nearest folder that exists is {parent}' if parent is not None else ''}). "
                         f"Check the path (relative paths are from {Path.cwd()})"
                         f"{', or set download=True to fetch the files there' if cfg.dataset in _DOWNLOADS else ''}.")


_DOWNLOADS = ("fashion_mnist", "cifar10")  # the registry datasets torchvision can download


def check_data(cfg: "DataConfig") -> tuple[tuple, int]:
    """Cheap driver-side check before Ray starts; returns ``(input_shape, num_classes)``.

    Registered file-backed datasets only look at file headers and metadata (and download
    missing files first when ``download=True``). User factories are called once here, so
    a broken factory fails on the driver rather than on every worker.
    """
    check_dataset_name(cfg.dataset)
    check = _CHECKS.get(cfg.dataset) if isinstance(cfg.dataset, str) else None  # a function: built below
    if check is not None:
        _check_data_root_exists(cfg)
    if isinstance(cfg.dataset, RayDataSplits):  # fit peeked at the Ray Datasets (data/ray_datasets.take)
        input_shape, num_classes = cfg.dataset.input_shape, cfg.dataset.num_classes
    elif check is not None:
        input_shape, num_classes = check(cfg)
    else:
        built = _build_untransformed(cfg)
        input_shape, num_classes = built.input_shape, built.num_classes
    if cfg.train_transform or cfg.test_transform:  # e.g. resize:96: the model is built for the new shape
        input_shape = transformed_shape(cfg.train_transform, cfg.test_transform, input_shape)
    logger.debug("dataset %s: input_shape=%s num_classes=%s", cfg.dataset, input_shape, num_classes)
    from raytrain_mgpu.engine.batches import as_shape  # late: loads torch; the name check needs none

    # None: not classification. A structured input's shape is a dict (or tuple) of shapes (raytrain_mgpu.engine.batches).
    return as_shape(input_shape), None if num_classes is None else int(num_classes)
