"""``parquet``: image classification data in Parquet, read lazily row group by row group.

``data_root`` is a file, a folder of shards, or a ``s3://``/``gs://``/``file://`` URI
(resolved with ``pyarrow.fs.FileSystem.from_uri``). Splits: ``train/`` and ``test/``
sub-folders, else top-level ``train*.parquet``/``test*.parquet`` files, else every file
with rows whose global index satisfies ``index % 10 == 9`` as the test split (10%,
interleaved so data sorted by label still splits evenly).

The image column (``image_column``) may hold
  (a) raw uint8 pixels (binary) with the shape in schema metadata ``raytrain_mgpu.shape``
      (e.g. ``b"1,28,28"``), as ``convert_to_parquet`` writes;
  (b) PNG/JPEG bytes (binary, or a struct with a ``bytes`` field as Hugging Face writes),
      decoded per item with ``torchvision.io.decode_image``;
  (c) lists of numbers (list<uint8>, list<float>, ...) with the shape in metadata.
Other metadata keys: ``num_classes`` (default: max label + 1), ``mean``/``std`` (default
0.5/0.5), ``max_value`` (default 255, or 1.0 for float lists); x is
``(pixels / max_value - mean) / std``.

Memory: a worker holds all labels (8 bytes a row), the row-group layout from the file
footers, and at most ``cache_row_groups`` row groups of the image column. Random access
reads a whole row group per miss, so call :meth:`ParquetImageDataset.prefetch` with the
indices a worker will visit in an epoch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_mgpu.data import Datasets, PixelNormaliser

if TYPE_CHECKING:
    import pyarrow as pa
    from raytrain_mgpu.config import DataConfig

logger = logging.getLogger(__name__)

META_SHAPE = b"raytrain_mgpu.shape"
META_NUM_CLASSES = b"raytrain_mgpu.num_classes"
META_MEAN = b"raytrain_mgpu.mean"
META_STD = b"raytrain_mgpu.std"
META_MAX_VALUE = b"raytrain_mgpu.max_value"
TEST_EVERY = 10
DEFAULT_CACHE_ROW_GROUPS = 4

Pixels = Union[np.ndarray, list]  # (rows, *shape) numbers, or one bytes object per row


def _arrow():
    """pyarrow with the submodules used here, imported on first use (~0.4 s) so that
    importing the dataset registry stays cheap."""
    import pyarrow
    import pyarrow.compute
    import pyarrow.dataset
    import pyarrow.fs  # noqa: F401

    return pyarrow


@contextlib.contextmanager
def _arrow_errors(where: str):
    pa = _arrow()
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"parquet {where}: cannot be read ({type(exc).__name__}: {exc}). Point "
                         f"data_root at intact Parquet files.") from exc


def _meta_numbers(metadata: dict, key: bytes, where: str, cast=float) -> Optional[tuple]:
    if key not in metadata:
        return None
    try:
        return tuple(cast(v) for v in metadata[key].decode().split(","))
    except ValueError:
        raise ValueError(f"parquet {where}: schema metadata {key!r}={metadata[key]!r} is not a comma-"
                         f"separated list of numbers. Write it like b'1,28,28'.") from None


class ParquetTable:
    """One set of Parquet files: row-group layout (from footers), all labels, image format.

    Reading a row group touches only the image column of that row group.
    """

    def __init__(self, filesystem, files: Sequence[str], image_column: str, label_column: str):
        self.filesystem, self.files = filesystem, tuple(files)
        self.image_column, self.label_column = image_column, label_column
        self.where = (self.files[0] if len(self.files) == 1
                      else f"{len(self.files)} files under {os.path.dirname(self.files[0])}")
        self._fragments = None
        with _arrow_errors(self.where):
            schema = _arrow().dataset.dataset(list(self.files), filesystem=filesystem, format="parquet").schema
            self._read_schema(schema)
            sizes, keys = [], []
            for file_index, fragment in enumerate(self.fragments):
                for group in fragment.row_groups:
                    sizes.append(group.num_rows)
                    keys.append((file_index, group.id))
            self.row_group_keys = keys
            self.row_group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            self.labels = self._read_labels()
        self.metadata = dict(schema.metadata or {})
        self.shape = self._shape()
        self.num_classes = self._num_classes()
        self.normaliser = self._normaliser()

    @property
    def fragments(self) -> list:
        if self._fragments is None:  # rebuilt after unpickling on a worker
            dataset = _arrow().dataset.dataset(list(self.files), filesystem=self.filesystem, format="parquet")
            self._fragments = list(dataset.get_fragments())
        return self._fragments

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fragments": None}

    def __len__(self) -> int:
        return int(self.row_group_starts[-1])

    def _read_schema(self, schema) -> None:
        pa = _arrow()
        for field_name, option in ((self.image_column, "image_column"), (self.label_column, "label_column")):
            if field_name not in schema.names:
                raise ValueError(f"parquet {self.where}: no column {field_name!r} (TrainConfig.{option}); "
                                 f"columns are {schema.names}. Set {option} to one of them.")
        label_type = schema.field(self.label_column).type
        if not pa.types.is_integer(label_type):
            raise ValueError(f"parquet {self.where}: label column {self.label_column!r} has type {label_type}; "
                             f"labels must be integers 0..num_classes-1. Store class indices.")
        self.kind = _image_kind(schema.field(self.image_column).type, self.image_column, self.where)
        self.value_is_float = self.kind == "list" and pa.types.is_floating(
            schema.field(self.image_column).type.value_type)

    def _read_labels(self) -> np.ndarray:
        columns = [fragment.to_table(columns=[self.label_column]).column(0) for fragment in self.fragments]
        if any(column.null_count for column in columns):
            raise ValueError(f"parquet {self.where}: label column {self.label_column!r} has missing values. "
                             f"Drop or fill those rows.")
        labels = np.concatenate([column.to_numpy() for column in columns] or [np.zeros(0)]).astype(np.int64)
        if labels.size and labels.min() < 0:
            raise ValueError(f"parquet {self.where}: label {labels.min()} is negative; labels must be "
                             f"0..num_classes-1. Map the classes to indices.")
        return labels

    def _shape(self) -> tuple:
        shape = _meta_numbers(self.metadata, META_SHAPE, self.where, cast=int)
        if shape is not None:
            return shape
        if self.kind == "list":
            raise ValueError(f"parquet {self.where}: column {self.image_column!r} holds lists of pixels but "
                             f"the schema metadata has no {META_SHAPE!r}. Add it (e.g. b'1,28,28').")
        if len(self) == 0:
            raise ValueError(f"parquet {self.where}: no rows, so no image shape; add {META_SHAPE!r} "
                             f"metadata or rows.")
        self.shape = ()  # without a shape every binary value is decoded as PNG/JPEG, unchanged
        return tuple(self.pixels(self.read_row_group(0), 0, row=0).shape)

    def _num_classes(self) -> int:
        stored = _meta_numbers(self.metadata, META_NUM_CLASSES, self.where, cast=int)
        num_classes = stored[0] if stored else int(self.labels.max(initial=-1)) + 1
        if self.labels.size and self.labels.max() >= num_classes:
            raise ValueError(f"parquet {self.where}: label {self.labels.max()} is not below "
                             f"{META_NUM_CLASSES!r}={num_classes}. Fix the metadata or the labels.")
        return num_classes

    def _normaliser(self) -> PixelNormaliser:
        mean = _meta_numbers(self.metadata, META_MEAN, self.where) or (0.5,)
        std = _meta_numbers(self.metadata, META_STD, self.where) or (0.5,)
        max_value = _meta_numbers(self.metadata, META_MAX_VALUE, self.where)
        max_value = max_value[0] if max_value else (1.0 if self.value_is_float else 255)
        return PixelNormaliser(max_value, mean, std, self.shape)

    # ------------------------------------------------------------------ reading

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global rows -> (row group number, offset inside it), from footer metadata only."""
        groups = np.searchsorted(self.row_group_starts, rows, side="right") - 1
        return groups, rows - self.row_group_starts[groups]

    def read_row_group(self, group: int, offsets: Optional[np.ndarray] = None) -> Pixels:
        """The image column of one row group (only the ``offsets`` rows, if given)."""
        file_index, group_id = self.row_group_keys[group]
        with _arrow_errors(self.files[file_index]):
            column = self.fragments[file_index].subset(row_group_ids=[group_id]).to_table(
                columns=[self.image_column]).column(0).combine_chunks()
        if offsets is not None:
            column = column.take(_arrow().array(offsets))
        return self.to_pixels(column, self.files[file_index])

    def read_rows(self, rows: np.ndarray) -> Pixels:
        """Pixels of sorted global ``rows``, one pass over the row groups that hold them;
        peak memory is one row group plus the rows kept."""
        groups, offsets = self.locate(rows)
        pieces = [self.read_row_group(group, offsets[groups == group]) for group in np.unique(groups)]
        if all(isinstance(piece, np.ndarray) for piece in pieces):
            return np.concatenate(pieces) if pieces else np.zeros((0, *self.shape), np.uint8)
        # Mixed raw and encoded row groups: keep bytes; pixels() tells them apart by length.
        return [value for piece in pieces for value in
                ([row.tobytes() for row in piece] if isinstance(piece, np.ndarray) else piece)]

    def to_pixels(self, array: "pa.Array", where: str) -> Pixels:
        """Image column values -> ``(rows, *shape)`` numbers, or the encoded bytes."""
        pc = _arrow().compute
        if self.kind == "struct":
            array = pc.struct_field(array, "bytes")
        if array.null_count:
            raise ValueError(f"parquet {where}: column {self.image_column!r} has {array.null_count} missing images "
                             f"(null, or a Hugging Face path without bytes). Drop those rows or embed the bytes.")
        size = math.prod(self.shape) if self.shape else -1
        if self.kind == "list":
            lengths = pc.list_value_length(array).to_numpy()
            if (lengths != size).any():
                raise ValueError(f"parquet {where}: a list in {self.image_column!r} has {lengths[lengths != size][0]} "
                                 f"values, {META_SHAPE!r}={self.shape} needs {size}. Fix the metadata or the data.")
            return array.flatten().to_numpy(zero_copy_only=False).reshape(-1, *self.shape).copy()
        if self.kind == "binary" and size > 0 and (pc.binary_length(array).to_numpy() == size).all():
            return _binary_to_numpy(array, self.shape)
        return array.to_pylist()  # PNG/JPEG: decoded per item, so only encoded bytes sit in memory

    def pixels(self, chunk: Pixels, offset: int, row: int) -> torch.Tensor:
        """One image of a chunk as a tensor of pixel values (uint8 or float)."""
        if isinstance(chunk, np.ndarray):
            return torch.from_numpy(chunk[offset])
        value = chunk[offset]
        if self.kind == "binary" and self.shape and len(value) == math.prod(self.shape):  # raw row
            return torch.from_numpy(np.frombuffer(value, np.uint8).copy()).reshape(self.shape)
        return self._decode(value, row)

    def _decode(self, value: bytes, row: int) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_image  # ~1 s import; only for encoded images

        mode = {1: ImageReadMode.GRAY, 3: ImageReadMode.RGB}.get(self.shape[0] if self.shape else 0,
                                                                  ImageReadMode.UNCHANGED)
        try:
            image = decode_image(torch.from_numpy(np.frombuffer(value, np.uint8).copy()), mode=mode)
        except RuntimeError as exc:
            raise ValueError(f"parquet {self.where}: row {row} of {self.image_column!r} is neither raw pixels "
                             f"of shape {self.shape} nor a PNG/JPEG image ({exc}). Store PNG/JPEG bytes, or "
                             f"raw uint8 pixels with {META_SHAPE!r} metadata.") from None
        if self.shape and tuple(image.shape) != self.shape:
            raise ValueError(f"parquet {self.where}: row {row} decodes to shape {tuple(image.shape)}, the "
                             f"dataset's images are {self.shape}. Resize all images to one size.")
        return image


def _image_kind(arrow_type, column: str, where: str) -> str:
    pa = _arrow()
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "binary"
    if pa.types.is_struct(arrow_type) and arrow_type.get_field_index("bytes") >= 0:
        return "struct"
    types = pa.types
    is_list = types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type)
    if is_list and (pa.types.is_integer(arrow_type.value_type) or pa.types.is_floating(arrow_type.value_type)):
        return "list"
    raise ValueError(f"parquet {where}: image column {column!r} has type {arrow_type}. Store raw or PNG/JPEG "
                     f"bytes (binary), a struct with a 'bytes' field, or a list of numbers.")


def _binary_to_numpy(array: "pa.Array", shape: tuple) -> np.ndarray:
    """Equal-length binary values -> (rows, *shape) uint8 without a Python object per row."""
    if len(array) == 0:
        return np.zeros((0, *shape), np.uint8)
    offset_type = np.int64 if _arrow().types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], offset_type)[array.offset:array.offset + len(array) + 1]
    data = np.frombuffer(array.buffers()[2], np.uint8)
    # copy: owns its memory (the Arrow buffers can be freed) and is writable for torch
    return data[offsets[0]:offsets[-1]].reshape(len(array), *shape).copy()


# ----------------------------------------------------------------------------- dataset


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
    pa = _arrow()
    if "://" in root:
        try:
            filesystem, path = pa.fs.FileSystem.from_uri(root)
            return filesystem, path.rstrip("/") or "/"
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"TrainConfig.data_root={root!r}: cannot open this URI ({exc}). Use a local "
                             f"path or a s3://, gs:// or file:// URI your credentials can read.") from exc
    return pa.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(root))


def _parquet_files(filesystem, path: str) -> list[str]:
    with _arrow_errors(path):
        files = sorted(_arrow().dataset.dataset(path, filesystem=filesystem, format="parquet").files)
    # Skip README.md, dataset_info.json and the like next to the shards.
    return [f for f in files if f.endswith(".parquet")] or files


def discover(cfg: "DataConfig") -> tuple:
    """``(filesystem, train_files, test_files)``; ``test_files`` is empty when the rows of
    ``train_files`` are to be split 90/10."""
    pafs = _arrow().fs
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


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    """Footers, schema, metadata and the label column; image data only to learn the
    shape of PNG/JPEG images when the metadata does not give it."""
    train, _, num_classes = _tables(cfg)
    return train.shape, num_classes
