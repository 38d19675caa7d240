"""Pipeline parallelism: ``pipeline`` (one pipeline) and ``ddp_pipeline`` (D replicas of it).

Both run in their own Ray actor group, not as Ray Train workers (``runner =
"actor_group"``): one actor per stage and replica, see :mod:`raytrain_mgpu.pipeline`.
These classes only hold the driver-side rules: what a config must satisfy and which
resources it needs. The checks that need the model (more stages than blocks, a model
that cannot be split) run in :meth:`PipelineStrategy.check_model`, on the meta device,
before Ray is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from torch import nn

from raytrain_mgpu.pipeline.schedule import check_schedule, num_virtual_stages
from raytrain_mgpu.strategies.base import Strategy, warn_unused_options

if TYPE_CHECKING:
    from raytrain_mgpu.config import TrainConfig


class PipelineStrategy(Strategy):
    """``num_stages`` stages on as many devices, ``num_microbatches`` micro-batches per step."""

    name = "pipeline"
    runner = "actor_group"
    options_used = frozenset({"num_stages", "num_microbatches", "schedule", "balance"})

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        return 1  # num_workers is not used: one pipeline (ddp_pipeline replicates it)

    @classmethod
    def micro_batches_per_step(cls, cfg: "TrainConfig") -> int:
        return cfg.num_microbatches  # the schedule's micro-batches; accumulation is not used

    @classmethod
    def bundles(cls, cfg: "TrainConfig") -> List[dict]:
        """One bundle per stage actor: D replicas x P stages."""
        return [cls.worker_resources(cfg)] * (cfg.num_stages * cls.data_parallel_size(cfg))

    @classmethod
    def validate(cls, cfg: "TrainConfig") -> None:
        check_schedule(cfg.schedule, cfg.num_stages, cfg.num_microbatches)
        cls._check_batch(cfg)
        if cfg.grad_accum_steps != 1:
            raise ValueError(
                f"TrainConfig.grad_accum_steps={cfg.grad_accum_steps}: a pipeline already accumulates gradients "
                f"over its micro-batches. Set grad_accum_steps=1 and raise num_microbatches instead.")
        if cfg.precision == "16-mixed":
            raise ValueError(
                f"TrainConfig.precision='16-mixed' is not supported by strategy={cls.name!r}: fp16 needs one "
                f"GradScaler whose overflow check spans all stages. Use precision='bf16-mixed' (no scaler "
                f"needed) or '32'.")
        if not isinstance(cfg.balance, str):
            parts = num_virtual_stages(cfg.schedule, cfg.num_stages)
            if len(cfg.balance) != parts:
                raise ValueError(
                    f"TrainConfig.balance={list(cfg.balance)} has {len(cfg.balance)} entries, but "
                    f"num_stages={cfg.num_stages} with schedule={cfg.schedule!r} splits the model into {parts} "
                    f"parts. Give one block count per part, or balance='params'.")
        if "://" in str(cfg.storage_path):
            raise ValueError(
                f"TrainConfig.storage_path={cfg.storage_path!r}: strategy={cls.name!r} writes its checkpoints "
                f"itself and supports local or shared-filesystem paths only for now. Use a path on a shared "
                f"filesystem (e.g. an NFS mount) for multi-node runs.")
        if cfg.compile:
            raise ValueError(f"TrainConfig.compile=True is not supported by strategy={cls.name!r} yet. "
                             f"Set compile=False.")
        warn_unused_options(cfg, cls.name, cls.options_used)

    @classmethod
    def check_model(cls, cfg: "TrainConfig", input_shape: tuple, num_classes: int) -> None:
        """More stages than blocks, a model that cannot be split, a wrong balance list."""
        from raytrain_mgpu.pipeline.plan import check_splittable

        check_splittable(cfg)

    @classmethod
    def _check_batch(cls, cfg: "TrainConfig") -> None:
        replicas, m = cls.data_parallel_size(cfg), cfg.num_microbatches
        parts = replicas * m
        if cfg.batch_size % parts:
            lower = max(parts, cfg.batch_size // parts * parts)
            per_replica = f"{cfg.batch_size / replicas:g} per replica" if replicas > 1 else "per step"
            raise ValueError(
                f"TrainConfig.batch_size={cfg.batch_size} (global, {per_replica}) does not split into "
                f"num_microbatches={m} equal micro-batches on each of {replicas} replica(s). Use a multiple "
                f"of {replicas} x {m} = {parts}, e.g. batch_size={lower} or {lower + parts}.")

    # ------------------------------------------------------------------ worker side

    def setup_model(self, model: nn.Module) -> nn.Module:
        raise RuntimeError(f"strategy {self.name!r} runs in its own actor group (raytrain_mgpu.pipeline."
                           f"run_pipeline), not in the Ray Train worker loop.")


class DDPPipelineStrategy(PipelineStrategy):
    """``num_workers`` replicas of a ``num_stages``-stage pipeline; same-stage actors average gradients."""

    name = "ddp_pipeline"

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        return cfg.num_workers
