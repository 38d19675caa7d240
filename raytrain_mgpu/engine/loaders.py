"""The DataLoaders of both runners: the training split's (sharded by a ``DistributedSampler``) and
the test split's, with the ``DataConfig``'s loader workers.

What stays exact with loader workers (``loader_workers`` > 0): the sampler decides the order in the
training process and the DataLoader returns batches in that order, so every step sees the samples it
sees with 0 workers. Two things would break that, and are handled here:

- the DataLoader draws its workers' base seed from torch's global generator once per iterator (one
  draw per epoch, or only the first with persistent workers), which would shift the training
  process's random stream (dropout) against 0 workers: each loader gets its own generator instead;
- the epoch of a transform's seed (``data/transforms.py``) must reach persistent workers, which hold
  a copy of the dataset from the first epoch: the indices carry it, as ``(epoch, index)`` pairs.

Datasets with ``prefetch(indices)`` (``parquet``) load each epoch's rows in the training process
before the epoch's iterator starts; worker processes forked then share those rows (copy-on-write,
no copy per worker). Persistent workers would keep the first epoch's rows, so such datasets restart
their workers every epoch (one fork per loader worker and epoch).

Loader workers forked from a process that trains (:func:`worker_context`) never run the destructors of what they
inherited: a cycle of garbage the training process had not collected yet at the fork (a wrapped model holding a
gloo process group) would otherwise be collected in the worker, whose copy of the group's threads does not exist
there: the worker hangs or aborts (``~ProcessGroupGloo``).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
from multiprocessing.context import ForkContext, ForkProcess
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Sampler, Subset

from raytrain_mgpu.data.transforms import TransformedDataset

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["train_loader", "test_loader", "prefetch", "base_dataset", "worker_context"]

logger = logging.getLogger(__name__)


class _EpochIndices(Sampler):
    """``(epoch, index)`` pairs of a sampler with an ``epoch`` (``DistributedSampler``), read per iteration."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def base_dataset(dataset):
    """The reader (where ``prefetch`` lives) under a :class:`TransformedDataset` and a held-out split's ``Subset``."""
    while isinstance(dataset, (TransformedDataset, Subset)):
        dataset = dataset.dataset
    return dataset


def prefetch(dataset, indices: Sequence[int]) -> None:
    """Load exactly this epoch's rows in the training process, where the reader can (``parquet``); the indices
    of a split held out by ``val_fraction`` (a ``Subset``) are the reader's rows it names."""
    rows = list(indices)
    while isinstance(dataset, (TransformedDataset, Subset)):
        rows = [dataset.indices[i] for i in rows] if isinstance(dataset, Subset) else rows
        dataset = dataset.dataset
    if hasattr(dataset, "prefetch"):
        dataset.prefetch(rows)


class _FrozenForkProcess(ForkProcess):
    """A fork whose child never collects what it inherited: the parent's objects are frozen for the fork
    (``gc.freeze``: out of every collection, an O(1) move) and thawed again in the parent right after it. The cost:
    the parent's young objects join the oldest generation at the thaw, so its garbage among them waits for the next
    full collection."""

    def start(self) -> None:
        gc.freeze()
        try:
            super().start()
        finally:
            gc.unfreeze()


class _FrozenForkContext(ForkContext):
    Process = _FrozenForkProcess


_FROZEN_FORK = _FrozenForkContext()


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """The ``multiprocessing_context`` of loader workers: where they would be forked (the start method in force, or
    the platform's default: ``fork`` on Linux before Python 3.14), forked with the parent's objects frozen, so that
    the worker's garbage collector never frees one of them (see the module docstring); else None (DataLoader's
    default: a spawned or forkserver worker inherits no objects)."""
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return _FROZEN_FORK if method == "fork" else None


def _worker_options(cfg: Optional["DataConfig"], dataset) -> dict:
    workers = cfg.loader_workers if cfg is not None else 0
    if workers == 0:
        return {"num_workers": 0}
    persistent = cfg.persistent_workers and not hasattr(base_dataset(dataset), "prefetch")
    if cfg.persistent_workers and not persistent:
        logger.debug("loader workers restart every epoch: %s loads each epoch's rows in this process",
                     type(base_dataset(dataset)).__name__)
    options = {"num_workers": workers, "persistent_workers": persistent, "multiprocessing_context": worker_context()}
    if cfg.prefetch_factor is not None:
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


def train_loader(cfg: Optional["DataConfig"], dataset, sampler, batch_size: int, device: torch.device) -> DataLoader:
    """Batches of ``batch_size`` in ``sampler``'s order (``drop_last``); pinned memory on CUDA devices."""
    if isinstance(dataset, TransformedDataset):
        sampler = _EpochIndices(sampler)
    generator = torch.Generator().manual_seed(cfg.seed if cfg is not None else 0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, generator=generator,
                      pin_memory=device.type == "cuda", **_worker_options(cfg, dataset))


def test_loader(cfg: Optional["DataConfig"], dataset, shard: int, num_shards: int, batch_size: int,
                device: Optional[torch.device] = None) -> DataLoader:
    """A strided shard without padding: each test sample is counted exactly once over all shards."""
    generator = torch.Generator().manual_seed(cfg.seed if cfg is not None else 0)
    return DataLoader(Subset(dataset, range(shard, len(dataset), num_shards)), batch_size=max(batch_size, 64),
                      generator=generator, pin_memory=device is not None and device.type == "cuda",
                      **_worker_options(cfg, dataset))
