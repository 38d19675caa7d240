"""Images per second delivered to the training loop: our Parquet reader vs torchvision ``ImageFolder``.

    raytrain-mgpu bench-data [--data-root FOLDER] [--loader-workers 0 1 2]

The same PNG images twice: a Parquet folder (one binary PNG per row; ``--data-root``, or written
here from random images) and an ``ImageFolder`` tree of ``.png`` files (written here from the
Parquet rows' bytes, unchanged). Each path delivers the same normalised ``float32`` tensors in
batches of ``--batch-size`` to a consumer loop that only counts them:

- ``parquet``: ``dataset="parquet"`` through ``engine/loaders.py``, exactly as a training worker
  reads it (a ``DistributedSampler`` shuffle, ``prefetch`` of the epoch's rows, ``loader_workers``);
- ``imagefolder``: ``torchvision.datasets.ImageFolder`` (PIL decode, ``v2.ToImage``, ``ToDtype``,
  ``Normalize``) in a ``DataLoader`` with ``shuffle=True`` and the same ``num_workers``, started as ours;
- ``ray_data`` and ``ray_data_free`` (with ``--ray-data``): ``ingest="ray_data"``'s stream of one training
  worker (read and decoded by Ray Data's tasks on a local Ray's CPUs; loader workers do not apply, so
  their rows repeat one configuration at each count): the planned order a training worker reads
  (``data/parquet_stream.py``), and Ray Data's own order (``read_parquet``, a seeded file shuffle, a
  local shuffle buffer: ``transports/ray_data.train_dataset``), the cost of the plan beside it.

An epoch is timed from the start of its iterator (worker start-up and the prefetch included) to
its last batch, ``--epochs`` epochs per round after a warm-up epoch, ``--rounds`` rounds interleaved.
A path's figure is its fastest epoch (on a shared machine other processes only ever add time; the
median is printed beside it). :data:`PATHS` lists the paths; another ingest adds
an entry (name, epoch function).

With ``--num-workers 1 2``, a second table: training workers (Ray actors of 1 CPU each, a sleep for a step)
fed by the loader path, the planned stream and Ray Data's own order, with the epoch row's samples/s and
``data_wait_share``, and the planned order against Ray Data's own (``bench/data_stream.py``). Its local Ray
declares the machine's CPUs, or one more than the most workers where that is more.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from raytrain_mgpu._cli_options import renamed

__all__ = ["PATHS", "Setup", "add_arguments", "run", "report", "run_and_print", "write_images"]


@dataclass
class Setup:
    """What every path reads: the same images in two layouts."""

    parquet_root: str
    imagefolder_root: str
    num_images: int
    image_shape: tuple
    batch_size: int
    seed: int


EpochFunction = Callable[[Setup, int], Callable[[int], Iterable]]
"""``(setup, loader_workers) -> epoch(e) -> batches ((x, y) pairs)``: built once, called per epoch."""


def _parquet_epochs(setup: Setup, workers: int) -> Callable[[int], Iterable]:
    import torch
    from torch.utils.data import DistributedSampler

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine.loaders import prefetch, train_loader

    cfg = TrainConfig(dataset="parquet", data_root=setup.parquet_root, loader_workers=workers, seed=setup.seed).data
    data = build_datasets(cfg)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=setup.seed, drop_last=True)
    loader = train_loader(cfg, data.train, sampler, setup.batch_size, torch.device("cpu"))

    def epoch(e: int) -> Iterable:
        sampler.set_epoch(e)
        prefetch(data.train, sampler)  # as the training loop does, inside the timed epoch
        return loader
    return epoch


def _imagefolder_epochs(setup: Setup, workers: int) -> Callable[[int], Iterable]:
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    from raytrain_mgpu.engine.loaders import worker_context

    channels = setup.image_shape[0]
    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.5] * channels, [0.5] * channels)])
    dataset = ImageFolder(setup.imagefolder_root, transform=transform, loader=functools.partial(_pil_open, channels=channels))
    # its workers start as ours do (engine/loaders.worker_context): the ratio compares the readers alone
    loader = DataLoader(dataset, batch_size=setup.batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(setup.seed),
                        multiprocessing_context=worker_context() if workers else None)
    return lambda e: loader


def _pil_open(path: str, channels: int):
    from PIL import Image

    with open(path, "rb") as f:
        return Image.open(f).convert("L" if channels == 1 else "RGB")


def _ray_data_epochs(setup: Setup, workers: int) -> Callable[[int], Iterable]:
    """``ingest="ray_data"``: one training worker's stream in its planned order (``engine/stream.py``,
    ``data/parquet_stream.py``); Ray Data decodes on the Ray instance's CPUs (:func:`_local_ray`): ``workers``
    does not apply."""
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.data.parquet_stream import stream_source
    from raytrain_mgpu.engine.stream import PlannedSampler, PlannedStream

    train = build_datasets(TrainConfig(dataset="parquet", data_root=setup.parquet_root, seed=setup.seed).data).train
    source = stream_source(train)
    sampler = PlannedSampler(train, source.run_starts(), num_replicas=1, rank=0, seed=setup.seed)
    loader = PlannedStream(sampler, setup.batch_size, len(train) // setup.batch_size, source)

    def epoch(e: int) -> Iterable:
        sampler.set_epoch(e)
        return loader
    return epoch


def _ray_data_free_epochs(setup: Setup, workers: int) -> Callable[[int], Iterable]:
    """Ray Data's own order over the whole split (``transports/ray_data.train_dataset``, through the local
    shuffle buffer of a user's Ray Datasets): what the planned order costs against."""
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.engine.stream import ShardLoader
    from raytrain_mgpu.transports.ray_data import train_dataset

    dataset = train_dataset(TrainConfig(dataset="parquet", data_root=setup.parquet_root, seed=setup.seed).data)
    loader = ShardLoader(dataset.iterator(), setup.batch_size, setup.num_images // setup.batch_size, setup.seed, 0)

    def epoch(e: int) -> Iterable:
        loader.set_epoch(e)
        return loader
    return epoch


PATHS: List[Tuple[str, EpochFunction]] = [
    ("parquet", _parquet_epochs),
    ("imagefolder", _imagefolder_epochs),
]
"""The paths timed side by side; ``imagefolder`` is the reference of the ratios."""
RAY_DATA_PATHS: List[Tuple[str, EpochFunction]] = [("ray_data", _ray_data_epochs),
                                                    ("ray_data_free", _ray_data_free_epochs)]
"""Timed too with ``--ray-data`` (it starts a local Ray, a few seconds)."""


@contextlib.contextmanager
def _local_ray(needed: bool, num_cpus: Optional[int] = None):
    """A local Ray for the ``ray_data`` paths, unless one is connected; shut down after the timing."""
    import ray

    started = needed and not ray.is_initialized()
    if started:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        if started:
            ray.shutdown()


# ----------------------------------------------------------------------------- the images


def write_images(parquet_root: str, num_images: int, shape: tuple, seed: int, num_classes: int = 10) -> None:
    """``num_images`` random PNG images (smooth blobs plus noise, so they compress like photos
    rather than like noise) as ``parquet_root/train/part-0.parquet`` and a small ``test`` split."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels, height, width = shape
    yy, xx = np.mgrid[0:height, 0:width]

    def png(label: int) -> bytes:
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(width / 8, width / 2)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[None] * rng.uniform(60, 200, (channels, 1, 1))
        pixels = np.clip(blob + 25 * label + rng.normal(0, 12, shape), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels[0] if channels == 1 else pixels.transpose(1, 2, 0))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    for split, rows in (("train", num_images), ("test", max(1, num_images // 10))):
        labels = rng.integers(0, num_classes, rows)
        table = pa.table({"image": pa.array([png(int(y)) for y in labels], pa.binary()), "label": labels})
        os.makedirs(os.path.join(parquet_root, split), exist_ok=True)
        pq.write_table(table, os.path.join(parquet_root, split, "part-0.parquet"), row_group_size=1024)


def export_imagefolder(parquet_root: str, out: str) -> int:
    """The PNG bytes of the rows our reader trains on, unchanged, as ``out/<label>/<row>.png`` (the
    ``train/`` folder, or without one every row but each tenth, ``parquet``'s test split); the count."""
    import pyarrow.dataset as ds

    from raytrain_mgpu.data.parquet import TEST_EVERY

    split = os.path.join(parquet_root, "train")
    table = ds.dataset(split if os.path.isdir(split) else parquet_root, format="parquet").to_table(
        columns=["image", "label"])
    images, labels = table.column("image").to_pylist(), table.column("label").to_pylist()
    rows = range(len(images)) if os.path.isdir(split) else [r for r in range(len(images)) if r % TEST_EVERY != TEST_EVERY - 1]
    for row in rows:
        value, label = images[row], labels[row]
        data = value["bytes"] if isinstance(value, dict) else value
        if not isinstance(data, bytes) or not data.startswith(b"\x89PNG"):
            raise ValueError(f"bench-data: row {row} of {parquet_root} is not a PNG image. Point --data-root at "
                             f"a Parquet folder of PNG bytes (an 'image' and a 'label' column), or leave it unset.")
        os.makedirs(os.path.join(out, f"{int(label):04d}"), exist_ok=True)
        with open(os.path.join(out, f"{int(label):04d}", f"{row:07d}.png"), "wb") as f:
            f.write(data)
    return len(rows)


# ----------------------------------------------------------------------------- timing


def _time_epochs(epoch: Callable[[int], Iterable], epochs: int) -> List[float]:
    """Images/s of each of ``epochs`` epochs, after one warm-up epoch."""
    rates = []
    for e in range(epochs + 1):
        start, count = time.perf_counter(), 0
        for x, _ in epoch(e):
            count += x.shape[0]  # the consumer: counts what it receives
        if e > 0:
            rates.append(count / (time.perf_counter() - start))
    return rates


def run(setup: Setup, workers: Iterable[int], epochs: int, rounds: int = 1,
        paths: Optional[List[Tuple[str, EpochFunction]]] = None) -> Dict[Tuple[str, int], Tuple[float, float]]:
    """``{(path, loader workers): (fastest epoch's images/s, median)}``; every path and worker count once
    per round, in an order rotated from round to round (a shared machine drifts between rounds)."""
    combos = [(name, build, count) for count in workers for name, build in (paths or PATHS)]
    rates: Dict[Tuple[str, int], List[float]] = {(name, count): [] for name, _, count in combos}
    for r in range(rounds):
        for name, build, count in combos[r % len(combos):] + combos[:r % len(combos)]:
            rates[(name, count)] += _time_epochs(build(setup, count), epochs)
    return {key: (max(values), statistics.median(values)) for key, values in rates.items()}


def report(results: Dict[Tuple[str, int], Tuple[float, float]], reference: str = "imagefolder") -> str:
    """The fastest epoch is the figure (other processes only ever add time); the median shows the spread."""
    lines = [f"{'loader workers':>14}  {'path':<12} {'images/s':>10} {'median':>10}  vs {reference}"]
    for (name, count), (best, median) in results.items():
        base = results.get((reference, count))
        ratio = f"{best / base[0]:.2f}x" if base else "-"
        lines.append(f"{count:>14}  {name:<12} {best:>10.0f} {median:>10.0f}  {ratio}")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--data-root", help="Parquet folder of PNG images (an 'image' and a 'label' column; default: "
                                            "random images written to a temporary folder)")
    parser.add_argument("--num-images", type=int, default=4096, help="images to write when --data-root is unset")
    parser.add_argument("--image-size", type=int, default=32, help="height and width of the written images")
    parser.add_argument("--channels", type=int, default=3, choices=(1, 3), help="channels of the written images")
    parser.add_argument("--batch-size", type=int, default=128, help="images per batch delivered to the loop")
    parser.add_argument("--loader-workers", type=int, nargs="+", default=[0, 1, 2], help="loader worker counts")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per path and round (after a warm-up epoch)")
    parser.add_argument("--rounds", type=int, default=3, help="times every path runs, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-data", action="store_true", help="also time ingest='ray_data' (Ray Data's tasks decode "
                                                                "on a local Ray's CPUs; loader workers do not apply)")
    workers = parser.add_argument("--num-workers", type=int, nargs="*", default=[],
                                  help="also time training workers (Ray actors of 1 CPU) fed by each ingest: "
                                       "samples/s and data_wait_share, per worker count (e.g. 1 2)")
    renamed(parser, workers, "--train-workers")
    parser.add_argument("--step-ms", type=float, default=10.0, help="a training worker's step (a sleep, as a GPU step "
                                                                   "leaves the host waiting), with --num-workers")


def run_and_print(args) -> int:
    with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-data-") as scratch:
        root = args.data_root
        if root is None:
            root = os.path.join(scratch, "parquet")
            write_images(root, args.num_images, (args.channels, args.image_size, args.image_size), args.seed)
        folder = os.path.join(scratch, "imagefolder")
        num_images = export_imagefolder(root, folder)
        from raytrain_mgpu.data import check_data
        from raytrain_mgpu.config.train import TrainConfig

        shape, _ = check_data(TrainConfig(dataset="parquet", data_root=root).data)
        setup = Setup(root, folder, num_images, shape, args.batch_size, args.seed)
        print(f"bench-data: {num_images} PNG images {'x'.join(map(str, shape))} from {args.data_root or 'random images'}"
              f", batch {args.batch_size}, {os.cpu_count()} CPU cores; fastest and median epoch of {args.rounds} "
              f"round(s) x {args.epochs} epoch(s); the same files as Parquet rows and as an ImageFolder tree", flush=True)
        paths = PATHS + (RAY_DATA_PATHS if args.ray_data else [])
        workers = args.num_workers
        # the workers' CPUs and at least one for Ray Data's tasks (more than a 2-core machine has: said below)
        cpus = max(os.cpu_count() or 1, max(workers) + 1) if workers else None
        with _local_ray(args.ray_data or bool(workers), cpus):
            print(report(run(setup, args.loader_workers, args.epochs, args.rounds, paths)), flush=True)
            if workers:
                _print_training_rows(setup, workers, args.epochs, args.step_ms)
    return 0


def _print_training_rows(setup: Setup, workers: List[int], epochs: int, step_ms: float) -> None:
    import ray

    from raytrain_mgpu.bench import data_stream

    print(f"\ntraining workers on a Ray of {ray.cluster_resources().get('CPU', 0):g} CPU ({os.cpu_count()} cores): "
          f"fastest of {epochs} epoch(s) after a warm-up", flush=True)
    print(data_stream.report(data_stream.run(setup, workers, epochs, step_ms), step_ms))
