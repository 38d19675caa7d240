"""Write a registered dataset's train and test splits as Parquet shards.

Layout: ``out/train/part-00000.parquet``, ... and ``out/test/...``, locally or under a
``s3://``/``gs://``/``file://`` URI (through ``pyarrow.fs``). Images from the uint8
readers (``digits``, ``fashion_mnist``, ``cifar10``) are stored unchanged as raw bytes
(format (a) of ``parquet``); other float samples (``synthetic``) as fixed-size
``list<float32>`` (format (c)). The schema metadata carries shape, number of classes and
the normalisation, so ``parquet`` on the output yields the same tensors as the source.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.data.base import Datasets, ImageArrayDataset
from raytrain_mgpu.data.parquet import resolve_uri
from raytrain_mgpu.data.parquet_table import META_MAX_VALUE, META_MEAN, META_NUM_CLASSES, META_SHAPE, META_STD

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["convert_to_parquet"]

logger = logging.getLogger(__name__)


def _numbers(values) -> bytes:
    return ",".join(repr(v) for v in values).encode()  # repr: floats round-trip exactly


def _binary_column(images: np.ndarray) -> "pa.Array":
    """(rows, ...) uint8 -> one binary value per row, without a Python object per row."""
    rows, size = len(images), math.prod(images.shape[1:])
    large = rows * size >= 2**31  # int32 offsets would overflow
    offsets = np.arange(rows + 1, dtype=np.int64 if large else np.int32) * size
    data = np.ascontiguousarray(images).reshape(-1)
    return pa.Array.from_buffers(pa.large_binary() if large else pa.binary(), rows,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _float_column(samples: np.ndarray) -> "pa.Array":
    size = math.prod(samples.shape[1:])
    return pa.FixedSizeListArray.from_arrays(pa.array(samples.reshape(-1), pa.float32()), size)


def _split_arrays(dataset, built: Datasets, name: str) -> tuple["pa.Array", np.ndarray, dict]:
    """``(image column, labels, schema metadata)`` of one split."""
    metadata = {META_SHAPE: _numbers(built.input_shape), META_NUM_CLASSES: str(built.num_classes).encode()}
    if isinstance(dataset, ImageArrayDataset):
        norm = dataset.normaliser
        metadata.update({META_MEAN: _numbers(norm.mean_values), META_STD: _numbers(norm.std_values),
                         META_MAX_VALUE: _numbers([norm.max_value])})
        return _binary_column(dataset.images), dataset.labels, metadata
    # Any other dataset: store the float samples as they come out (one pass over the items).
    if len(dataset) and not dataset[0][0].is_floating_point():
        raise ValueError(f"TrainConfig.dataset={name!r}: samples are {dataset[0][0].dtype}, convert writes "
                         f"images or float samples only. Convert an image dataset (digits, fashion_mnist, "
                         f"cifar10, synthetic).")
    items = [dataset[i] for i in range(len(dataset))]
    samples = torch.stack([x for x, _ in items]) if items else torch.zeros((0, *built.input_shape))
    metadata.update({META_MEAN: b"0.0", META_STD: b"1.0", META_MAX_VALUE: b"1.0"})  # stored normalised
    labels = np.array([int(y) for _, y in items], dtype=np.int64)
    return _float_column(samples.numpy()), labels, metadata


def _check_empty(filesystem, root: str, out_uri: str) -> None:
    existing = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    if existing:
        raise ValueError(f"convert out={out_uri!r} already holds {len(existing)} entries (e.g. "
                         f"{existing[0].path}); old shards would mix with new ones. Choose a new folder "
                         f"or delete it first.")


def _write_split(filesystem, root: str, split: str, column: "pa.Array", labels: np.ndarray,
                 metadata: dict, names: tuple, sizes: tuple) -> list[str]:
    image_column, label_column = names
    rows_per_file, row_group_size = sizes
    filesystem.create_dir(f"{root}/{split}", recursive=True)
    paths = []
    for part, start in enumerate(range(0, max(len(labels), 1), rows_per_file)):
        stop = min(start + rows_per_file, len(labels))
        table = pa.table({image_column: column.slice(start, stop - start),
                          label_column: pa.array(labels[start:stop], pa.int64())})
        path = f"{root}/{split}/part-{part:05d}.parquet"
        pq.write_table(table.replace_schema_metadata(metadata), path, filesystem=filesystem,
                       row_group_size=row_group_size)
        paths.append(path)
    return paths


def convert_to_parquet(cfg: "DataConfig", out_uri: str, rows_per_file: int = 10000,
                       row_group_size: int = 1024) -> list[str]:
    """Write ``cfg.dataset``'s splits under ``out_uri``; returns the written paths (as URIs
    when ``out_uri`` is one). Read them back with ``dataset='parquet', data_root=out_uri``.

    ``row_group_size`` is the unit a ``parquet`` reader loads on a cache miss: 1024 rows of
    28x28 images are 0.8 MiB.
    """
    for name, value in (("rows_per_file", rows_per_file), ("row_group_size", row_group_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"convert {name}={value!r}: must be a positive integer. Use e.g. 10000 rows a "
                             f"file and 1024 rows a row group.")
    filesystem, root = resolve_uri(out_uri)
    root = root.rstrip("/")
    _check_empty(filesystem, root, out_uri)
    built = build_datasets(cfg)
    written = []
    for split, dataset in (("train", built.train), ("test", built.test)):
        column, labels, metadata = _split_arrays(dataset, built, cfg.dataset)
        paths = _write_split(filesystem, root, split, column, labels, metadata,
                             (cfg.image_column, cfg.label_column), (rows_per_file, row_group_size))
        logger.info("convert %s: wrote %d %s rows to %d file(s) under %s/%s", cfg.dataset, len(labels),
                    split, len(paths), out_uri, split)
        written += paths
    if "://" in out_uri:
        prefix = out_uri.rstrip("/")
        return [prefix + path[len(root):] for path in written]
    return written
