"""What ``TrainConfig.ingest="ray_data"`` can feed, checked before Ray starts (``config_checks.validate``).

Ray Data streams the ``parquet`` dataset's training split into Ray Train workers
(``transports/ray_data.py``). Other datasets are map-style readers built inside each worker
(``ray.data.from_torch`` would pull every sample through the driver): convert them with
``raytrain-mgpu data convert`` first. Both runners stream: Ray Train workers and the first stage
of each pipeline replica.
"""

from __future__ import annotations

from raytrain_mgpu._factory import code_name

__all__ = ["RAY_DATA_DATASETS", "check_ingest"]

RAY_DATA_DATASETS = ("parquet",)
"""Datasets ``ingest="ray_data"`` reads (``transports/ray_data.py``)."""


def check_ingest(cfg) -> None:
    """``cfg.ingest`` against the dataset and the transforms (both runners stream: Ray Train workers and
    the pipeline's first stages)."""
    from raytrain_mgpu.data.ray_datasets import RayDataSplits

    if cfg.ingest != "ray_data" or isinstance(cfg.dataset, RayDataSplits):  # the user's own Ray Datasets
        return
    if cfg.dataset not in RAY_DATA_DATASETS:
        name = code_name(cfg.dataset)
        raise ValueError(f"TrainConfig.ingest='ray_data': Ray Data reads Parquet files, and dataset={name!r} is not "
                         f"'parquet'. Write it as Parquet (`raytrain-mgpu data convert --dataset {name} --out DIR`) "
                         f"and set dataset='parquet', data_root=DIR; or set ingest='loader'.")
    if cfg.train_transform is not None:
        raise ValueError(f"TrainConfig.ingest='ray_data': train_transform={code_name(cfg.train_transform)!r} is "
                         f"not applied to Ray Data's stream yet (its seed is per epoch and sample; the stream has "
                         f"neither). "
                         f"Set ingest='loader' to augment, or leave train_transform unset.")
