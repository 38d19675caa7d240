"""The ``parquet`` training split streamed by Ray Data in a planned order (``ingest="ray_data"``).

A rank hands :meth:`ParquetStream.batches` its sample indices of one epoch, in the order its sampler
planned (``engine/stream.PlannedSampler``: decided by the seed, the epoch and the row groups, never by Ray
Data's scheduling or the worker count), and gets its micro-batches back in exactly that order. Reading,
decoding, normalising and the per-sample transform run on Ray Data's CPU tasks, in parallel:

- ``ray.data.from_numpy`` of the indices, :data:`READ_ROWS` a block, each block one read task
  (``map_batches``, :data:`READ_CPUS`): one pass over the row groups holding its rows, encoded bytes only,
  handed on in the planned order; ``repartition(target_num_rows_per_block=DECODE_ROWS)`` (streaming, no
  shuffle) cuts them into decode blocks;
- a decode task per block (``map_batches``, 1 CPU): PNG/JPEG decode, the loader path's normalisation and
  its seeded transform (``data/transforms.py``: seeded by seed, epoch and sample index), so a sample is
  bit for bit what the loader path gives for it;
- ``preserve_order`` in the dataset's execution options: the blocks leave in the order they were planned;
  ``iter_torch_batches(batch_size=micro_batch, drop_last=True)`` on the rank.

Why two tasks and not ``read_parquet``: ``read_parquet`` reads whole files or row groups in an order of its
own; a planned order takes single rows from many row groups. One read task per :data:`READ_ROWS` rows of the
rank's share reads each row group it touches once (the planned order keeps a window of row groups together),
and the decode, the costly part on images, is spread over tasks of :data:`DECODE_ROWS` rows. A read task of
its own per decode block would read every touched row group once per block: ``READ_ROWS / DECODE_ROWS``
times the bytes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import numpy as np
import torch

from raytrain_mgpu.data.parquet import ParquetImageDataset
from raytrain_mgpu.data.transforms import TransformedDataset

__all__ = ["ParquetStream", "stream_source", "READ_ROWS", "DECODE_ROWS"]

READ_ROWS = 8192
"""Indices of the rank's share one read task takes (one pass over the row groups they are in)."""
DECODE_ROWS = 256
"""Samples one decode task decodes, normalises and transforms."""
READ_CPUS = 0.5
"""A read task's CPU request: reading encoded bytes waits on storage more than it computes. Unequal to the
decode task's 1 CPU on purpose: Ray Data fuses map tasks of equal requests into one task."""


def stream_source(dataset) -> Optional["ParquetStream"]:
    """The Ray Data stream of a worker's map-style training split, where it is Parquet (under a held-out
    validation split's ``Subset`` and a ``TransformedDataset``); None for other readers."""
    from torch.utils.data import Subset

    inner = dataset.dataset if isinstance(dataset, TransformedDataset) else dataset
    positions = np.arange(len(inner), dtype=np.int64)
    if isinstance(inner, Subset):
        positions, inner = np.asarray(inner.indices, np.int64), inner.dataset
    if not isinstance(inner, ParquetImageDataset):
        return None
    transform = (TransformedDataset(None, dataset.transform, dataset.seed)
                 if isinstance(dataset, TransformedDataset) else None)
    return ParquetStream(inner.table, inner.rows[positions], inner.labels[positions], transform)


class ParquetStream:
    """Sample ``i`` of the split is row ``rows[i]`` of ``table`` with label ``labels[i]``; ``transform`` (a
    :class:`TransformedDataset` without a dataset: its seeding) applies to the normalised sample."""

    def __init__(self, table, rows: np.ndarray, labels: np.ndarray, transform: Optional[TransformedDataset]):
        self.table, self.rows, self.labels, self.transform = table, rows, labels, transform

    def __len__(self) -> int:
        return len(self.rows)

    def run_starts(self) -> list:
        """Where a new row group starts, as sample indices (the split's rows are in file order): the runs the
        planned order keeps together in its windows."""
        groups, _ = self.table.locate(self.rows)
        return [0] + (np.flatnonzero(np.diff(groups)) + 1).tolist()

    def dataset(self, indices: np.ndarray, epoch: int):
        """The Ray Dataset of ``indices``' samples, in that order: ``{"x": float32, "y": int64}``."""
        import ray.data

        indices = np.asarray(indices, np.int64)
        with _preserving_order():
            blocks = [indices[start:start + READ_ROWS] for start in range(0, len(indices), READ_ROWS)]
            dataset = ray.data.from_numpy(blocks or [indices])  # column "data": one read task a block
            dataset = dataset.map_batches(functools.partial(_read, stream=self), batch_size=None,
                                          batch_format="numpy", num_cpus=READ_CPUS)
            dataset = dataset.repartition(target_num_rows_per_block=DECODE_ROWS)
            return dataset.map_batches(functools.partial(_decode, stream=self, epoch=epoch), batch_size=None,
                                       batch_format="numpy")

    def batches(self, indices: np.ndarray, epoch: int, micro_batch: int) -> Iterator[tuple]:
        """``(x, y)`` micro-batches of ``indices``' samples in that order (the rest under one micro-batch left)."""
        stream = self.dataset(indices, epoch).iter_torch_batches(batch_size=micro_batch, drop_last=True,
                                                                  device="cpu")
        return ((batch["x"], batch["y"]) for batch in stream)


@contextlib.contextmanager
def _preserving_order():
    """Datasets made here keep their blocks' order (a Dataset copies the current ``DataContext`` when made);
    the process's context is left as it was."""
    import ray.data

    context = ray.data.DataContext.get_current()
    saved = context.execution_options.preserve_order, context.enable_progress_bars
    context.execution_options.preserve_order, context.enable_progress_bars = True, False
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = saved


def _read(batch: dict, stream: ParquetStream) -> dict:
    """Indices -> their encoded images (or raw pixels) and labels, in the indices' order; each row group read
    once (``ParquetTable.read_rows`` reads sorted rows)."""
    indices = np.asarray(batch["data"], np.int64)
    rows = stream.rows[indices]
    unique, where = np.unique(rows, return_inverse=True)
    pixels = stream.table.read_rows(unique)
    if isinstance(pixels, np.ndarray):
        images = pixels[where]
    else:  # encoded (or mixed) rows: bytes objects, decoded by the next task
        images = np.empty(len(where), dtype=object)
        images[:] = [pixels[i] for i in where]
    return {"index": indices, "row": rows, "image": images, "y": stream.labels[indices]}


def _decode(batch: dict, stream: ParquetStream, epoch: int) -> dict:
    """Encoded rows -> normalised (and transformed) samples: the loader path's functions, so the same bits."""
    table, images, rows = stream.table, batch["image"], batch["row"]
    if images.dtype != object:  # raw pixels: one normalisation for the block (elementwise: the same bits)
        x = table.normaliser(torch.from_numpy(np.ascontiguousarray(images)))
    else:  # PNG/JPEG: ParquetImageDataset's per-item decode
        values = list(images)
        x = table.normaliser(torch.stack([table.pixels(values, i, int(row)) for i, row in enumerate(rows)]))
    if stream.transform is not None:
        x = torch.stack([stream.transform._apply(sample, epoch, int(index))
                         for sample, index in zip(x, batch["index"])])
    return {"x": x.numpy(), "y": np.asarray(batch["y"], np.int64)}
