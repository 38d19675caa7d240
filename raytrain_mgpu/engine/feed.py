"""The engine's data feed: the training split's sampler and loader, the evaluation loaders, the batches of
one epoch and the time a rank waits for them. One home for both runners' loaders (``engine/loaders.py``
builds them) and for Ray Data (``engine/stream.py``: a worker's share of the stream).

Batch arithmetic (nanoGPT style): the global batch B is split over R data-parallel replicas and A
accumulation micro-steps, so each micro-batch holds B / (R * A) samples (a pipeline replica's first stage
reads B / R and splits it into its micro-batches itself). The ``DistributedSampler`` (``drop_last=True``)
gives replica r the positions r, r+R, ... of one seeded permutation per epoch, so optimizer step s always
sees positions [s*B, (s+1)*B) of that permutation: the samples of a step do not depend on R, and a step
checkpoint's resume leaves out the first ``step_in_epoch * B / R`` positions of the replica's share
(``engine/step_checkpoints.ResumableSampler``).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch.utils.data import TensorDataset

from raytrain_mgpu.config.factories import load_factory
from raytrain_mgpu.data.parquet_stream import stream_source
from raytrain_mgpu.data.ray_datasets import PlannedRows
from raytrain_mgpu.engine import stream
from raytrain_mgpu.engine.batches import move_batch
from raytrain_mgpu.engine.liveness import POSITION
from raytrain_mgpu.engine.loaders import prefetch, test_loader, train_loader
from raytrain_mgpu.engine.prefetch import Prefetcher
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler

__all__ = ["Feed", "ResidentBatches", "resident_split", "steps_per_epoch"]

RESIDENT_SHARE = 0.25  # data_on_device=None: a split up to this share of the GPU's free memory stays on it


def resident_split(cfg, dataset, device: torch.device) -> Optional[tuple]:
    """The training split's tensors on ``device`` (``data_on_device``), or None: it stays with the loader."""
    wanted = cfg.data_on_device
    if wanted is False or cfg.ingest == "ray_data" or cfg.train_transform is not None:
        return None
    if not (isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2):
        return None
    size = sum(t.numel() * t.element_size() for t in dataset.tensors)
    if wanted is None:
        if device.type != "cuda" or size > RESIDENT_SHARE * torch.cuda.mem_get_info(device)[0]:
            return None
    return tuple(t.to(device) for t in dataset.tensors)


class ResidentBatches:
    """Batches of a split kept on the device, taken by index in the sampler's order: the samples the DataLoader
    would collate, without collating or copying them each step (one copy of the order per epoch)."""

    def __init__(self, tensors: tuple, sampler, batch: int):
        self.tensors, self.sampler, self.batch = tensors, sampler, batch

    def __len__(self) -> int:
        return len(self.sampler) // self.batch

    def __iter__(self):
        order = torch.tensor(list(self.sampler), dtype=torch.long).to(self.tensors[0].device, non_blocking=True)
        for start in range(0, len(self) * self.batch, self.batch):
            rows = order[start:start + self.batch]
            yield tuple(t.index_select(0, rows) for t in self.tensors)


def steps_per_epoch(cfg, num_train: int, num_shards: int, shard_batch: int) -> int:
    """Full optimizer steps in an epoch of ``num_train`` samples over ``num_shards`` data shards of ``shard_batch``
    samples a step each (a replica's micro-batch x its accumulation steps), or the error: none fits. The one count
    of them: the run plan's (on the driver) and a pipeline stage's report call it too."""
    steps = num_train // num_shards // shard_batch
    if steps == 0:
        raise ValueError(f"TrainConfig.batch_size={cfg.batch_size} is larger than the training split "
                         f"({num_train} samples): no full step fits in an epoch. Lower batch_size.")
    return steps


class Feed:
    """This rank's data: ``steps_per_epoch`` and ``accum`` (micro-steps per step), the same on every rank."""

    def __init__(self, cfg, plan, steps, data, transport):
        self.cfg, self.steps, self.data = cfg, steps, data
        shard, num_shards = steps.shard
        # Micro-steps per optimizer step for this world size: an elastic run's micro-batch is fixed by its max
        # count, so W workers accumulate max x grad_accum_steps / W (the global batch and steps per epoch stay).
        self.accum = steps.accum_at(plan, num_shards)
        self.batch = steps.loader_batch(plan)
        self.sampler = ResumableSampler(data.train, num_replicas=num_shards, rank=shard, shuffle=True,
                                        seed=cfg.seed, drop_last=True)
        self.steps_per_epoch = steps_per_epoch(cfg, len(data.train), num_shards, self.batch * self.accum)
        self.loader, self._streams = None, False
        if steps.reads_data:
            resident = resident_split(cfg, data.train, steps.device)
            self.loader = (ResidentBatches(resident, self.sampler, self.batch) if resident is not None
                           else train_loader(cfg.data, data.train, self.sampler, self.batch, steps.device))
            if cfg.ingest == "ray_data":  # Ray Data streams each replica its share instead
                self.loader = self._stream(cfg, data, transport, shard, num_shards)
        # a replica group evaluates the whole split: its process group, which sums the evaluation, is itself
        ev_shard, ev_shards = (0, 1) if getattr(steps.ctx, "replica_group", None) else (shard, num_shards)
        self.eval_loaders = {split: test_loader(cfg.data, dataset, ev_shard, ev_shards, plan.replica_batch,
                                                steps.device)
                             for split, dataset in (("test", data.test), ("val", data.val)) if dataset is not None}
        self._open: Optional[Prefetcher] = None

    def _stream(self, cfg, data, transport, shard: int, num_shards: int):
        """The ``parquet`` split in its planned order (the positions the loader path's sampler would give, read
        and decoded by Ray Data's tasks: ``data/parquet_stream.py``), a user's materialized Ray Dataset in the same
        order (its rows by position: ``data/ray_datasets.PlannedRows``), or another Ray Dataset of theirs in Ray
        Data's order (the transport's shard)."""
        source = data.train if isinstance(data.train, PlannedRows) else stream_source(data.train)
        if source is not None:
            self.sampler = stream.PlannedSampler(data.train, source.run_starts(), num_replicas=num_shards,
                                                 rank=shard, seed=self.cfg.seed)
            self._streams = True  # the rows come from Ray Data: none to prefetch here
            return stream.PlannedStream(self.sampler, self.batch, self.steps_per_epoch * self.accum, source)
        collate = None if cfg.collate is None else load_factory(cfg.collate, "collate")
        loader = stream.ShardLoader(transport.data_shard(), self.batch, self.steps_per_epoch * self.accum, cfg.seed,
                                    shard, collate)
        self.sampler, self._streams = loader.sampler, True  # set_epoch seeds the stream's local shuffle
        return loader

    def resume_at(self, epoch: int, step_in_epoch: int) -> None:
        """A step checkpoint's epoch goes on after the positions it had trained."""
        self.sampler.resume_at(epoch, step_in_epoch * self.accum * self.batch)

    def epoch(self, epoch: int):
        """The iterator of epoch ``epoch``'s batches on a reading rank (None elsewhere)."""
        self.sampler.set_epoch(epoch)  # the loader hands the epoch to transforms with the indices
        if self._open is not None:
            self._open.close()
            self._open = None
        if self.loader is None:
            return None
        if not self._streams:  # Parquet: load exactly this rank's rows once, before the loader forks
            prefetch(self.data.train, self.sampler)
        batches = iter(self.loader)
        if self.steps.read_ahead:  # a pipeline's first stage: loading runs in its bubble, not before its step
            batches = self._open = Prefetcher(batches)
        return batches

    def batches(self, batches, meter, window, first: Optional[Callable] = None) -> Callable[[], tuple]:
        """``next_batch()``: the next batch on the step runner's device, its wait counted as data wait; ``first``
        sees the first one (the FLOPs' shapes)."""
        device, channels_last = self.steps.device, self.cfg.channels_last

        def next_batch() -> tuple:
            nonlocal first
            started = time.perf_counter()
            POSITION.mark("data")
            x, y = next(batches)
            POSITION.mark("forward")
            waited = time.perf_counter() - started
            meter.data_wait_s += waited
            if window is not None:
                window.add_data_wait(waited)
            if first is not None:
                first, see = None, first
                see(x, y)
            return move_batch(x, y, device, channels_last)

        return next_batch

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None
        getattr(self.loader, "close", lambda: None)()  # a stream's Ray Data execution, where an epoch stopped early
