"""A worker's share of a Ray Data stream as the engine's loader (``ingest="ray_data"``, or the user's own Ray
Datasets): the transport hands over the shard (``Transport.data_shard``); nothing here imports Ray. How the
stream is made on the driver: ``transports/ray_data.py``."""

from __future__ import annotations

from typing import Callable, Iterator, Optional

__all__ = ["ShardLoader", "SHUFFLE_BUFFER_BATCHES"]

SHUFFLE_BUFFER_BATCHES = 4
"""Micro-batches in the local shuffle buffer of each worker's stream (seeded by seed, epoch and rank)."""


class ShardLoader:
    """This worker's micro-batches of one epoch from its Ray Data shard, as ``(x, y)`` tensors.

    ``len()`` is the planned number of micro-batches (the same on every rank). The stream is read
    to its end with the last of them (under one micro-batch is left); an epoch that stops early
    (``max_steps``, a partial last step) leaves the rest, which the next ``iter()`` reads off first.
    """

    def __init__(self, shard, micro_batch: int, num_batches: int, seed: int, rank: int,
                 collate: Optional[Callable] = None):
        self.shard, self.micro_batch, self.num_batches = shard, micro_batch, num_batches
        self.collate = collate  # the user's, for their own Ray Datasets (data/ray_datasets.py): NumPy batch -> (x, y)
        self.seed, self.rank, self.epoch = seed, rank, 0
        self._open: Optional[Iterator] = None
        self.sampler = _EpochOnly(self)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator:
        self._drain()  # the previous epoch's stream, where the loop stopped early
        shuffle = dict(local_shuffle_buffer_size=SHUFFLE_BUFFER_BATCHES * self.micro_batch,
                       local_shuffle_seed=(self.seed * 1_000_003 + self.epoch) * 1009 + self.rank)
        if self.collate is None:  # the parquet dataset's stream: {"x", "y"} tensors
            batches = self.shard.iter_torch_batches(batch_size=self.micro_batch, drop_last=True, device="cpu",
                                                    **shuffle)
        else:
            batches = map(self.collate, self.shard.iter_batches(batch_size=self.micro_batch, drop_last=True,
                                                                batch_format="numpy", **shuffle))
        self._open = iter(batches)
        return self._batches(self._open)

    def _batches(self, stream: Iterator) -> Iterator:
        for count in range(self.num_batches):
            batch = next(stream, None)
            if batch is None:
                raise RuntimeError(f"ingest='ray_data': rank {self.rank}'s shard ended after {count} of "
                                   f"{self.num_batches} micro-batches of {self.micro_batch}; Ray Data's equal "
                                   f"split should give every rank the same rows. Use ingest='loader'.")
            if count == self.num_batches - 1:  # the rest is under one micro-batch (drop_last): end the stream now
                self._drain()
            yield (batch["x"], batch["y"]) if self.collate is None else batch

    def _drain(self) -> None:
        if self._open is not None:
            for _ in self._open:
                pass
            self._open = None


class _EpochOnly:
    """What the loop's per-epoch calls see in place of a ``DistributedSampler``: ``set_epoch``, and no
    indices (the ``parquet`` reader's ``prefetch`` gets none: the rows come from the stream)."""

    def __init__(self, loader: ShardLoader):
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        return iter(())
