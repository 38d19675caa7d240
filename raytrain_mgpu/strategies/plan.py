"""The run plan: every number a run's layout is made of, derived once on the driver.

torchtitan's ``ParallelDims`` for this package (derive once, pass everywhere): ``fit`` builds a
:class:`RunPlan` from the validated config and the strategy class, logs it in the banner,
checks its bundles against the cluster and hands it to the Ray Train workers (the loop's
payload) and to the pipeline's stage actors. Nobody downstream re-derives a replica count
or a micro-batch from the strategy's name.

It sits with the strategies (as torchtitan's sits in ``distributed/``) because it is only
what the strategy class answers (``data_parallel_size``, ``devices_per_worker``,
``worker_resources``, ``bundles``, ``micro_batches_per_step``, ``runner``), put together;
so the runtime below planning can read it. Pure: no Ray, and no torch until the training split's size is
given (its steps per epoch are the engine's feed's count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from raytrain_mgpu.strategies import get_strategy
from raytrain_mgpu.strategies.elastic import at_count, is_elastic, worker_range
from raytrain_mgpu.strategies.layout import is_auto

__all__ = ["RunPlan", "build_plan"]


@dataclass(frozen=True)
class RunPlan:
    """How one run is laid out: processes, devices, bundles and batch arithmetic."""

    strategy: str
    runner: str
    """``train_workers`` (Ray Train's TorchTrainer) or ``actor_group`` (the pipeline's own actors)."""
    use_gpu: bool
    num_processes: int
    """Ray Train workers (an elastic run's max), or stage actors (stages x replicas) for the pipeline."""
    replicas: int
    """Data-parallel replicas; each takes ``replica_batch`` samples of every global batch."""
    devices_per_worker: int
    """GPUs one process holds (1 on CPU: one process is one device)."""
    worker_resources: dict
    """Ray resources of one process."""
    bundles: Tuple[dict, ...]
    """Every resource bundle the run needs at once (checked against the cluster before start); an
    elastic run's: its min count's."""
    global_batch: int
    """Samples per optimizer step, every replica together (``TrainConfig.batch_size``)."""
    micro_batches_per_step: int
    """Forward/backward passes per replica and optimizer step: accumulation micro-steps, or
    the pipeline's micro-batches."""
    steps_per_epoch: Optional[int] = None
    """Optimizer steps in one epoch (the samplers drop the remainder); None until the
    training split's size is known. The same at every count of an elastic run."""
    min_workers: Optional[int] = None
    """Elastic runs (``num_workers=(min, max)``): the fewest workers it trains with; None: a fixed count.
    ``replicas``, ``num_processes`` and ``micro_batches_per_step`` are then those of the max count
    (which fixes the micro-batch), ``bundles`` those of the min (what must be free to start)."""

    tensor_group_size: int = 1
    """Consecutive workers that split every layer between them (``tensor_parallel_size``), so must share a node
    (checked against the cluster before start); 1: no tensor parallel."""

    @property
    def worker_counts(self) -> Tuple[int, ...]:
        """Every data-parallel world size the run may train with (one for a fixed count)."""
        return tuple(range(self.min_workers, self.replicas + 1)) if self.min_workers else (self.replicas,)

    def micro_batches_at(self, world_size: int) -> int:
        """Accumulation micro-steps per optimizer step when ``world_size`` replicas train (the micro-batch
        stays; the global batch and the steps per epoch stay): ValueError for a count outside the plan."""
        if world_size not in self.worker_counts:
            raise ValueError(f"{self.strategy}: {world_size} data shard(s), but the plan has "
                             f"{'/'.join(map(str, self.worker_counts))}")
        return self.replicas * self.micro_batches_per_step // world_size

    @property
    def replica_batch(self) -> int:
        """Samples one replica takes per optimizer step."""
        return self.global_batch // self.replicas

    @property
    def micro_batch(self) -> int:
        """Samples in one forward pass of one replica."""
        return self.global_batch // (self.replicas * self.micro_batches_per_step)

    @property
    def batch_granularity(self) -> int:
        """The global batch must be a multiple of this (replicas x micro-batches per step)."""
        return self.replicas * self.micro_batches_per_step

    def describe(self) -> str:
        """``global batch 128 = 2 replica(s) x 32 x 2 micro-batch(es)`` for the banner."""
        kind = "micro-batch(es)" if self.runner == "actor_group" else "accumulation step(s)"
        if self.min_workers:  # elastic: every count's split of the same global batch
            splits = ", ".join(f"{w} x {self.micro_batch} x {self.micro_batches_at(w)}" for w in self.worker_counts)
            return f"global batch {self.global_batch} = workers x micro-batch x {kind}, elastic: {splits}"
        return (f"global batch {self.global_batch} = {self.replicas} replica(s) x {self.micro_batch} x "
                f"{self.micro_batches_per_step} {kind}")


def build_plan(cfg, train_split_size: Optional[int] = None) -> RunPlan:
    """The plan of ``cfg`` (validated, strategy, devices and worker count resolved: none of them ``auto``);
    ``train_split_size``: its steps per epoch too (ValueError where the split holds no full step)."""
    for name in ("use_gpu", "num_workers"):
        if is_auto(getattr(cfg, name)):
            raise ValueError(f"TrainConfig.{name}='auto' has no plan until the devices are read: fit, compare and "
                             f"tune resolve it first (raytrain_mgpu.planning.auto_devices.resolve_auto_devices). "
                             f"Resolve the config with it, or set {name} yourself.")

    cls = get_strategy(cfg.strategy)
    low, high = worker_range(cfg)
    elastic = is_elastic(cfg)
    bundles = tuple(cls.bundles(at_count(cfg, low)))  # elastic: the min's bundles must be free to start
    cfg = at_count(cfg, high)  # elastic: the largest count fixes the micro-batch
    replicas = cls.data_parallel_size(cfg)
    micro_steps = cls.micro_batches_per_step(cfg)
    steps = None
    if train_split_size is not None:
        from raytrain_mgpu.engine.feed import steps_per_epoch  # late: feed loads torch, a plan without a size none

        # The engine's own count (its feed's): a replica's micro-batch x its micro-steps per step.
        micro = cfg.batch_size // (replicas * micro_steps)
        steps = steps_per_epoch(cfg, train_split_size, replicas, micro * micro_steps)
    return RunPlan(strategy=cfg.strategy, runner=cls.runner, use_gpu=cfg.use_gpu,
                   num_processes=high if elastic else len(bundles), replicas=replicas,
                   devices_per_worker=cls.devices_per_worker(cfg),
                   worker_resources=cls.worker_resources(cfg), bundles=bundles, global_batch=cfg.batch_size,
                   micro_batches_per_step=micro_steps, steps_per_epoch=steps,
                   min_workers=low if elastic else None, tensor_group_size=cls.tensor_group_size(cfg))
