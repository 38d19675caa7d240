"""What ``TrainConfig.ingest="ray_data"`` can feed, checked before Ray starts (``config_checks.validate``).

Ray Data streams the ``parquet`` dataset's training split to each Ray Train worker, or the first stage
of each pipeline replica, in a planned order (``engine/stream.py``, ``data/parquet_stream.py``): with the
loader path's transforms, validation split, step checkpoints and preemption; and the ``text`` dataset's, where
``data_root`` holds ``data tokenize``'s blocks (``data/lm_blocks.py``: documents are refused with the fix when
the files are checked, before Ray). Other datasets are map-style
readers built inside each worker (``ray.data.from_torch`` would pull every sample through the driver):
convert them with ``raytrain-mgpu data convert`` first. A user's own Ray Datasets stream in the planned
order where the training split is materialized, else in Ray Data's order (``data/ray_datasets.py``):
:func:`resumes_mid_epoch` tells them apart.
"""

from __future__ import annotations

from raytrain_mgpu.config.factories import code_name
from raytrain_mgpu.data.ray_datasets import RayDataSplits, is_ray_datasets, planned

__all__ = ["RAY_DATA_DATASETS", "check_ingest", "resumes_mid_epoch"]

RAY_DATA_DATASETS = ("parquet", "text")
"""Datasets ``ingest="ray_data"`` reads (``transports/ray_data.py``)."""


def check_ingest(cfg) -> None:
    """``cfg.ingest`` against the dataset (both runners stream: Ray Train workers and the pipeline's first
    stages)."""
    if cfg.ingest != "ray_data" or isinstance(cfg.dataset, RayDataSplits):  # the user's own Ray Datasets
        return
    if cfg.dataset not in RAY_DATA_DATASETS:
        name = code_name(cfg.dataset)
        raise ValueError(f"TrainConfig.ingest='ray_data': Ray Data reads Parquet files, and dataset={name!r} is not "
                         f"'parquet'. Write it as Parquet (`raytrain-mgpu data convert --dataset {name} --out DIR`) "
                         f"and set dataset='parquet', data_root=DIR; or set ingest='loader'.")


def resumes_mid_epoch(cfg) -> bool:
    """Whether ``cfg``'s training split can resume inside an epoch (a step, time-based or preemption checkpoint):
    the loader path, the planned ``parquet`` stream and a user's materialized Ray Dataset can; a user's Ray Dataset
    that streams in Ray Data's order cannot."""
    if is_ray_datasets(cfg.dataset) or isinstance(cfg.dataset, RayDataSplits):
        return planned(cfg.dataset)
    return True
