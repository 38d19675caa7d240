"""``raytrain-mgpu bench-data --num-workers 1 2``: what training workers see of each ingest, as the epoch row
reports it: samples/s and ``data_wait_share`` of 1 and 2 workers fed by the loader path (``ingest="loader"``), the
planned Parquet stream (``ingest="ray_data"``) and Ray Data's own order over the same split (``ray_data_free``:
``streaming_split(equal=True)``, as Ray Train splits a user's Ray Dataset), on the same PNG images.

Each worker is a Ray actor holding 1 CPU, as a Ray Train worker with ``cpus_per_worker=1`` does; it takes its share
of each global batch (``batch_size / workers`` a step) and the step itself is a sleep of ``--step-ms`` (a GPU step:
the host waits on the device, its CPUs free for the data). As the engine does (``engine/feed.Feed.batches``,
``engine/loop.py``'s epoch row), the data wait is the time a worker waits for its next batch, ``data_wait_share``
is every worker's wait over every worker's time in the epoch, and samples/s is the epoch's samples over the mean
worker's time. The figure is the fastest of the timed epochs after a warm-up epoch, with that epoch's wait share.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, Iterable, List, Tuple

__all__ = ["STREAM_PATHS", "run", "report"]

STREAM_PATHS = ("loader", "ray_data", "ray_data_free")
"""The ingests timed for each worker count; ``ray_data_free`` is what the planned order's cost is against."""


class _Worker:
    """One training worker (a Ray actor: :func:`run` makes it remote): its epochs of one ingest, timed."""

    def epochs(self, setup, path: str, rank: int, replicas: int, epochs: int, step_s: float,
               shard=None) -> List[Tuple[int, float, float]]:
        """``(samples, seconds, seconds waiting for data)`` of each epoch after the warm-up one."""
        epoch = _epoch_function(setup, path, rank, replicas, shard)
        timed = [_timed_epoch(epoch(e), step_s) for e in range(epochs + 1)]
        return timed[1:]


def _epoch_function(setup, path: str, rank: int, replicas: int, shard):
    """``epoch(e) -> batches`` of this worker's share: the engine's own samplers and loaders for ``path``."""
    import torch

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine import stream
    from raytrain_mgpu.engine.loaders import prefetch, train_loader
    from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler

    cfg = TrainConfig(dataset="parquet", data_root=setup.parquet_root, seed=setup.seed).data
    micro = setup.batch_size // replicas
    train = build_datasets(cfg).train
    steps = len(train) // replicas // micro
    if path == "ray_data_free":
        loader = stream.ShardLoader(shard, micro, steps, setup.seed, rank)
        return lambda e: (loader.set_epoch(e), loader)[1]
    if path == "ray_data":
        from raytrain_mgpu.data.parquet_stream import stream_source

        source = stream_source(train)
        sampler = stream.PlannedSampler(train, source.run_starts(), num_replicas=replicas, rank=rank, seed=setup.seed)
        planned = stream.PlannedStream(sampler, micro, steps, source)
        return lambda e: (sampler.set_epoch(e), planned)[1]
    sampler = ResumableSampler(train, num_replicas=replicas, rank=rank, shuffle=True, seed=setup.seed, drop_last=True)
    loader = train_loader(cfg, train, sampler, micro, torch.device("cpu"))

    def epoch(e: int):
        sampler.set_epoch(e)
        prefetch(train, sampler)  # as the training loop does, inside the epoch
        return loader
    return epoch


def _timed_epoch(batches: Iterable, step_s: float) -> Tuple[int, float, float]:
    samples, waited, start = 0, 0.0, time.perf_counter()
    iterator = iter(batches)
    while True:
        asked = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:
            break
        waited += time.perf_counter() - asked  # engine/feed.Feed.batches's data wait
        samples += batch[0].shape[0]
        time.sleep(step_s)  # the step: the host waits on the device
    return samples, time.perf_counter() - start, waited


def run(setup, worker_counts: Iterable[int], epochs: int, step_ms: float,
        paths: Iterable[str] = STREAM_PATHS) -> Dict[Tuple[str, int], Tuple[float, float, float]]:
    """``{(path, workers): (samples/s of the fastest epoch, that epoch's data_wait_share, median samples/s)}``
    on the connected Ray; the actors start once, for the largest worker count."""
    import ray

    counts = sorted(set(worker_counts))
    actors = [ray.remote(num_cpus=1)(_Worker).remote() for _ in range(max(counts))]
    try:
        results = {}
        for count in counts:
            for path in paths:
                shards = _free_shards(setup, count) if path == "ray_data_free" else [None] * count
                per_rank = ray.get([actors[r].epochs.remote(setup, path, r, count, epochs, step_ms / 1000, shards[r])
                                    for r in range(count)])
                results[(path, count)] = _figures(per_rank)
        return results
    finally:
        for actor in actors:
            ray.kill(actor)


def _free_shards(setup, count: int) -> list:
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.transports.ray_data import train_dataset

    dataset = train_dataset(TrainConfig(dataset="parquet", data_root=setup.parquet_root, seed=setup.seed).data)
    return dataset.streaming_split(count, equal=True)


def _figures(per_rank: List[List[Tuple[int, float, float]]]) -> Tuple[float, float, float]:
    """The epoch row's figures of each timed epoch over the ranks; the fastest epoch's, and the median rate."""
    epochs = []
    for ranks in zip(*per_rank):
        samples, seconds, waits = (sum(values) for values in zip(*ranks))
        epochs.append((samples / (seconds / len(ranks)), waits / seconds))
    best = max(epochs)
    return best[0], best[1], statistics.median(rate for rate, _ in epochs)


def report(results: Dict[Tuple[str, int], Tuple[float, float, float]], step_ms: float) -> str:
    """One row per ingest and worker count; the planned order against Ray Data's own at each count."""
    lines = [f"{'workers':>7}  {'ingest':<14} {'samples/s':>10} {'median':>10} {'data_wait_share':>16}   "
             f"(a step: {step_ms:g} ms of sleep per worker)"]
    for (path, count), (best, share, median) in results.items():
        lines.append(f"{count:>7}  {path:<14} {best:>10.0f} {median:>10.0f} {share:>16.2f}")
    for (path, count), (best, *_) in results.items():
        free = results.get(("ray_data_free", count))
        if path == "ray_data" and free:
            lines.append(f"planned order vs Ray Data's own, {count} worker(s): {best / free[0]:.2f}x "
                         f"({(best / free[0] - 1) * 100:+.0f} %; the goal: no worse than -10 %)")
    return "\n".join(lines)
