"""The interface every training strategy implements.

A strategy decides three things, and nothing else:

1. before Ray is touched (class methods, pure): whether a config makes sense for it
   (``validate``), what each worker needs (``worker_resources``), and how many
   replicas split the global batch (``data_parallel_size``);
2. on a worker: where the model lives and how it is wrapped (``setup_model``), which
   shard of the data this worker reads (``data_shard``), and how a loss is computed
   (``compute_loss``, overridden by ``dp_balanced``);
3. how to get the plain model back for checkpoints (``unwrap``/``state_dict``).

The training loop (``raytrain_mgpu.loop``) is the same for every Ray Train strategy.
Strategies with their own runtime (the pipeline's actor group) set ``runner``.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, ContextManager, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from raytrain_mgpu.config import ParallelConfig, TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """Where this worker sits: filled from ``ray.train.get_context()`` on each worker."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    devices: Tuple[torch.device, ...]  # the devices this worker owns (CPU: one cpu device)


class Strategy(ABC):
    """One way of spreading training over processes and devices."""

    name: ClassVar[str]
    runner: ClassVar[str] = "train_workers"  # or "actor_group" (own runtime, see pipeline/)

    def __init__(self, cfg: "ParallelConfig", ctx: WorkerContext):
        self.cfg = cfg
        self.ctx = ctx

    # ------------------------------------------------------------- driver side (pure)

    @classmethod
    def validate(cls, cfg: "TrainConfig") -> None:
        """Raise ValueError for configs this strategy cannot run. Default: batch maths."""
        check_batch_divisible(cfg, cls.data_parallel_size(cfg))
        if cfg.precision == "16-mixed" and not cfg.use_gpu:
            raise ValueError(
                "TrainConfig.precision='16-mixed' needs CUDA (fp16 autocast with a GradScaler), but "
                "use_gpu=False. Use precision='bf16-mixed' on CPU, or set use_gpu=True.")

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        """Replicas that each take a slice of the global batch."""
        return cfg.num_workers

    @classmethod
    def worker_resources(cls, cfg: "TrainConfig") -> dict:
        """Ray resources for one worker."""
        resources = {"CPU": cfg.cpus_per_worker}
        if cfg.use_gpu:
            resources["GPU"] = cls.devices_per_worker(cfg)
        return resources

    @classmethod
    def devices_per_worker(cls, cfg: "TrainConfig") -> int:
        return 1

    @classmethod
    def bundles(cls, cfg: "TrainConfig") -> List[dict]:
        """Every resource bundle the run needs at once (checked against the cluster)."""
        return [cls.worker_resources(cfg)] * cfg.num_workers

    # ------------------------------------------------------------- worker side

    @property
    def device(self) -> torch.device:
        """Where inputs go (the first device)."""
        return self.ctx.devices[0]

    @abstractmethod
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to its device(s) and wrap it; returns the module to train."""

    def data_shard(self) -> Tuple[int, int]:
        """``(shard index, number of shards)`` for this worker's DistributedSampler."""
        return self.ctx.world_rank, self.ctx.world_size

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context that skips gradient sync (non-final accumulation micro-steps)."""
        return contextlib.nullcontext()

    def compute_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(mean loss, logits)`` for one micro-batch."""
        logits = model(x)
        return F.cross_entropy(logits, y.to(logits.device)), logits

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def state_dict(self, model: nn.Module) -> dict:
        """Full state dict of the plain model (collective for sharded strategies)."""
        return self.unwrap(model).state_dict()

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        self.unwrap(model).load_state_dict(state)

    def memory_devices(self) -> List[torch.device]:
        """Devices whose peak memory this worker reports."""
        return list(self.ctx.devices)


def check_batch_divisible(cfg: "TrainConfig", replicas: int) -> None:
    """The global batch must split evenly over replicas and accumulation micro-steps."""
    parts = replicas * cfg.grad_accum_steps
    if cfg.batch_size % parts:
        lower = max(parts, cfg.batch_size // parts * parts)
        raise ValueError(
            f"TrainConfig.batch_size={cfg.batch_size} (global) does not split evenly over "
            f"{replicas} data-parallel replica(s) x grad_accum_steps={cfg.grad_accum_steps} = {parts} "
            f"micro-batches. Use a multiple of {parts}, e.g. batch_size={lower} or {lower + parts}.")
