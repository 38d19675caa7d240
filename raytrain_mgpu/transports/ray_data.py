"""``ingest="ray_data"``: the training split streamed by Ray Data into the Ray Train workers,
or into the first stage of each pipeline replica (:func:`replica_shards`, the same equal split).
The user's own Ray Datasets (``data/ray_datasets.py``) take the same path on Ray Train workers, with
their ``collate`` in ``engine/stream.ShardLoader``.

Driver (:func:`trainer_datasets`): the ``parquet`` dataset's training split as a Ray Dataset,
handed to ``TorchTrainer(datasets={"train": ds}, dataset_config=DataConfig(...))``. Ray Train
splits it with ``streaming_split(num_workers, equal=True)``: every worker gets the same number
of rows, ``len(train) // num_workers``, the same count the loader path's
``DistributedSampler(drop_last=True)`` gives each replica.

- Files split into ``train/`` and ``test/`` (or ``train*``/``test*`` files; what
  ``raytrain-mgpu data convert`` writes): ``ray.data.read_parquet`` of the train files, from a
  local path, ``file://`` or ``s3://``/``gs://``.
- One set of files split 90/10 by global row (``data/parquet.py``): the training rows are read
  by number, a block of consecutive rows per task, with the reader's own row-group reads, so
  exactly the loader path's rows train.

Either way the image column is decoded (PNG/JPEG), reshaped (raw bytes, lists) and normalised
in ``map_batches`` on Ray Data's CPU tasks, by the loader path's own functions
(``ParquetTable.to_pixels``/``pixels`` and its ``PixelNormaliser``): the same rows give
bit-identical tensors. Evaluation keeps the map-style test split (exact, every sample once).

Worker (``engine/stream.ShardLoader``, handed the shard by the transport): ``iter_torch_batches(batch_size=
micro_batch, drop_last=True)``, taken as ``(x, y)``; ``len()`` is the planned micro-batches of
an epoch, the same on every rank, so each optimizer step has exactly ``batch_size`` samples
over the replicas and every rank reports the same number of times.

What streaming changes, against the loader path:
- Order: rows reach a worker in the order Ray Data's parallel read tasks finish, then through a
  local shuffle buffer (``SHUFFLE_BUFFER_BATCHES`` micro-batches, seeded by seed, epoch and
  rank) and, for ``read_parquet``, a file order shuffled per epoch (``FileShuffleConfig``,
  seeded, reseeded each epoch). The samples of a step are not the ``DistributedSampler``'s, so a
  run is not bit-reproducible and 1 vs N workers do not give equal weights. A global
  ``ds.random_shuffle()`` per epoch would move every row through the object store: not done.
- Resume: an interrupted epoch restarts from its beginning with a fresh stream (the checkpoint
  is taken at epoch ends, so no sample position is lost, but none is kept either).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from raytrain_mgpu.config import TrainConfig
    from raytrain_mgpu.config_sections import DataConfig
    from raytrain_mgpu.data.parquet_table import ParquetTable

__all__ = ["trainer_datasets", "replica_shards", "train_dataset", "check_cpus_left"]

logger = logging.getLogger(__name__)

"""Micro-batches of rows a worker's local shuffle buffer holds (``local_shuffle_buffer_size``)."""
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
    """``TorchTrainer`` keyword arguments: none for ``ingest="loader"``; for ``"ray_data"`` the
    training split as ``datasets={"train": ...}`` and the ``DataConfig`` that splits it equally."""
    if cfg.ingest != "ray_data":
        return {}
    from ray.train import DataConfig

    from raytrain_mgpu.data.ray_datasets import RayDataSplits

    if isinstance(cfg.dataset, RayDataSplits):  # the user's own: the evaluated splits go to every worker whole
        datasets = cfg.dataset.datasets
        if datasets is None:
            raise ValueError(f"TrainConfig.dataset={cfg.dataset!r} arrived without its Ray Datasets (they stay in "
                             f"the driver that read them). Pass the dict of Ray Datasets to fit in this process.")
        return {"datasets": dict(datasets), "dataset_config": DataConfig(datasets_to_split=["train"])}
    return {"datasets": {"train": train_dataset(cfg.data)}, "dataset_config": DataConfig(datasets_to_split=["train"])}


def replica_shards(cfg: "TrainConfig", num_replicas: int) -> list:
    """The pipeline runner's split: one ``DataIterator`` per replica (``streaming_split(equal=True)``,
    as Ray Train's ``DataConfig``), for that replica's first stage; a fresh split per attempt."""
    return train_dataset(cfg.data).streaming_split(num_replicas, equal=True)


def check_cpus_left(cfg: "TrainConfig", plan, capacity=None) -> None:
    """Ray Data's read and decode tasks need a CPU that the training bundles do not hold. On a
    cluster that cannot grow, a run without one would wait for ever (the bundles placed, the first
    read task pending): refused here, before any bundle is placed, with the numbers and the fix. An
    autoscaling cluster can add a CPU node, so there it is a warning."""
    if cfg.ingest != "ray_data":
        return
    from raytrain_mgpu.driver.cluster import read_capacity

    capacity = capacity if capacity is not None else read_capacity()
    bundles = plan.bundles  # the run plan's: every process of either runner
    held = sum(bundle.get("CPU", 0) for bundle in bundles)
    total = capacity.max_total("CPU", unlimited=len(bundles) + 1)
    if total - held >= 1:
        return
    message = (f"ingest='ray_data': the training processes hold {held:g} of the cluster's {total:g} CPU "
               f"({len(bundles)} x {bundles[0].get('CPU', 0):g}), so Ray Data's read and decode tasks would wait "
               f"for a CPU for ever. Leave at least 1 CPU free: lower num_workers"
               + (" or num_stages" if plan.runner == "actor_group" else "")
               + " or cpus_per_worker, or add a CPU node.")
    if capacity.autoscales:
        logger.warning("%s (This cluster autoscales: waiting for a node to be added.)", message)
        return
    raise ValueError(message)


def train_dataset(data_cfg: "DataConfig", transform=None):
    """The training split of the ``parquet`` dataset ``data_cfg`` as a Ray Dataset of
    ``{"x": float32 (rows, *shape), "y": int64}``, decoded and normalised on CPU tasks.

    ``transform``: the hook for a per-sample transform (a function of one normalised sample
    tensor), applied in the same ``map_batches`` task; None today.
    """
    import ray.data

    from raytrain_mgpu.data.parquet import TEST_EVERY, discover
    from raytrain_mgpu.data.parquet_table import ParquetTable

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
