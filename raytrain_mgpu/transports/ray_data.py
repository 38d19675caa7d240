"""``ingest="ray_data"`` on the Ray side: what the driver hands Ray Train, the CPUs Ray Data needs beside
the training processes, and Ray Data's free-order read of the ``parquet`` split (:func:`train_dataset`, the
baseline ``raytrain-mgpu bench data`` times the planned order against).

The ``parquet`` split is streamed by each worker itself, in a planned order (``engine/stream.py``: decided by
the seed, the epoch and the row groups, split over the replicas as ``DistributedSampler`` splits the loader
path's), from Ray Data's read and decode tasks (``data/parquet_stream.py``): Ray Train gets no dataset for it,
and a resume, at any worker count, continues the epoch at its step.

A user's own Ray Datasets (``data/ray_datasets.py``) go to Ray Train as ``datasets=`` with a ``DataConfig``
that splits what ``ray_datasets.datasets_to_split`` names: nothing for a materialized ``train`` (each worker
reads its planned positions of the whole split), else ``train`` (``streaming_split(num_workers, equal=True)``:
every worker ``len(train) // num_workers`` rows, the count the loader path's ``DistributedSampler(drop_last=True)``
gives, read in Ray Data's order: ``engine/stream.ShardLoader``, with the user's ``collate``).

:func:`train_dataset`, Ray Data's own order: ``read_parquet`` of split files (``FileShuffleConfig``, seeded and
reseeded each epoch), or the 90/10 split's rows read by number in blocks; decoded (PNG/JPEG), reshaped and
normalised in ``map_batches`` by the loader path's functions (``ParquetTable.to_pixels``/``pixels``, its
``PixelNormaliser``): the same rows give bit-identical tensors, in an order that is Ray Data's scheduling's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import ray
import torch

from raytrain_mgpu.data.ingest import RAY_DATA_DATASETS
from raytrain_mgpu.data.parquet import TEST_EVERY, discover
from raytrain_mgpu.data.parquet_stream import placement
from raytrain_mgpu.data.parquet_table import ParquetTable
from raytrain_mgpu.data.ray_datasets import RayDataSplits, datasets_to_split
from raytrain_mgpu.driver import cluster  # by module: tests replace cluster.read_capacity

if TYPE_CHECKING:
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["trainer_datasets", "train_dataset", "check_cpus_left"]

logger = logging.getLogger(__name__)

ROWS_PER_READ_TASK = 1024
"""Rows one map task reads by number (the 90/10 split's path)."""
FOOTER_ACTORS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FOOTER_ACTORS_DEFAULT = 32
"""Ray Data 2.60's ``read_parquet`` reads the files' footers on a pool of this many ``FooterReader``
actors, whatever the number of files, once per execution: every epoch of a streamed split."""
FILES_PER_FOOTER_ACTOR = 10
"""Ray Data's footer batch (``RAY_DATA_PARQUET_FOOTER_BATCH_SIZE``): files one footer call reads."""


# ----------------------------------------------------------------------------- driver


def trainer_datasets(cfg: "TrainConfig") -> dict:
    """``TorchTrainer`` keyword arguments: a user's own Ray Datasets as ``datasets=`` with the ``DataConfig``
    that splits ``train``; nothing otherwise (the ``parquet`` stream is made by each worker, in its planned
    order: ``data/parquet_stream.py``)."""
    if cfg.ingest != "ray_data" or not isinstance(cfg.dataset, RayDataSplits):
        return {}
    from ray.train import DataConfig  # late: Ray Train (0.64 s of import over the api's, which imports this module)

    datasets = cfg.dataset.datasets  # the evaluated splits go to every worker whole
    if datasets is None:
        raise ValueError(f"TrainConfig.dataset={cfg.dataset!r} arrived without its Ray Datasets (they stay in "
                         f"the driver that read them). Pass the dict of Ray Datasets to fit in this process.")
    return {"datasets": dict(datasets), "dataset_config": DataConfig(datasets_to_split=datasets_to_split(cfg.dataset))}


def check_cpus_left(cfg: "TrainConfig", plan, capacity=None, nodes=None) -> Optional[str]:
    """Where Ray Data's read and decode tasks run, as the start banner's line (None: nothing streams).

    The ``parquet`` stream runs them on the cluster's CPU ingest nodes where one is up (``data/parquet_stream
    .placement``): the training processes keep their nodes' CPUs. Elsewhere they need CPUs that the training
    bundles do not hold, shared by the streams (one per reading process). Either way the cluster must have a CPU
    the bundles do not hold (a CPU-only run's workers may take an ingest node's). On a cluster that cannot grow,
    a run without one would wait for ever (the bundles placed, the first read task pending): refused here, before any
    bundle is placed, with the numbers and the fix. An autoscaling cluster can add a CPU node, so there it is a
    warning. ``nodes``: ``ray.nodes()``'s entries (read here unless given; a given ``capacity`` alone stands
    for its alive nodes, without labels)."""
    if cfg.ingest != "ray_data":
        return None
    if nodes is None:
        nodes = _alive_nodes() if capacity is None else [{"Resources": dict(n)} for n in capacity.alive]
    capacity = capacity if capacity is not None else cluster.read_capacity()
    bundles = plan.bundles  # the run plan's: every process of either runner
    held = sum(bundle.get("CPU", 0) for bundle in bundles)
    where = placement(nodes, held)
    total = capacity.max_total("CPU", unlimited=len(bundles) + 1)
    streams = plan.replicas if plan.runner == "actor_group" else plan.num_processes  # the reading processes
    if total - held < 1:
        message = (f"ingest='ray_data': the training processes hold {held:g} of the cluster's {total:g} CPU "
                   f"({len(bundles)} x {bundles[0].get('CPU', 0):g}), so Ray Data's read and decode tasks would "
                   f"wait for a CPU for ever. Leave at least 1 CPU free: lower num_workers"
                   + (" or num_stages" if plan.runner == "actor_group" else "")
                   + " or cpus_per_worker, or add a CPU node.")
        if capacity.autoscales:
            logger.warning("%s (This cluster autoscales: waiting for a node to be added.)", message)
            return "ingest: Ray Data's tasks wait for a CPU node to be added (see the warning above)"
        raise ValueError(message)
    if where.label_selector and cfg.dataset in RAY_DATA_DATASETS:  # the package's stream (a user's Datasets: anywhere)
        return f"ingest: Ray Data's tasks on {where.describe()}"
    spare = total - held
    return (f"ingest: Ray Data's tasks on {'up to ' if capacity.autoscales else ''}{spare:g} CPU beside the "
            f"training processes' {held:g} ({spare / streams:.3g} per stream, {streams} stream(s))")


def _alive_nodes() -> list:
    return [node for node in ray.nodes() if node.get("Alive")]


def train_dataset(data_cfg: "DataConfig", transform=None):
    """The training split of the ``parquet`` dataset ``data_cfg`` as a Ray Dataset of
    ``{"x": float32 (rows, *shape), "y": int64}``, decoded and normalised on CPU tasks.

    ``transform``: the hook for a per-sample transform (a function of one normalised sample
    tensor), applied in the same ``map_batches`` task; None today.
    """
    import ray.data  # late: Ray Data (0.2 s of import), only for this stream; the api imports this module

    filesystem, train_files, test_files = discover(data_cfg)  # the split rules of the loader path
    table = ParquetTable(filesystem, train_files, data_cfg.image_column, data_cfg.label_column)
    if test_files:  # every row of the train files trains
        shuffle = ray.data.FileShuffleConfig(seed=data_cfg.seed, reseed_after_execution=True)
        with footer_readers(len(train_files)):
            dataset = ray.data.read_parquet(list(train_files), filesystem=filesystem, shuffle=shuffle)
        dataset = dataset.select_columns([data_cfg.image_column, data_cfg.label_column])
        return dataset.map_batches(functools.partial(_decode_table, table=table, transform=transform),
                                   batch_format="pyarrow")
    rows = np.arange(len(table), dtype=np.int64)
    rows = rows[rows % TEST_EVERY != TEST_EVERY - 1]  # data/parquet.py's 90/10 split: the same rows
    blocks = np.array_split(rows, max(1, -(-len(rows) // ROWS_PER_READ_TASK)))
    dataset = ray.data.from_numpy(blocks)  # column "data": row numbers, one block per task
    return dataset.map_batches(functools.partial(_read_rows, table=table, transform=transform),
                               batch_format="numpy", batch_size=None)


@contextlib.contextmanager
def footer_readers(num_files: int) -> Iterator[None]:
    """Around ``ray.data.read_parquet``: no more footer-reader actors than the files have footer batches.

    Ray Data 2.60 starts :data:`FOOTER_ACTORS_DEFAULT` of them per execution (each epoch), and a Ray
    worker process is started for each one it places: most sit idle and are killed when the listing
    ends. Measured on a 2-core machine, a 2-epoch, 2-worker fit streaming 3 Parquet files: 33.4 s and
    55 CPU-s with the 32, 26.8 s and 40 CPU-s with 1 (its second epoch at 880 samples/s instead of
    253). The count is fixed when ``read_parquet`` builds its file indexer, here on the driver, from
    :data:`FOOTER_ACTORS_ENV`; a value the user set is kept, and a file set of more than 310
    files (32 footer batches or more) keeps Ray's pool."""
    wanted = -(-num_files // FILES_PER_FOOTER_ACTOR)
    if FOOTER_ACTORS_ENV in os.environ or wanted >= FOOTER_ACTORS_DEFAULT:
        yield
        return
    os.environ[FOOTER_ACTORS_ENV] = str(max(1, wanted))
    try:
        yield
    finally:
        os.environ.pop(FOOTER_ACTORS_ENV, None)


def _decode_table(batch, table: "ParquetTable", transform) -> dict:
    """A ``read_parquet`` batch (a pyarrow Table) -> normalised samples and labels."""
    column = batch.column(table.image_column).combine_chunks()
    pixels = table.to_pixels(column, table.where)
    labels = batch.column(table.label_column).to_numpy().astype(np.int64)
    return _samples(table, pixels, np.arange(len(labels)), labels, transform)


def _read_rows(batch: dict, table: "ParquetTable", transform) -> dict:
    """Row numbers -> their normalised samples and labels, read one row group at a time."""
    rows = np.sort(np.asarray(batch["data"], np.int64))
    return _samples(table, table.read_rows(rows), rows, table.labels[rows], transform)


def _samples(table: "ParquetTable", pixels, rows: np.ndarray, labels: np.ndarray, transform) -> dict:
    if isinstance(pixels, np.ndarray):  # raw pixels: one normalisation for the batch (elementwise, the same bits)
        x = table.normaliser(torch.from_numpy(pixels))
    else:  # PNG/JPEG (or mixed): ParquetImageDataset's per-item decode
        x = torch.stack([table.pixels(pixels, i, int(row)) for i, row in enumerate(rows)])
        x = table.normaliser(x)
    if transform is not None:
        x = torch.stack([transform(sample) for sample in x])
    return {"x": x.numpy(), "y": labels}
