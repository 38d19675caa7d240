"""The ``parquet`` training split streamed by Ray Data in a planned order (``ingest="ray_data"``).

A rank hands :meth:`ParquetStream.batches` its sample indices of one epoch, in the order its sampler
planned (``engine/stream.PlannedSampler``: decided by the seed, the epoch and the row groups, never by Ray
Data's scheduling or the worker count), and gets its micro-batches back in exactly that order. Reading,
decoding, normalising and the per-sample transform run on Ray Data's CPU tasks, in parallel:

- ``ray.data.from_numpy`` of the indices, :data:`READ_ROWS` a block, each block one read task
  (``map_batches``, :data:`READ_CPUS`): one pass over the row groups holding its rows, encoded bytes only,
  handed on in the planned order; ``repartition(target_num_rows_per_block=DECODE_ROWS)`` (streaming, no
  shuffle) cuts them into decode blocks;
- a decode task per block (``map_batches``, 1 CPU): the stream's row -> sample function (images: PNG/JPEG
  decode and the loader path's normalisation; ``text``'s token blocks: the block -> ``(x, y)`` split,
  ``data/lm_blocks.token_samples``) and the seeded transform (``data/transforms.py``: seeded by seed, epoch
  and sample index), so a sample is bit for bit what the loader path gives for it;
- ``preserve_order`` in the dataset's execution options: the blocks leave in the order they were planned;
  ``iter_torch_batches(batch_size=micro_batch, drop_last=True)`` on the rank.

Why two tasks and not ``read_parquet``: ``read_parquet`` reads whole files or row groups in an order of its
own; a planned order takes single rows from many row groups. One read task per :data:`READ_ROWS` rows of the
rank's share reads each row group it touches once (the planned order keeps a window of row groups together),
and the decode, the costly part on images, is spread over tasks of :data:`DECODE_ROWS` rows. A read task of
its own per decode block would read every touched row group once per block: ``READ_ROWS / DECODE_ROWS``
times the bytes.

Where the tasks run (:func:`placement`, asked again at each epoch's start, so a CPU ingest node that comes up or
goes away is followed from the next epoch): on the CPU ingest nodes where the cluster has one up (nodes labelled
:data:`INGEST_LABEL`: cluster.yaml's ``cpu`` type), and the training processes keep every CPU of their own nodes;
elsewhere on the CPUs beside the training processes' placement group (Ray schedules no task of the stream into
it). Ray Data is told the same: every task of the dataset carries the label selector
(``ExecutionOptions.label_selector``), and its resource limit is the CPUs the stream may use.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import Subset

from raytrain_mgpu.data.lm_blocks import TokenBlocks, token_samples
from raytrain_mgpu.data.parquet import ParquetImageDataset
from raytrain_mgpu.data.transforms import TransformedDataset

__all__ = ["ParquetStream", "stream_source", "READ_ROWS", "DECODE_ROWS", "INGEST_LABEL", "Placement", "placement"]

READ_ROWS = 8192
"""Indices of the rank's share one read task takes (one pass over the row groups they are in)."""
DECODE_ROWS = 256
"""Samples one decode task decodes, normalises and transforms."""
READ_CPUS = 0.5
"""A read task's CPU request: reading encoded bytes waits on storage more than it computes. Unequal to the
decode task's 1 CPU on purpose: Ray Data fuses map tasks of equal requests into one task."""
INGEST_LABEL = ("ray-subcluster", "ingest")
"""The node label (key, value) of CPU ingest nodes. The key is Ray Data's own for a dataset's part of the cluster:
its resource accounting and autoscaling requests go by the value of it."""


@dataclass(frozen=True)
class Placement:
    """Where one epoch's stream runs its read and decode tasks."""

    label_selector: Optional[dict]
    """Ray's label selector for every task of the stream; None: any node."""
    cpus: float
    """The CPUs its tasks may use: the ingest nodes', or those beside the training processes."""
    ingest_nodes: int
    """CPU ingest nodes up."""

    def describe(self) -> str:
        if self.label_selector:
            return (f"{self.ingest_nodes} CPU ingest node(s) ({self.cpus:g} CPU, label "
                    f"{INGEST_LABEL[0]}={INGEST_LABEL[1]}); the training processes keep their nodes' CPUs")
        return f"{self.cpus:g} CPU beside the training processes"


def placement(nodes: List[dict], held_cpus: float, held_by_node: Optional[dict] = None) -> Placement:
    """The stream's :class:`Placement` on a cluster of ``nodes`` (``ray.nodes()``'s entries: ``Alive``, ``NodeID``,
    ``Resources``, ``Labels``) whose training processes hold ``held_cpus`` CPUs in their placement group,
    ``held_by_node`` of them on each node (``{NodeID: CPUs}``; a CPU-only run's workers may sit on an ingest node:
    those CPUs are not the stream's, and ingest nodes left with less than one CPU take no task)."""
    alive = [n for n in nodes if n.get("Alive", True)]
    key, value = INGEST_LABEL
    held_by_node = held_by_node or {}
    free = {id(n): n["Resources"].get("CPU", 0) - held_by_node.get(n.get("NodeID"), 0) for n in alive}
    ingest = [n for n in alive if (n.get("Labels") or {}).get(key) == value and free[id(n)] > 0]
    if sum(free[id(n)] for n in ingest) >= 1:
        return Placement({key: value}, sum(free[id(n)] for n in ingest), len(ingest))
    total = sum(n["Resources"].get("CPU", 0) for n in alive)
    return Placement(None, max(total - held_cpus, 0.0), 0)


def _current_placement() -> Placement:
    """:func:`placement` on the connected cluster, for this process's training placement group (a Ray Train
    worker's, a pipeline stage's; none in a process outside one, e.g. ``bench-data``'s)."""
    # late: Ray (0.25 s of import), only where a split streams through Ray Data: engine/feed.py imports this module,
    # and importing the engine loads no Ray
    import ray
    from ray.util import get_current_placement_group, placement_group_table

    group = get_current_placement_group()
    if group is None:
        return placement(ray.nodes(), 0.0)
    held_by_node: dict = {}
    on_nodes = placement_group_table(group).get("bundles_to_node_id", {})
    for index, bundle in enumerate(group.bundle_specs):
        node_id = on_nodes.get(index)
        held_by_node[node_id] = held_by_node.get(node_id, 0) + bundle.get("CPU", 0)
    return placement(ray.nodes(), sum(held_by_node.values()), held_by_node)


def stream_source(dataset) -> Optional["ParquetStream"]:
    """The Ray Data stream of a worker's map-style training split, where it is Parquet (images, or ``text``'s
    token blocks; under a held-out validation split's ``Subset`` and a ``TransformedDataset``); None for other
    readers."""
    inner = dataset.dataset if isinstance(dataset, TransformedDataset) else dataset
    positions = np.arange(len(inner), dtype=np.int64)
    if isinstance(inner, Subset):
        positions, inner = np.asarray(inner.indices, np.int64), inner.dataset
    if not isinstance(inner, (ParquetImageDataset, TokenBlocks)):
        return None
    transform = (TransformedDataset(None, dataset.transform, dataset.seed)
                 if isinstance(dataset, TransformedDataset) else None)
    if isinstance(inner, TokenBlocks):  # a row is a block: its labels are its own tokens
        return ParquetStream(inner.table, inner.rows[positions], None, transform, token_samples)
    return ParquetStream(inner.table, inner.rows[positions], inner.labels[positions], transform)


class ParquetStream:
    """Sample ``i`` of the split is row ``rows[i]`` of ``table`` with label ``labels[i]`` (None: the row holds
    its labels), made by ``samples`` (``samples(batch, table) -> (x, y)`` of a read task's rows: ``batch["stored"]``
    their stored values, ``batch["y"]`` their labels; default: images decoded and normalised); ``transform`` (a
    :class:`TransformedDataset` without a dataset: its seeding) applies to the sample's ``x``."""

    def __init__(self, table, rows: np.ndarray, labels: Optional[np.ndarray], transform: Optional[TransformedDataset],
                 samples: Optional[Callable] = None):
        self.table, self.rows, self.labels, self.transform = table, rows, labels, transform
        self.samples = samples or _images

    def __len__(self) -> int:
        return len(self.rows)

    def run_starts(self) -> list:
        """Where a new row group starts, as sample indices (the split's rows are in file order): the runs the
        planned order keeps together in its windows."""
        groups, _ = self.table.locate(self.rows)
        return [0] + (np.flatnonzero(np.diff(groups)) + 1).tolist()

    def dataset(self, indices: np.ndarray, epoch: int):
        """The Ray Dataset of ``indices``' samples, in that order: ``{"x": float32, "y": int64}``."""
        import ray.data  # late: Ray Data, only when the split streams (see _current_placement)

        indices = np.asarray(indices, np.int64)
        with _stream_context(_current_placement()):
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
def _stream_context(where: Placement):
    """Datasets made here keep their blocks' order, and run every task (``from_numpy``'s too) where ``where``
    says, planning with its CPUs (a Dataset copies the current ``DataContext`` when made); the process's context
    is left as it was."""
    import ray.data  # late: Ray Data, only when the split streams (see _current_placement)

    context = ray.data.DataContext.get_current()
    options = context.execution_options
    saved = options.preserve_order, options.label_selector, options.resource_limits, context.enable_progress_bars
    options.preserve_order, context.enable_progress_bars = True, False
    options.label_selector = where.label_selector or options.label_selector  # else the user's own, if any
    if where.cpus >= 1:  # fewer: left to Ray Data (the driver refused or warned: transports/ray_data.check_cpus_left)
        options.resource_limits = options.resource_limits.copy(cpu=where.cpus)
    try:
        yield
    finally:
        options.preserve_order, options.label_selector, options.resource_limits, context.enable_progress_bars = saved


def _read(batch: dict, stream: ParquetStream) -> dict:
    """Indices -> their stored values (encoded images, raw pixels, token blocks) and labels, in the indices' order;
    each row group read once (``ParquetTable.read_rows`` reads sorted rows)."""
    indices = np.asarray(batch["data"], np.int64)
    rows = stream.rows[indices]
    unique, where = np.unique(rows, return_inverse=True)
    pixels = stream.table.read_rows(unique)
    if isinstance(pixels, np.ndarray):
        images = pixels[where]
    else:  # encoded (or mixed) rows: bytes objects, decoded by the next task
        images = np.empty(len(where), dtype=object)
        images[:] = [pixels[i] for i in where]
    read = {"index": indices, "row": rows, "stored": images}
    return read if stream.labels is None else {**read, "y": stream.labels[indices]}


def _decode(batch: dict, stream: ParquetStream, epoch: int) -> dict:
    """Stored rows -> (transformed) samples: the loader path's functions, so the same bits."""
    x, y = stream.samples(batch, stream.table)
    if stream.transform is not None:
        x = torch.stack([stream.transform._apply(sample, epoch, int(index))
                         for sample, index in zip(x, batch["index"])])
    return {"x": np.ascontiguousarray(x.numpy()), "y": np.ascontiguousarray(y, np.int64)}  # token views: a copy


def _images(batch: dict, table) -> tuple:
    """Encoded images or raw pixels -> normalised samples, and their labels."""
    images, rows = batch["stored"], batch["row"]
    if images.dtype != object:  # raw pixels: one normalisation for the block (elementwise: the same bits)
        x = table.normaliser(torch.from_numpy(np.ascontiguousarray(images)))
    else:  # PNG/JPEG: ParquetImageDataset's per-item decode
        values = list(images)
        x = table.normaliser(torch.stack([table.pixels(values, i, int(row)) for i, row in enumerate(rows)]))
    return x, batch["y"]
