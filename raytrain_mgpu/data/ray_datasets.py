"""Your own Ray Datasets: ``TrainConfig(dataset={"train": ds, "test": ds}, collate=fn)``, from Python.

Ray Train users hand ``TorchTrainer(datasets={...})`` their ``ray.data.Dataset`` s; ``dataset=``
takes the same dict (``"train"`` and ``"test"``, and ``"val"`` if there is one): any source, any
columns, any ``map_batches`` of the user's before. ``collate(batch)`` turns a batch, a dict of
NumPy arrays (one per column, as ``Dataset.iter_batches`` gives it), into ``(inputs, targets)``;
``inputs`` may be a tensor or a dict of tensors (the model's keyword arguments,
``raytrain_mgpu.engine.batches``).

How each split is read:

- ``train``, materialized (``ds.materialize()``, or ``from_items``/``from_numpy``/``from_pandas``/
  ``from_arrow``, which are): its rows have positions (row ``i`` of its blocks in order), so it trains in
  the planned order of ``ingest="ray_data"``'s Parquet stream (``engine/stream.py``: decided by seed, epoch
  and the blocks, split over the replicas as ``DistributedSampler`` splits the loader path's), and a step,
  time or preemption checkpoint resumes at its step, also at another worker count. Every worker gets the
  whole Dataset (Ray Train does not split it: :func:`datasets_to_split`) and reads its positions from the
  blocks in the object store (:class:`PlannedRows`), collating them on the worker.
- ``train``, not materialized (a read, a ``map_batches`` still to run): Ray Data's order, which a restart does
  not repeat. Ray Train's ``DataConfig`` gives each worker an equal share (``streaming_split(equal=True)``:
  ``rows // num_workers``, the count ``DistributedSampler(drop_last=True)`` gives), read in micro-batches
  through a local shuffle buffer seeded per epoch and rank (``engine/stream.ShardLoader``); checkpoints
  inside an epoch are refused (:func:`check_fields`) and preemption notices not acted on.
- ``test`` and ``val`` are read whole by every worker once, at its start (Ray Train hands the
  datasets it does not split to each worker whole), and collated in one call; evaluation then
  shards them exactly as the loader path does (each sample once over the ranks). They must fit in
  a worker's memory.

``fit`` turns the dict into a :class:`RayDataSplits` before anything else (:func:`take`): it
counts the training rows (``Dataset.count()``: metadata only where the source has it; a materialized
split's blocks' row counts) and collates two rows for the input shape, on the driver, before any worker
starts. The record is what the workers get as ``dataset`` and what the run folder keeps (its class, split
names and row count); the Datasets themselves reach the workers through Ray Train (``transports/ray_data``)
or the pipeline's driver (:func:`driver_shards`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Tuple

from raytrain_mgpu.config.factories import load_factory

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig
    from raytrain_mgpu.data.base import Datasets

__all__ = ["SPLITS", "RayDataSplits", "PlannedRows", "is_ray_datasets", "is_materialized", "planned",
           "check_fields", "take", "datasets_to_split", "CHUNK_ROWS"]

SPLITS = ("train", "val", "test")
CHUNK_ROWS = 8192
"""Positions of a rank's share :class:`PlannedRows` gathers at a time (each block they touch fetched once)."""


def is_ray_datasets(value) -> bool:
    """A dict of Ray Datasets (duck-typed: this check imports no Ray)."""
    return (isinstance(value, dict) and bool(value)
            and all(hasattr(v, "streaming_split") and hasattr(v, "iter_batches") for v in value.values()))


def is_materialized(dataset) -> bool:
    """A ``ray.data.MaterializedDataset`` (by its class's name: this check imports no Ray): rows in blocks that
    stay put, each with its position."""
    return any(cls.__name__ == "MaterializedDataset" for cls in type(dataset).__mro__)


def planned(dataset) -> bool:
    """Whether a dict of Ray Datasets (or fit's record of one) trains in a planned order that a checkpoint inside
    an epoch resumes: its training split is materialized."""
    if isinstance(dataset, RayDataSplits):
        return dataset.block_rows is not None
    return is_ray_datasets(dataset) and "train" in dataset and is_materialized(dataset["train"])


def check_fields(cfg) -> None:
    """The config around a dict of Ray Datasets, before Ray (``config_checks.validate``)."""
    splits = cfg.dataset
    if not is_ray_datasets(splits):
        return
    names = sorted(splits)
    if "train" not in splits or "test" not in splits or not set(splits) <= set(SPLITS):
        raise ValueError(f"TrainConfig.dataset: a dict of Ray Datasets with the splits {names}; it takes 'train' and "
                         f"'test', and 'val' if there is one. Name them so, e.g. dataset={{'train': train_ds, "
                         f"'test': test_ds}}.")
    if cfg.collate is None:
        raise ValueError("TrainConfig.collate=None: Ray Datasets need a function that turns a batch (a dict of NumPy "
                         "arrays, one per column) into (inputs, targets) tensors. Set collate=, e.g. "
                         "lambda b: (torch.as_tensor(b['image']), torch.as_tensor(b['label'])).")
    for name, fix in (("val_fraction", "pass a 'val' Dataset instead (e.g. train_ds.split_proportionately([0.1]))"),
                      ("train_transform", "apply it in your Dataset (map_batches) or in collate"),
                      ("test_transform", "apply it in your Dataset (map_batches) or in collate")):
        if getattr(cfg, name) is not None:
            raise ValueError(f"TrainConfig.{name}={getattr(cfg, name)!r} does not apply to Ray Datasets: "
                             f"{fix}, and leave {name} unset.")
    if planned(splits):
        return
    for name in ("checkpoint_every_n_steps", "checkpoint_every_n_minutes"):
        if getattr(cfg, name) is not None:
            raise ValueError(
                f"TrainConfig.{name}={getattr(cfg, name)!r} with dataset['train'] a {type(splits['train']).__name__}, "
                f"not materialized: a checkpoint inside an epoch resumes at a position of the epoch's order, and this "
                f"Dataset streams in Ray Data's order, which a restart does not repeat. Materialize it "
                f"(dataset={{'train': train_ds.materialize(), ...}}: its rows then train in a planned order and a "
                f"checkpoint resumes at its step), or write it to Parquet (train_ds.write_parquet(DIR)) and stream it "
                f"with dataset='parquet', data_root=DIR, ingest='ray_data'; or leave {name} unset (checkpoints at "
                f"epoch ends).")


def take(cfg) -> Any:
    """``cfg`` with its dict of Ray Datasets replaced by their :class:`RayDataSplits` (and
    ``ingest="ray_data"``): what ``fit`` trains. Reads two rows and counts the training split."""
    if not is_ray_datasets(cfg.dataset):
        return cfg
    splits = dict(cfg.dataset)
    collate = load_factory(cfg.collate, "collate")
    peek = splits["train"].take_batch(2, batch_format="numpy")
    try:
        inputs, _ = collate(peek)
    except Exception as exc:  # the user's function on their own columns: say which
        raise ValueError(f"TrainConfig.collate: calling it on two rows of the training split (columns "
                         f"{sorted(peek)}) raised {type(exc).__name__}: {exc}. It takes a dict of NumPy arrays "
                         f"and returns (inputs, targets).") from exc
    block_rows = _block_rows(splits["train"]) if planned(splits) else None
    num_train = sum(block_rows) if block_rows is not None else splits["train"].count()
    record = RayDataSplits(tuple(name for name in SPLITS if name in splits), num_train, _sample_shape(inputs),
                           cfg.num_classes, datasets=splits, block_rows=block_rows)
    return cfg.replace(dataset=record, ingest="ray_data")


def _block_rows(dataset) -> list:
    """The row count of each block of a materialized Dataset, in its order (metadata: no block is read; its plan is
    its blocks, which an execution hands on as they are, no task between)."""
    return [meta.num_rows for bundle in dataset.iter_internal_ref_bundles() for meta in bundle.metadata]


def datasets_to_split(record: "RayDataSplits") -> list:
    """The splits Ray Train's ``DataConfig`` shares out (``streaming_split``): ``train`` where it streams in Ray Data's
    order; none where it is planned (every worker reads its own positions of the whole Dataset)."""
    return [] if planned(record) else ["train"]


def _sample_shape(inputs) -> Any:
    """One sample's shape: a tuple, or a dict (tuple) of them for structured inputs."""
    if isinstance(inputs, dict):
        return {key: _sample_shape(value) for key, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(_sample_shape(value) for value in inputs)
    return tuple(inputs.shape[1:])


class RayDataSplits:
    """What a worker builds its splits from (a dataset factory: ``build_datasets`` calls it), and what
    the run folder records: the split names, the training rows, the input shape and classes.

    The Datasets stay on the driver: ``datasets`` is not pickled (nor copied) with the config; Ray
    Train hands them to the workers (``transports/ray_data.trainer_datasets``). ``block_rows``: a materialized
    training split's blocks' row counts (a list: the run folder's record leaves it out, so a resume may bring the
    same rows in other blocks: the planned order does not depend on them), None where it streams in Ray Data's
    order."""

    def __init__(self, splits: Tuple[str, ...], num_train: int, input_shape: Any, num_classes: Optional[int],
                 datasets: Optional[dict] = None, block_rows: Optional[list] = None):
        self.splits, self.num_train = splits, int(num_train)
        self.input_shape, self.num_classes = input_shape, num_classes
        self.datasets = datasets
        self.block_rows = None if block_rows is None else [int(rows) for rows in block_rows]

    def __getstate__(self) -> dict:
        return {**vars(self), "datasets": None}

    def __deepcopy__(self, memo) -> "RayDataSplits":
        return self  # immutable in use; dataclasses.asdict (TrainConfig.to_dict) copies fields

    def __repr__(self) -> str:
        order = "planned" if self.block_rows is not None else "Ray Data's order"
        return f"RayDataSplits({list(self.splits)}, {self.num_train} training rows, {order})"

    def __call__(self, cfg: "DataConfig") -> "Datasets":
        """On a training process: the evaluated splits read whole and collated; ``train`` is streamed by the
        engine's feed (``engine/feed.py``): a materialized one by position (:class:`PlannedRows`), else here only its
        size. The splits' iterators come from Ray Train (``ray.train.get_dataset_shard``) or, on a pipeline's stage
        actor, from its driver (:func:`use_shards`)."""
        from raytrain_mgpu.data.base import Datasets  # late: loads torch; the fields' check needs none

        shard = _SHARDS.get("provider")
        if shard is None:
            import ray.train  # late: loads Ray; the config checks import this module

            shard = ray.train.get_dataset_shard
        collate = load_factory(cfg.collate, "collate")
        evaluated = {name: _read_whole(shard(name), collate) for name in ("test", "val") if name in self.splits}
        train = (_Sized(self.num_train) if self.block_rows is None
                 else PlannedRows(shard("train"), collate, self.block_rows))
        return Datasets(train, evaluated["test"], self.input_shape, self.num_classes, val=evaluated.get("val"))


_SHARDS: dict = {}


def use_shards(shards: Optional[dict]) -> None:
    """In this process, the splits' iterators are ``shards[name]`` (a pipeline stage's, from its driver), not Ray
    Train's; None: Ray Train's again."""
    if shards is None:
        _SHARDS.pop("provider", None)
    else:
        _SHARDS["provider"] = shards.__getitem__


def driver_shards(cfg, num_replicas: int) -> list:
    """On the driver, for a pipeline: each replica's ``{"train": its equal share of the stream, "test"/"val": the
    whole split}`` of the user's Ray Datasets (``cfg.dataset``, a :class:`RayDataSplits` with its Datasets)."""
    datasets = cfg.dataset.datasets
    if datasets is None:
        raise ValueError(f"TrainConfig.dataset={cfg.dataset!r} arrived without its Ray Datasets (they stay in the "
                         f"driver that read them). Pass the dict of Ray Datasets to fit in this process.")
    if planned(cfg.dataset):  # every replica reads its own positions of the whole split
        trains = [datasets["train"].iterator() for _ in range(num_replicas)]
    else:
        trains = datasets["train"].streaming_split(num_replicas, equal=True)
    return [{"train": train, **{name: datasets[name].iterator() for name in ("test", "val") if name in datasets}}
            for train in trains]


class _Sized:
    """The streamed training split, seen by the loop's sampler and sizes: its length only."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        raise TypeError("the training split of Ray Datasets is streamed (transports/ray_data.py), not indexed")


RUN_ROWS = 256
"""Consecutive positions of a materialized split that the planned order keeps together (``PlannedRows.run_starts``)."""


class PlannedRows:
    """A materialized training split by position: sample ``i`` is row ``i`` of its blocks in order. The source a
    ``engine/stream.PlannedStream`` reads a rank's planned positions from (as ``data/parquet_stream.ParquetStream``
    for Parquet): :meth:`run_starts` (runs of positions the planned order's windows keep whole) and :meth:`batches`.

    ``iterator``: the whole split's ``DataIterator`` (Ray Train's unsplit dataset shard, or the pipeline driver's);
    its blocks' references are taken once, on first use (``DataIterator.materialize``: the blocks themselves stay in
    the object store). Each :data:`CHUNK_ROWS` positions fetch the blocks they touch once (``ray.get``: zero-copy
    from this node's object store, a transfer from another node's), take their rows in the planned order, and the
    user's ``collate`` turns each micro-batch into tensors here, on the training process."""

    def __init__(self, iterator, collate: Callable, block_rows: list):
        import numpy as np  # late: numpy (0.1 s of import); the config checks import this module

        self.iterator, self.collate, self.block_rows = iterator, collate, list(block_rows)
        self.starts = np.concatenate([[0], np.cumsum(self.block_rows)]).astype(np.int64)
        self._refs: Optional[list] = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index):
        raise TypeError("the training split of Ray Datasets is streamed by position (PlannedRows.batches)")

    def run_starts(self) -> list:
        """Runs of :data:`RUN_ROWS` consecutive positions, which the planned order's windows keep together (a window
        touches few blocks): fixed by the split's size alone, not by its blocks, so a resume whose Dataset holds the
        same rows in other blocks (another driver, another cluster) continues the same order."""
        return list(range(0, len(self), RUN_ROWS))

    def _blocks(self) -> list:
        """The split's block references, in order; the same row counts the driver counted, or the error."""
        if self._refs is None:
            # Taken from an execution of the split's plan (its blocks, no task): in their order, as on the driver.
            self.iterator.get_context().execution_options.preserve_order = True
            bundles = list(self.iterator.materialize().iter_internal_ref_bundles())
            rows = [meta.num_rows for bundle in bundles for meta in bundle.metadata]
            if rows != self.block_rows:
                raise RuntimeError(f"dataset['train']: the worker sees blocks of {sum(rows)} rows ({len(rows)} "
                                   f"blocks), the driver counted {len(self)} ({len(self.block_rows)} blocks): a "
                                   f"materialized Dataset's blocks should not change. Report this, with the Dataset's "
                                   f"source.")
            self._refs = [ref for bundle in bundles for ref in bundle.block_refs]
        return self._refs

    def batches(self, indices, epoch: int, micro_batch: int) -> Iterator:
        """``collate``'s micro-batches of ``indices``' rows in that order (the rest under one micro-batch left);
        ``epoch`` is not used (the user's Dataset or ``collate`` augments)."""
        import numpy as np  # late: numpy (0.1 s of import); the config checks import this module

        indices = np.asarray(indices, np.int64)
        indices = indices[:len(indices) // micro_batch * micro_batch]
        chunk = max(1, CHUNK_ROWS // micro_batch) * micro_batch
        for start in range(0, len(indices), chunk):
            columns = self.rows(indices[start:start + chunk])
            for first in range(0, len(next(iter(columns.values()))), micro_batch):
                yield self.collate({key: value[first:first + micro_batch] for key, value in columns.items()})

    def rows(self, positions) -> dict:
        """The rows at ``positions``, in that order, as ``iter_batches(batch_format="numpy")`` gives columns."""
        # late: numpy and Ray; the config checks import this module
        import numpy as np
        import ray
        from ray.data.block import BlockAccessor

        blocks = np.searchsorted(self.starts, positions, side="right") - 1
        needed = np.unique(blocks)
        pieces = []
        for block, data in zip(needed, ray.get([self._blocks()[b] for b in needed])):
            taken = BlockAccessor.for_block(data).take(positions[blocks == block] - self.starts[block])
            pieces.append(BlockAccessor.for_block(taken).to_batch_format("numpy"))
        # The pieces hold the rows grouped by block, each block's in their order: put them back in the planned order.
        grouped = np.argsort(blocks, kind="stable")
        back = np.empty_like(grouped)
        back[grouped] = np.arange(len(grouped))
        return {key: np.concatenate([piece[key] for piece in pieces])[back] for key in pieces[0]}


def _read_whole(iterator, collate: Callable):
    """A split read whole from its ``DataIterator``, collated in one call: a map-style dataset of its samples."""
    import numpy as np  # late: numpy (0.1 s of import); the config checks import this module

    batches = list(iterator.iter_batches(batch_size=None, batch_format="numpy"))
    columns = {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]} if batches else {}
    inputs, targets = collate(columns)
    return CollatedSamples(inputs, targets)


class CollatedSamples:
    """Map-style samples of a collated batch ``(inputs, targets)``: item ``i`` is row ``i`` of each tensor
    (dicts and tuples kept), so a ``DataLoader`` batch of them is what ``collate`` gives for those rows."""

    def __init__(self, inputs, targets):
        from raytrain_mgpu.engine.batches import batch_size  # late: loads torch; the fields' check needs none

        self.inputs, self.targets = inputs, targets
        self.length = batch_size(targets)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return _row(self.inputs, index), _row(self.targets, index)


def _row(obj, index: int):
    if isinstance(obj, dict):
        return {key: _row(value, index) for key, value in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_row(value, index) for value in obj)
    return obj[index]
