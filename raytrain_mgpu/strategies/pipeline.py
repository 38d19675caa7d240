"""Pipeline parallelism: ``pipeline`` (one pipeline) and ``ddp_pipeline`` (D replicas of it).

Both run in their own Ray actor group, not as Ray Train workers (``runner =
"actor_group"``): one actor per stage and replica, see :mod:`raytrain_mgpu.pipeline`.
These classes only hold the driver-side rules: what a config must satisfy and which
resources it needs. The checks that need the model (more stages than blocks, a model
that cannot be split) run in :meth:`PipelineStrategy.check_model`, on the meta device,
before Ray is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple

from raytrain_mgpu.pipeline.schedule import check_schedule, num_virtual_stages
from raytrain_mgpu.strategies._memory import DeviceMemory, replica_on, split_parts
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, Strategy, num_blocks

if TYPE_CHECKING:
    from raytrain_mgpu.config.train import TrainConfig


class PipelineStrategy(Strategy):
    """``num_stages`` stages on as many devices, ``num_microbatches`` micro-batches per step."""

    name = "pipeline"
    runner = "actor_group"
    placement = replication = None  # no Ray Train worker: the stages place themselves (transports/actor_group/stage.py)
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
        if not isinstance(cfg.balance, str):
            parts = num_virtual_stages(cfg.schedule, cfg.num_stages)
            if len(cfg.balance) != parts:
                raise ValueError(
                    f"TrainConfig.balance={list(cfg.balance)} has {len(cfg.balance)} entries, but "
                    f"num_stages={cfg.num_stages} with schedule={cfg.schedule!r} splits the model into {parts} "
                    f"parts. Give one block count per part, or balance='params'.")
        if cfg.compile:
            raise ValueError(f"TrainConfig.compile={cfg.compile!r} is not supported by strategy={cls.name!r} yet. "
                             f"Set compile=False.")
        if cfg.train_step is not None:
            raise ValueError(
                f"TrainConfig.train_step is not supported by strategy={cls.name!r}: a pipeline's step is its schedule's "
                f"forwards and backwards of micro-batches over stages, and the loss exists only on the last stage. Give "
                f"the loss as TrainConfig.loss (a function of outputs and targets) and metrics as TrainConfig.metrics, "
                f"or use a data-parallel strategy (ddp, fsdp, ...) for your own step.")
        if cfg.param_groups is not None:
            raise ValueError(
                f"TrainConfig.param_groups={cfg.param_groups!r} is not supported by strategy={cls.name!r}: each stage "
                f"builds the optimizer over its own blocks. Leave param_groups unset, or use a data-parallel strategy.")

    @classmethod
    def check_model(cls, cfg: "TrainConfig", input_shape: tuple, num_classes: int) -> None:
        """More stages than blocks, a model that cannot be split, a wrong balance list."""
        from raytrain_mgpu.pipeline.plan import check_splittable  # late: loads torch; the rules here need none

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

    # ------------------------------------------------------------------ planning (auto, memory)

    @classmethod
    def auto_layout(cls, cfg: "TrainConfig", info) -> dict:
        n = info.num_devices
        replicas, stages, least = cls._auto_shape(cfg, n)
        if replicas * stages < least:
            raise ValueError(f"{cls.name} needs at least {least} devices; the cluster has {n}")
        return {"num_workers": replicas, "num_stages": stages,
                "num_microbatches": _microbatches(cfg, stages, replicas)}

    @classmethod
    def _auto_shape(cls, cfg: "TrainConfig", num_devices: int) -> Tuple[int, int, int]:
        """``(replicas, stages, least devices)`` on ``num_devices``: one pipeline, a stage per device and block."""
        return 1, min(num_devices, num_blocks(cfg)), 2

    @classmethod
    def auto_num_workers(cls, cfg: "TrainConfig", info) -> int:
        return 1  # one pipeline: auto_layout's, without the model its stage count needs

    @classmethod
    def auto_rank(cls, info):
        return 2 if info.num_nodes == 1 else 1  # across nodes only activations cross the network: first

    @classmethod
    def auto_reason(cls, info) -> str:
        return f"{cls.name} splits the model into stages; only activations cross between devices"

    @classmethod
    def device_memory(cls, cfg: "TrainConfig", profile) -> List[DeviceMemory]:
        replicas = cls.data_parallel_size(cfg)
        stages, m = cfg.num_stages, cfg.num_microbatches
        chunks = num_virtual_stages(cfg.schedule, stages) // stages
        parts = split_parts(profile, stages * chunks, cfg.balance)
        micro = 1 / (replicas * m)
        # Micro-batches whose activations a stage holds at once: all of them for GPipe,
        # at most (stages - rank) for 1F1B; the interleaved schedule is bounded by m.
        inflight = [float(min(stages - j, m)) if cfg.schedule == "1f1b" else float(m) for j in range(stages)]
        per_part = replica_on(profile, parts, micro, [inflight[j % stages] for j in range(len(parts))],
                              1 / replicas)
        merged = [DeviceMemory(0.0, 0.0)] * stages  # interleaved: part j lives on rank j % stages
        for j, part in enumerate(per_part):
            rank = j % stages
            merged[rank] = DeviceMemory(merged[rank].fixed + part.fixed, merged[rank].per_sample + part.per_sample)
        return merged * replicas

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        stages = min(num_gpus, 4)
        return {"num_workers": 1, "num_stages": stages, "num_microbatches": 2 * stages}


class DDPPipelineStrategy(PipelineStrategy):
    """``num_workers`` replicas of a ``num_stages``-stage pipeline; same-stage actors average gradients."""

    name = "ddp_pipeline"

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        return cfg.num_workers

    @classmethod
    def _auto_shape(cls, cfg: "TrainConfig", num_devices: int) -> Tuple[int, int, int]:
        return num_devices // 2, 2, 4  # replicas of a two-stage pipeline

    @classmethod
    def auto_num_workers(cls, cfg: "TrainConfig", info) -> int:
        return cls.auto_layout(cfg, info)["num_workers"]  # its layout needs no model

    @classmethod
    def auto_rank(cls, info):
        return AUTO_MEASURE_ONLY  # the estimate prefers one deeper pipeline; a measurement may not

    @classmethod
    def auto_reason(cls, info) -> str:
        return f"{cls.name} replicates a two-stage pipeline; same-stage actors average gradients"

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        if num_gpus < 2:
            raise ValueError("needs 2 GPUs")
        return {"num_workers": max(1, min(2, num_gpus // 2)), "num_stages": 2, "num_microbatches": 4}


def _microbatches(cfg: "TrainConfig", stages: int, replicas: int) -> int:
    """``cfg.num_microbatches`` if it works with ``stages``, else the smallest count that does."""
    need_multiple = stages if cfg.schedule == "interleaved_1f1b" else 1
    low = max(cfg.num_microbatches, stages if cfg.schedule != "gpipe" else 1)
    for m in range(low, cfg.batch_size // replicas + 1):
        if cfg.batch_size % (replicas * m) == 0 and m % need_multiple == 0:
            return m
    raise ValueError(f"global batch {cfg.batch_size} does not split into {replicas} replica(s) x at least "
                     f"{low} micro-batches. Use a batch_size that is a multiple of {replicas * low}")
