"""The run plan: every number a run's layout is made of, derived once on the driver.

torchtitan's ``ParallelDims`` for this package (house style rule 11): ``fit`` builds a
:class:`RunPlan` from the validated config and the strategy class, logs it in the banner,
checks its bundles against the cluster and hands it to the Ray Train workers (the loop's
payload) and to the pipeline's stage actors. Nobody downstream re-derives a replica count
or a micro-batch from the strategy's name.

It sits with the strategies (as torchtitan's sits in ``distributed/``) because it is only
what the strategy class answers (``data_parallel_size``, ``devices_per_worker``,
``worker_resources``, ``bundles``, ``micro_batches_per_step``, ``runner``), put together;
so the runtime below planning can read it. Pure: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["RunPlan", "build_plan"]


@dataclass(frozen=True)
class RunPlan:
    """How one run is laid out: processes, devices, bundles and batch arithmetic."""

    strategy: str
    runner: str
    """``train_workers`` (Ray Train's TorchTrainer) or ``actor_group`` (the pipeline's own actors)."""
    use_gpu: bool
    num_processes: int
    """Ray Train workers, or stage actors (stages x replicas) for the pipeline."""
    replicas: int
    """Data-parallel replicas; each takes ``replica_batch`` samples of every global batch."""
    devices_per_worker: int
    """GPUs one process holds (1 on CPU: one process is one device)."""
    worker_resources: dict
    """Ray resources of one process."""
    bundles: Tuple[dict, ...]
    """Every resource bundle the run needs at once (checked against the cluster before start)."""
    global_batch: int
    """Samples per optimizer step, every replica together (``TrainConfig.batch_size``)."""
    micro_batches_per_step: int
    """Forward/backward passes per replica and optimizer step: accumulation micro-steps, or
    the pipeline's micro-batches."""
    steps_per_epoch: Optional[int] = None
    """Optimizer steps in one epoch (the samplers drop the remainder); None until the
    training split's size is known."""

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
        return (f"global batch {self.global_batch} = {self.replicas} replica(s) x {self.micro_batch} x "
                f"{self.micro_batches_per_step} {kind}")


def build_plan(cfg, train_split_size: Optional[int] = None) -> RunPlan:
    """The plan of ``cfg`` (validated, strategy resolved: not ``auto``)."""
    from raytrain_mgpu.strategies import get_strategy

    cls = get_strategy(cfg.strategy)
    replicas = cls.data_parallel_size(cfg)
    micro_steps = cls.micro_batches_per_step(cfg)
    bundles = tuple(cls.bundles(cfg))
    steps = None
    if train_split_size is not None:
        micro = cfg.batch_size // (replicas * micro_steps)
        # DistributedSampler(drop_last=True) gives each replica num_train // replicas samples;
        # the loader drops the last partial micro-batch, the loop the last partial step.
        steps = (train_split_size // replicas // micro) // micro_steps
    return RunPlan(strategy=cfg.strategy, runner=cls.runner, use_gpu=cfg.use_gpu, num_processes=len(bundles),
                   replicas=replicas, devices_per_worker=cls.devices_per_worker(cfg),
                   worker_resources=cls.worker_resources(cfg), bundles=bundles, global_batch=cfg.batch_size,
                   micro_batches_per_step=micro_steps, steps_per_epoch=steps)
