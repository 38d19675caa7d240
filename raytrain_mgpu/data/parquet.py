"""``parquet``: image classification data in Parquet, read lazily row group by row group.

``data_root`` is a file, a folder of shards, or a ``s3://``/``gs://``/``file://`` URI
(resolved with ``pyarrow.fs.FileSystem.from_uri``). Splits: ``train/`` and ``test/``
sub-folders, else top-level ``train*.parquet``/``test*.parquet`` files, else every file
with rows whose global index satisfies ``index % 10 == 9`` as the test split (10%,
interleaved so data sorted by label still splits evenly). The column formats and schema
metadata a table may use are in :mod:`raytrain_mgpu.data.parquet_table`.

Memory: a worker holds all labels (8 bytes a row), the row-group layout from the file
footers, and at most ``cache_row_groups`` row groups of the image column. Random access
reads a whole row group per miss, so call :meth:`ParquetImageDataset.prefetch` with the
indices a worker will visit in an epoch.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_mgpu.data.base import Datasets
from raytrain_mgpu.data.parquet_table import ParquetTable, Pixels, arrow_errors, import_arrow

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

logger = logging.getLogger(__name__)

TEST_EVERY = 10
DEFAULT_CACHE_ROW_GROUPS = 4


class ParquetImageDataset(Dataset):
    """Map-style view of some rows of a :class:`ParquetTable`.

    An item not prefetched is served from a row-group LRU cache: a miss reads and
    converts the image column of one whole row group (``row_groups_read`` counts them).
    """

    def __init__(self, table: ParquetTable, rows: Optional[np.ndarray] = None,
                 cache_row_groups: int = DEFAULT_CACHE_ROW_GROUPS):
        self.table = table
        self.rows = np.arange(len(table), dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        self.labels = table.labels[self.rows]
        self.cache_row_groups = max(1, cache_row_groups)
        self.row_groups_read = 0
        self._cache: OrderedDict = OrderedDict()
        self._prefetched: Optional[Pixels] = None
        self._prefetch_position = np.zeros(0, np.int64)

    def __getstate__(self) -> dict:  # caches are per process: a copy sent to a worker starts empty
        empty = {"_cache": OrderedDict(), "_prefetched": None, "_prefetch_position": np.zeros(0, np.int64)}
        return {**self.__dict__, **empty}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        index = range(len(self))[index]  # IndexError for out-of-range, supports negatives
        row = int(self.rows[index])
        position = self._prefetch_position[index] if len(self._prefetch_position) else -1
        pixels = self.table.pixels(self._prefetched, position, row) if position >= 0 else self._from_row_group(row)
        return self.table.normaliser(pixels), int(self.labels[index])

    def _from_row_group(self, row: int) -> torch.Tensor:
        groups, offsets = self.table.locate(np.array([row]))
        group = int(groups[0])
        chunk = self._cache.get(group)
        if chunk is None:
            chunk = self.table.read_row_group(group)
            self.row_groups_read += 1
            self._cache[group] = chunk
            if len(self._cache) > self.cache_row_groups:
                self._cache.popitem(last=False)  # least recently used
        else:
            self._cache.move_to_end(group)
        return self.table.pixels(chunk, int(offsets[0]), row)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Load exactly the images of ``indices`` (e.g. this worker's DistributedSampler
        shard for the epoch) in one pass over the row groups holding them.

        Memory: the kept rows as stored (raw uint8 C*H*W bytes each: 30000 Fashion-MNIST
        rows are 23 MiB; PNG/JPEG stay encoded and decode per item), plus one row group
        while reading and 8 bytes per dataset row for the index. A new call replaces the
        previous set; ``prefetch([])`` frees it. Other indices still work, via the cache.
        DataLoader worker processes started by fork share it; pickled (spawned) copies
        start without it.
        """
        indices = np.unique(np.asarray(list(indices), dtype=np.int64))
        if indices.size and (indices[0] < 0 or indices[-1] >= len(self)):
            raise IndexError(f"prefetch indices must be in 0..{len(self) - 1}")
        self._prefetched, self._prefetch_position = None, np.zeros(0, np.int64)  # free the old set first
        if not indices.size:
            return
        order = np.argsort(self.rows[indices], kind="stable")  # read in file order
        self._prefetched = self.table.read_rows(self.rows[indices][order])
        position = np.full(len(self), -1, np.int64)
        position[indices[order]] = np.arange(len(indices))
        self._prefetch_position = position
        logger.debug("parquet: prefetched %d of %d rows", len(indices), len(self))


# ----------------------------------------------------------------------------- discovery


def resolve_uri(root: str) -> tuple:
    """``(pyarrow filesystem, path)`` for a local path or a ``scheme://`` URI."""
    pa = import_arrow()
    if "://" in root:
        try:
            filesystem, path = pa.fs.FileSystem.from_uri(root)
            return filesystem, path.rstrip("/") or "/"
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"TrainConfig.data_root={root!r}: cannot open this URI ({exc}). Use a local "
                             f"path or a s3://, gs:// or file:// URI your credentials can read.") from exc
    return pa.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(root))


def _parquet_files(filesystem, path: str) -> list[str]:
    with arrow_errors(path):
        files = sorted(import_arrow().dataset.dataset(path, filesystem=filesystem, format="parquet").files)
    # Skip README.md, dataset_info.json and the like next to the shards.
    return [f for f in files if f.endswith(".parquet")] or files


def discover(cfg: "DataConfig") -> tuple:
    """``(filesystem, train_files, test_files)``; ``test_files`` is empty when the rows of
    ``train_files`` are to be split 90/10."""
    pafs = import_arrow().fs
    if not cfg.data_root:
        raise ValueError("TrainConfig.data_root=None: dataset 'parquet' needs a Parquet file, a folder of "
                         "shards or a s3://, gs:// or file:// URI. Set data_root.")
    filesystem, path = resolve_uri(cfg.data_root)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: {path} does not exist. Point data_root "
                         f"at a Parquet file or a folder of shards.")
    if info.type == pafs.FileType.File:
        return filesystem, [path], []
    split_dirs = filesystem.get_file_info([f"{path}/train", f"{path}/test"])
    if all(d.type == pafs.FileType.Directory for d in split_dirs):
        train_files, test_files = (_parquet_files(filesystem, d.path) for d in split_dirs)
        if not train_files or not test_files:
            raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: {path}/train holds {len(train_files)} "
                             f"and {path}/test {len(test_files)} Parquet files; both need some. Add the "
                             f"missing split, or remove both folders to split the rows 90/10.")
        return filesystem, train_files, test_files
    top = [f for f in filesystem.get_file_info(pafs.FileSelector(path)) if f.type == pafs.FileType.File]
    named = {s: sorted(f.path for f in top if f.base_name.startswith(s) and f.base_name.endswith(".parquet"))
             for s in ("train", "test")}
    if named["train"] and named["test"]:
        return filesystem, named["train"], named["test"]
    return filesystem, _parquet_files(filesystem, path), []


def _tables(cfg: "DataConfig") -> tuple:
    filesystem, train_files, test_files = discover(cfg)
    if not train_files:
        raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: no Parquet files found. Point data_root "
                         f"at a Parquet file or a folder of shards.")
    train = ParquetTable(filesystem, train_files, cfg.image_column, cfg.label_column)
    test = ParquetTable(filesystem, test_files, cfg.image_column, cfg.label_column) if test_files else None
    if test is not None and test.shape != train.shape:
        raise ValueError(f"parquet: train images are {train.shape} but test images are {test.shape}. Write "
                         f"both splits with the same shape.")
    return train, test, max(table.num_classes for table in (train, test) if table is not None)


def build(cfg: "DataConfig") -> Datasets:
    train_table, test_table, num_classes = _tables(cfg)
    if test_table is not None:
        train, test = ParquetImageDataset(train_table), ParquetImageDataset(test_table)
    else:
        rows = np.arange(len(train_table), dtype=np.int64)
        is_test = rows % TEST_EVERY == TEST_EVERY - 1
        train, test = ParquetImageDataset(train_table, rows[~is_test]), ParquetImageDataset(train_table, rows[is_test])
    logger.debug("parquet: %d train / %d test rows, shape %s", len(train), len(test), train_table.shape)
    return Datasets(train, test, train_table.shape, num_classes)


def train_split_size(cfg: "DataConfig") -> int:
    """Rows of the training split (metadata only)."""
    train, test, _ = _tables(cfg)
    return len(train) if test is not None else len(train) - len(train) // TEST_EVERY


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    """Footers, schema, metadata and the label column; image data only to learn the
    shape of PNG/JPEG images when the metadata does not give it."""
    train, _, num_classes = _tables(cfg)
    return train.shape, num_classes
