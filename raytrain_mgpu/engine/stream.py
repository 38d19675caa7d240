"""A worker's share of a Ray Data stream as the engine's loader (``ingest="ray_data"``, or the user's own Ray
Datasets). Nothing here imports Ray.

The ``parquet`` split streams in a planned order (:class:`PlannedSampler`, :class:`PlannedStream`): each epoch's
order is decided by the seed, the epoch and the row groups' sizes (:func:`planned_order`), and split over the
replicas by global position as ``DistributedSampler`` splits the loader path's (replica r takes positions r, r+R,
...): optimizer step s trains positions ``[s*B, (s+1)*B)`` of the epoch's order whatever the number of replicas R,
and a step checkpoint's resume starts the replica's share ``step_in_epoch * B / R`` positions in
(``engine/step_checkpoints.ResumableSampler``), also at another worker count. The samples come from Ray Data's CPU
tasks in that order (``data/parquet_stream.py``).

A user's own materialized Ray Dataset streams in the same planned order, its rows taken by position from its
blocks (``data/ray_datasets.PlannedRows``). Another Ray Dataset of theirs streams in Ray Data's order
(:class:`ShardLoader`, over the equal share the transport hands over: ``Transport.data_shard``), through a local
shuffle buffer: no checkpoints inside an epoch there (``data/ray_datasets.check_fields``).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler

__all__ = ["ShardLoader", "SHUFFLE_BUFFER_BATCHES", "PlannedSampler", "PlannedStream", "planned_order",
           "WINDOW_ROWS"]

SHUFFLE_BUFFER_BATCHES = 4
"""Micro-batches in the local shuffle buffer of each worker's stream of a user's Ray Dataset (seeded by seed,
epoch and rank)."""
WINDOW_ROWS = 8192
"""Samples the planned order shuffles together: a split up to this size is one window, shuffled whole (the
loader path's permutation); a larger one is cut into windows of whole row groups, so that a read task reads a
row group once for all the samples it needs from it."""


def planned_order(num_samples: int, seed: int, epoch: int, run_starts: Optional[Sequence[int]] = None,
                  window_rows: int = WINDOW_ROWS) -> torch.Tensor:
    """The epoch's order of the split's sample indices, from (seed, epoch) and the runs of indices that share a
    row group (``run_starts``: where each run starts).

    Up to ``window_rows`` samples: ``DistributedSampler``'s own permutation (``randperm`` seeded by seed + epoch),
    so such a stream trains the loader path's steps. Larger: the runs in a seeded order, gathered into windows of
    at least ``window_rows`` samples, each window shuffled (the same generator, in turn)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    if run_starts is None or num_samples <= window_rows:
        return torch.randperm(num_samples, generator=generator)
    bounds = list(run_starts) + [num_samples]
    pieces, window, size = [], [], 0
    for position, run in enumerate(torch.randperm(len(bounds) - 1, generator=generator).tolist()):
        window.append(torch.arange(bounds[run], bounds[run + 1]))
        size += bounds[run + 1] - bounds[run]
        if size >= window_rows or position == len(bounds) - 2:  # a full window, or the last runs
            indices = torch.cat(window)
            pieces.append(indices[torch.randperm(len(indices), generator=generator)])
            window, size = [], 0
    return torch.cat(pieces)


class PlannedSampler(ResumableSampler):
    """``DistributedSampler(drop_last=True)``'s split of :func:`planned_order` (positions rank, rank + R, ... of
    the order cut to a multiple of R), with the resumed epoch's first ``skip`` positions left out."""

    def __init__(self, dataset, run_starts: Optional[Sequence[int]], window_rows: int = WINDOW_ROWS, **kwargs):
        super().__init__(dataset, shuffle=True, drop_last=True, **kwargs)
        self.run_starts, self.window_rows = run_starts, window_rows

    def __iter__(self) -> Iterator[int]:
        order = planned_order(len(self.dataset), self.seed, self.epoch, self.run_starts, self.window_rows)
        share = order[:self.total_size][self.rank::self.num_replicas].tolist()
        skip = self.skip if self.epoch == self.resume_epoch else 0
        return iter(share[skip:])

    def __len__(self) -> int:
        return self.num_samples - (self.skip if self.epoch == self.resume_epoch else 0)


class PlannedStream:
    """This rank's micro-batches of an epoch in its sampler's order, read by ``source`` (a
    ``data/parquet_stream.ParquetStream``: Ray Data's tasks decode them): the ``num_batches`` micro-batches of
    ``micro_batch`` an epoch trains (the rest, under one step, never read), fewer by those a resumed epoch had
    trained."""

    def __init__(self, sampler: PlannedSampler, micro_batch: int, num_batches: int, source):
        self.sampler, self.micro_batch, self.num_batches, self.source = sampler, micro_batch, num_batches, source
        self._open: Optional[Iterator] = None

    def __len__(self) -> int:
        return self._wanted(len(self.sampler)) // self.micro_batch

    def _wanted(self, left: int) -> int:
        """Positions of the ``left`` in this epoch's share that train (the share's tail past the steps does not)."""
        return self.num_batches * self.micro_batch - (self.sampler.num_samples - left)

    def __iter__(self) -> Iterator:
        self.close()  # the previous epoch's stream, where the loop stopped early (max_steps)
        indices = list(self.sampler)
        indices = indices[:self._wanted(len(indices))]
        self._open = iter(self.source.batches(indices, self.sampler.epoch, self.micro_batch))
        return self._batches(self._open, len(indices) // self.micro_batch)

    def _batches(self, stream: Iterator, wanted: int) -> Iterator:
        for count in range(wanted):
            batch = next(stream, None)
            if batch is None:
                raise RuntimeError(f"ingest='ray_data': rank {self.sampler.rank}'s stream ended after {count} of "
                                   f"{wanted} planned micro-batches of {self.micro_batch}. Ray Data lost rows of the "
                                   f"planned order; use ingest='loader' and report this.")
            yield batch
        self.close()

    def close(self) -> None:
        if self._open is not None:
            getattr(self._open, "close", lambda: None)()
            self._open = None


class ShardLoader:
    """This worker's micro-batches of one epoch from its Ray Data shard, in Ray Data's order (a user's Ray Dataset
    that is not materialized, collated by their ``collate``; ``bench-data``'s free-order baseline: ``(x, y)``).

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
