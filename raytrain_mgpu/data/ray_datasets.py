"""Your own Ray Datasets: ``TrainConfig(dataset={"train": ds, "test": ds}, collate=fn)``, from Python.

Ray Train users hand ``TorchTrainer(datasets={...})`` their ``ray.data.Dataset`` s; ``dataset=``
takes the same dict (``"train"`` and ``"test"``, and ``"val"`` if there is one): any source, any
columns, any ``map_batches`` of the user's before. ``collate(batch)`` turns a batch, a dict of
NumPy arrays (one per column, as ``Dataset.iter_batches`` gives it), into ``(inputs, targets)``;
``inputs`` may be a tensor or a dict of tensors (the model's keyword arguments,
``raytrain_mgpu.batches``).

How each split is read:

- ``train`` streams: Ray Train's ``DataConfig`` gives each worker an equal share
  (``streaming_split(equal=True)``), read in micro-batches through a local shuffle buffer seeded
  per epoch and rank and collated on the worker (``engine/stream.ShardLoader``), in Ray Data's
  order (``ingest="ray_data"``'s Parquet streams in a planned order instead: ``data/parquet_stream.py``).
  Every worker reads ``rows // num_workers`` rows an epoch, the count the loader path's
  ``DistributedSampler(drop_last=True)`` gives.
- ``test`` and ``val`` are read whole by every worker once, at its start (Ray Train hands the
  datasets it does not split to each worker whole), and collated in one call; evaluation then
  shards them exactly as the loader path does (each sample once over the ranks). They must fit in
  a worker's memory.

``fit`` turns the dict into a :class:`RayDataSplits` before anything else (:func:`take`): it
counts the training rows (``Dataset.count()``: metadata only where the source has it) and
collates two rows for the input shape, on the driver, before any worker starts. The record is
what the workers get as ``dataset`` and what the run folder keeps (its class, split names and row
count); the Datasets themselves reach the workers through Ray Train (``transports/ray_data``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

if TYPE_CHECKING:
    from raytrain_mgpu.config_sections import DataConfig
    from raytrain_mgpu.data.base import Datasets

__all__ = ["SPLITS", "RayDataSplits", "is_ray_datasets", "check_fields", "take"]

SPLITS = ("train", "val", "test")


def is_ray_datasets(value) -> bool:
    """A dict of Ray Datasets (duck-typed: this check imports no Ray)."""
    return (isinstance(value, dict) and bool(value)
            and all(hasattr(v, "streaming_split") and hasattr(v, "iter_batches") for v in value.values()))


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
    if cfg.checkpoint_every_n_steps is not None:
        raise ValueError(f"TrainConfig.checkpoint_every_n_steps={cfg.checkpoint_every_n_steps} with Ray Datasets: a "
                         f"step checkpoint would have to keep the stream's position, and a Ray Dataset streams in Ray "
                         f"Data's order, which a restart does not repeat. Write the data as Parquet "
                         f"(Dataset.write_parquet) and stream it with dataset='parquet', ingest='ray_data' (a planned "
                         f"order that resumes at its step), hand it over as a dataset factory, or leave "
                         f"checkpoint_every_n_steps unset (checkpoints at epoch ends).")


def take(cfg) -> Any:
    """``cfg`` with its dict of Ray Datasets replaced by their :class:`RayDataSplits` (and
    ``ingest="ray_data"``): what ``fit`` trains. Reads two rows and counts the training split."""
    if not is_ray_datasets(cfg.dataset):
        return cfg
    from raytrain_mgpu._factory import load_factory

    splits = dict(cfg.dataset)
    collate = load_factory(cfg.collate, "collate")
    peek = splits["train"].take_batch(2, batch_format="numpy")
    try:
        inputs, _ = collate(peek)
    except Exception as exc:  # the user's function on their own columns: say which
        raise ValueError(f"TrainConfig.collate: calling it on two rows of the training split (columns "
                         f"{sorted(peek)}) raised {type(exc).__name__}: {exc}. It takes a dict of NumPy arrays "
                         f"and returns (inputs, targets).") from exc
    record = RayDataSplits(tuple(name for name in SPLITS if name in splits), splits["train"].count(),
                           _sample_shape(inputs), cfg.num_classes, datasets=splits)
    return cfg.replace(dataset=record, ingest="ray_data")


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
    Train hands them to the workers (``transports/ray_data.trainer_datasets``)."""

    def __init__(self, splits: Tuple[str, ...], num_train: int, input_shape: Any, num_classes: Optional[int],
                 datasets: Optional[dict] = None):
        self.splits, self.num_train = splits, int(num_train)
        self.input_shape, self.num_classes = input_shape, num_classes
        self.datasets = datasets

    def __getstate__(self) -> dict:
        return {**vars(self), "datasets": None}

    def __deepcopy__(self, memo) -> "RayDataSplits":
        return self  # immutable in use; dataclasses.asdict (TrainConfig.to_dict) copies fields

    def __repr__(self) -> str:
        return f"RayDataSplits({list(self.splits)}, {self.num_train} training rows)"

    def __call__(self, cfg: "DataConfig") -> "Datasets":
        """On a training process: the evaluated splits read whole and collated; ``train`` is streamed by the
        engine's feed (``engine/feed.py``), here only its size. The splits' iterators come from Ray Train
        (``ray.train.get_dataset_shard``) or, on a pipeline's stage actor, from its driver (:func:`use_shards`)."""
        from raytrain_mgpu._factory import load_factory
        from raytrain_mgpu.data.base import Datasets

        shard = _SHARDS.get("provider")
        if shard is None:
            import ray.train

            shard = ray.train.get_dataset_shard
        collate = load_factory(cfg.collate, "collate")
        evaluated = {name: _read_whole(shard(name), collate) for name in ("test", "val") if name in self.splits}
        return Datasets(_Sized(self.num_train), evaluated["test"], self.input_shape, self.num_classes,
                        val=evaluated.get("val"))


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


def _read_whole(iterator, collate: Callable):
    """A split read whole from its ``DataIterator``, collated in one call: a map-style dataset of its samples."""
    import numpy as np

    batches = list(iterator.iter_batches(batch_size=None, batch_format="numpy"))
    columns = {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]} if batches else {}
    inputs, targets = collate(columns)
    return CollatedSamples(inputs, targets)


class CollatedSamples:
    """Map-style samples of a collated batch ``(inputs, targets)``: item ``i`` is row ``i`` of each tensor
    (dicts and tuples kept), so a ``DataLoader`` batch of them is what ``collate`` gives for those rows."""

    def __init__(self, inputs, targets):
        from raytrain_mgpu.batches import batch_size

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
