"""Driver-side planning: can this model be split as configured, and how.

Runs before any stage process exists: the model is built on the ``meta`` device (shapes
only, no memory, no time), so a model too large for the driver is still checked, and a
configuration that cannot work fails here with a message naming the field to change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, Optional

from raytrain_mgpu.config.factories import code_name
from raytrain_mgpu.data import check_data
from raytrain_mgpu.models import build_model_shapes
from raytrain_mgpu.models.partition import Partition, blocks_of, plan_partition
from raytrain_mgpu.pipeline.schedule import num_virtual_stages

if TYPE_CHECKING:  # annotations only: the config validates through strategies, which use this module
    from raytrain_mgpu.config.train import TrainConfig

logger = logging.getLogger(__name__)

__all__ = ["meta_blocks", "check_splittable", "choose_partition", "partition_from_checkpoint"]


def meta_blocks(cfg: TrainConfig) -> list:
    """The model's blocks, built on the meta device (on CPU for a builder that reads values); ``ValueError`` if
    it cannot be split."""
    input_shape, num_classes = check_data(cfg.data)
    return blocks_of(build_model_shapes(cfg.model, input_shape, num_classes, cfg.model_kwargs))


def check_splittable(cfg: TrainConfig) -> None:
    """The checks of :func:`choose_partition` that need no profiling."""
    choose_partition(cfg, profile=lambda: [1.0] * len(meta_blocks(cfg)), log=False)


def choose_partition(cfg: TrainConfig, profile: Optional[Callable[[], List[float]]] = None,
                     log: bool = True) -> Partition:
    """Blocks per stage (per model chunk for ``interleaved_1f1b``) for ``cfg.balance``.

    ``profile`` measures the blocks' forward+backward times on a real device; it is
    called only for ``balance="time"``.
    """
    blocks = meta_blocks(cfg)
    num_parts = num_virtual_stages(cfg.schedule, cfg.num_stages)
    if num_parts > len(blocks):
        chunks = num_parts // cfg.num_stages
        extra = f" x {chunks} model chunks per stage (schedule='interleaved_1f1b')" if chunks > 1 else ""
        raise ValueError(
            f"TrainConfig.num_stages={cfg.num_stages}{extra} needs {num_parts} parts, more than the {len(blocks)} "
            f"blocks model {code_name(cfg.model)!r} can be split into: every part needs at least one block. Set num_stages "
            f"to at most {len(blocks) // chunks}, or use a model with more blocks (e.g. more layers).")
    return plan_partition(blocks, num_parts, cfg.balance, time_costs=profile, log=log)


def partition_from_checkpoint(cfg: TrainConfig, counts: List[int], directory: str) -> Partition:
    """The partition a checkpoint was trained with (its optimizer state is per stage)."""
    blocks = meta_blocks(cfg)
    num_parts = num_virtual_stages(cfg.schedule, cfg.num_stages)
    if len(counts) != num_parts or sum(counts) != len(blocks):
        raise ValueError(
            f"checkpoint {directory!r} was trained with partition {counts} ({len(counts)} stages), but this run "
            f"has num_stages={cfg.num_stages} (schedule={cfg.schedule!r}: {num_parts} parts): the optimizer "
            f"state is kept per stage. Use the checkpoint's num_stages and schedule, or another `name` for a "
            f"new run (TrainResult.load_model() still loads its weights).")
    if not isinstance(cfg.balance, str) and list(cfg.balance) != list(counts):
        raise ValueError(
            f"TrainConfig.balance={list(cfg.balance)} differs from the partition {counts} of checkpoint "
            f"{directory!r}, whose optimizer state is kept per stage. Set balance={counts} (or 'params') to "
            f"resume, or use another `name` for a new run.")
    logger.info("resuming with the checkpoint's partition %s", counts)
    return plan_partition(blocks, num_parts, list(counts))
