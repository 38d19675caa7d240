"""One Parquet image table (a set of files): its schema, labels, row groups and pixels.

The image column (``image_column``) may hold
  (a) raw uint8 pixels (binary) with the shape in schema metadata ``raytrain_mgpu.shape``
      (e.g. ``b"1,28,28"``), as ``convert_to_parquet`` writes;
  (b) PNG/JPEG bytes (binary, or a struct with a ``bytes`` field as Hugging Face writes),
      decoded per item with ``torchvision.io.decode_image``;
  (c) lists of numbers (list<uint8>, list<float>, ...) with the shape in metadata.
Other metadata keys: ``num_classes`` (default: max label + 1), ``mean``/``std`` (default
0.5/0.5), ``max_value`` (default 255, or 1.0 for float lists); x is
``(pixels / max_value - mean) / std``.

:class:`raytrain_mgpu.data.parquet.ParquetImageDataset` is the map-style dataset over it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import torch

from raytrain_mgpu.data.base import PixelNormaliser

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

META_SHAPE = b"raytrain_mgpu.shape"
META_NUM_CLASSES = b"raytrain_mgpu.num_classes"
META_MEAN = b"raytrain_mgpu.mean"
META_STD = b"raytrain_mgpu.std"
META_MAX_VALUE = b"raytrain_mgpu.max_value"

Pixels = Union[np.ndarray, list]  # (rows, *shape) numbers, or one bytes object per row


def import_arrow():
    """pyarrow with the submodules used here, imported on first use (~0.4 s) so that
    importing the dataset registry stays cheap."""
    # late: pyarrow.dataset and .compute are 0.25 s of CPU to import, only for a run that reads Parquet
    import pyarrow
    import pyarrow.compute
    import pyarrow.dataset
    import pyarrow.fs  # noqa: F401

    return pyarrow


@contextlib.contextmanager
def arrow_errors(where: str):
    pa = import_arrow()
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
        with arrow_errors(self.where):
            schema = import_arrow().dataset.dataset(list(self.files), filesystem=filesystem, format="parquet").schema
            self._read_schema(schema)
            sizes, keys = [], []
            for file_index, fragment in enumerate(self.fragments):
                for group in fragment.row_groups:
                    sizes.append(group.num_rows)
                    keys.append((file_index, group.id))
            self.row_group_keys = keys
            self.row_group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            self.labels = self._read_labels()
        if not len(self):  # else 0 classes and 0 steps, found only on the workers
            raise ValueError(f"parquet {self.where}: the table has 0 rows. Point data_root at the Parquet "
                             f"files that hold the data (re-run `raytrain-mgpu data convert` if they were "
                             f"written empty).")
        self.metadata = dict(schema.metadata or {})
        self.shape = self._shape()
        self.num_classes = self._num_classes()
        self.normaliser = self._normaliser()

    @property
    def fragments(self) -> list:
        if self._fragments is None:  # rebuilt after unpickling on a worker
            dataset = import_arrow().dataset.dataset(list(self.files), filesystem=self.filesystem, format="parquet")
            self._fragments = list(dataset.get_fragments())
        return self._fragments

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fragments": None}

    def __len__(self) -> int:
        return int(self.row_group_starts[-1])

    def _read_schema(self, schema) -> None:
        pa = import_arrow()
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
        with arrow_errors(self.files[file_index]):
            column = self.fragments[file_index].subset(row_group_ids=[group_id]).to_table(
                columns=[self.image_column]).column(0).combine_chunks()
        if offsets is not None:
            column = column.take(import_arrow().array(offsets))
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
        pc = import_arrow().compute
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
        from torchvision.io import ImageReadMode, decode_image  # late: ~1 s import; only for encoded images

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
    pa = import_arrow()
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
    offset_type = np.int64 if import_arrow().types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], offset_type)[array.offset:array.offset + len(array) + 1]
    data = np.frombuffer(array.buffers()[2], np.uint8)
    # copy: owns its memory (the Arrow buffers can be freed) and is writable for torch
    return data[offsets[0]:offsets[-1]].reshape(len(array), *shape).copy()


# ----------------------------------------------------------------------------- dataset
