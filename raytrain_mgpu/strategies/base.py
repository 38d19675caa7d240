"""The interface every training strategy implements.

A strategy decides three things, and nothing else:

1. before Ray is touched (class methods, pure): whether a config makes sense for it
   (``validate``), what each worker needs (``worker_resources``), and how many
   replicas split the global batch (``data_parallel_size``);
2. on a worker: where the model lives and how it is wrapped (``setup_model``), which
   shard of the data this worker reads (``data_shard``), and how a loss is computed
   (``compute_loss``: the run's :class:`~raytrain_mgpu.objectives.Objective`, applied where the
   outputs are; overridden by ``dp_balanced``);
3. how to get the plain model back for checkpoints (``unwrap``/``state_dict``, and the
   optimizer's state for sharded strategies).

Options a strategy does not read (``options_used``) are warned about by the config's
validation (``config_checks.validate``), so ``bucket_cap_mb`` with ``dp`` does not pass silently.

The training loop (``raytrain_mgpu.runtime.loop``) is the same for every Ray Train strategy.
Strategies with their own runtime (the pipeline's actor group) set ``runner``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, ContextManager, FrozenSet, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from raytrain_mgpu.batches import call_model, first_tensor, to_device
from raytrain_mgpu.objectives import Objective, Predictions, move_pairs

if TYPE_CHECKING:
    from raytrain_mgpu.config import TrainConfig
    from raytrain_mgpu.config_sections import ParallelConfig
    from raytrain_mgpu.runtime.devices import DeviceAssignment
    from raytrain_mgpu.strategies._memory import DeviceMemory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """Where this worker sits: filled from ``ray.train.get_context()`` on each worker."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    devices: Tuple[torch.device, ...]  # the devices this worker computes on (CPU: one cpu device)
    # Where it would compute on GPUs ("cuda:k", nccl): set by the loop, recorded in the metrics.
    assignment: Optional["DeviceAssignment"] = None


class ModelWrapper(nn.Module):
    """Marker base of this package's own wrappers (``unwrap`` peels them like DDP)."""

    module: nn.Module


# TrainConfig fields some strategies read and others ignore (each strategy's ``options_used``);
# a value other than the field's default with a strategy that ignores it gets a warning.
OPTIONAL_FIELDS = ("gpus_per_worker", "output_device", "balance", "find_unused_parameters", "static_graph",
                   "bucket_cap_mb", "gradient_as_bucket_view", "sync_batchnorm", "num_stages",
                   "num_microbatches", "schedule")
DDP_OPTIONS = frozenset({"find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view"})

# ``Strategy.auto_rank`` bands: the plain model first; below AUTO_MEASURE_ONLY the strategies the
# memory estimate tries when it does not fit one device; from AUTO_MEASURE_ONLY up, timed only.
AUTO_FIRST, AUTO_MEASURE_ONLY = 0, 10


class Strategy(ABC):
    """One way of spreading training over processes and devices."""

    name: ClassVar[str]
    runner: ClassVar[str] = "train_workers"  # or "actor_group" (own runtime, see pipeline/)
    options_used: ClassVar[FrozenSet[str]] = DDP_OPTIONS | {"sync_batchnorm"}
    """Which of the optional TrainConfig fields this strategy reads; others set are warned about."""
    elastic: ClassVar[bool] = False
    """Whether ``num_workers=(min, max)`` may resize it: its workers are plain data-parallel replicas on
    the Ray Train runner, so any count in the range trains the same steps (``strategies/elastic.py``)."""

    def __init__(self, cfg: "ParallelConfig", ctx: WorkerContext, objective: Optional[Objective] = None):
        self.cfg = cfg
        self.ctx = ctx
        self.objective = objective if objective is not None else Objective()  # default: cross-entropy, accuracy

    # ------------------------------------------------------------- driver side (pure)

    @classmethod
    def validate(cls, cfg: "TrainConfig") -> None:
        """Raise ValueError for configs this strategy cannot run. Default: batch maths.

        Pure checks, no warnings: ``config_checks.validate`` calls it once per config and
        warns about the options this strategy does not read (``options_used``).
        """
        check_batch_divisible(cfg, cls.data_parallel_size(cfg))
        if cfg.checkpoint_every_n_steps is not None and cfg.ingest == "ray_data":
            raise ValueError(
                f"TrainConfig.checkpoint_every_n_steps={cfg.checkpoint_every_n_steps} with ingest='ray_data': a "
                f"Ray Data stream restarts its epoch on resume, so a step checkpoint could not continue where it "
                f"stopped. Leave checkpoint_every_n_steps unset, or use ingest='loader'.")
        if cfg.precision == "16-mixed" and not cfg.use_gpu:
            raise ValueError(
                "TrainConfig.precision='16-mixed' needs CUDA (fp16 autocast with a GradScaler), but "
                "use_gpu=False. Use precision='bf16-mixed' on CPU, or set use_gpu=True.")

    @classmethod
    def check_model(cls, cfg: "TrainConfig", input_shape: tuple, num_classes: int) -> None:
        """Checks that need the model's structure (e.g. a split over devices), before Ray.

        Called by ``fit`` once the data's shapes are known. Strategies that need the model
        build it on the ``meta`` device (no memory, no weights). Default: nothing to check.
        """

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        """Replicas that each take a slice of the global batch."""
        return cfg.num_workers

    @classmethod
    def micro_batches_per_step(cls, cfg: "TrainConfig") -> int:
        """Forward/backward passes per replica and optimizer step (accumulation micro-steps)."""
        return cfg.grad_accum_steps

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

    # ------------------------------------------------------------- planning (pure): auto, memory

    @classmethod
    def auto_layout(cls, cfg: "TrainConfig", info) -> dict:
        """The TrainConfig changes that lay this strategy out on ``info``'s devices (a ``ClusterInfo``).

        ``strategy="auto"`` and ``compare`` call it; ValueError says why it cannot run there.
        Default: no changes (run it as configured).
        """
        return {}

    @classmethod
    def auto_rank(cls, info) -> Optional[int]:
        """Where ``strategy="auto"`` tries this strategy on ``info``'s devices, lowest first; None: never.

        Rank 0 (``AUTO_FIRST``) is chosen when the model fits one device; ranks below
        ``AUTO_MEASURE_ONLY`` are tried in order by the memory estimate when it does not;
        ranks from ``AUTO_MEASURE_ONLY`` up are only timed by ``auto_measure``. Default: None.
        """
        return None

    @classmethod
    def auto_reason(cls, info) -> str:
        """What this strategy does with the model on ``info``'s devices, for auto's one-line reason."""
        return cls.name

    @classmethod
    def device_memory(cls, cfg: "TrainConfig", profile) -> List["DeviceMemory"]:
        """The memory estimate of every device a run of ``cfg`` uses (``profile``: a ``ModelProfile``).

        Built from the pieces in ``raytrain_mgpu.strategies._memory``. Default: none
        (``planning.memory.device_memory`` turns that into a ValueError listing the strategies that have one).
        """
        raise NotImplementedError(f"strategy {cls.name!r} has no memory model")

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        """A small layout on one node of ``num_gpus`` GPUs (``gpu-report`` measures each strategy with it).

        ValueError: too few GPUs (the message is the reason shown, e.g. "needs 2 GPUs").
        Default: data parallel over at most two GPUs.
        """
        return {"num_workers": min(num_gpus, 2)}

    # ------------------------------------------------------------- worker side

    @property
    def device(self) -> torch.device:
        """Where inputs go (the first device)."""
        return self.ctx.devices[0]

    def build_on_meta(self) -> bool:
        """Whether this worker builds the model on ``meta`` (no memory, no weights).

        Then ``setup_model`` must materialise it with the weights another rank built
        (``fsdp``: rank 0 builds on CPU and sends each rank its shards). Default: no.
        """
        return False

    @abstractmethod
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to its device(s) and wrap it; returns the module to train."""

    def data_shard(self) -> Tuple[int, int]:
        """``(shard index, number of shards)`` for this worker's DistributedSampler."""
        return self.ctx.world_rank, self.ctx.world_size

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Context that skips gradient sync (non-final accumulation micro-steps)."""
        return contextlib.nullcontext()

    def compute_loss(self, model: nn.Module, x, y) -> Tuple[torch.Tensor, object]:
        """``(mean loss, outputs)`` for one micro-batch (``self.objective``'s loss), on ``self.device``.

        ``x`` and ``y`` are tensors, or tuples/dicts of tensors (:mod:`raytrain_mgpu.batches`:
        a dict ``x`` is passed as keyword arguments).

        When the model's output lands on another device (model parallel), the loss and every
        metric's ``(sum, count)`` are computed there and only those scalars come back (as
        :class:`~raytrain_mgpu.objectives.Predictions`), never the outputs.
        """
        with explain_ddp_errors(self.unwrap(model)):
            outputs = call_model(model, x)
        where = first_tensor(outputs).device
        y = to_device(y, where)
        loss = self.objective.loss(outputs, y)
        if where == self.device:
            return loss, outputs
        pairs = move_pairs(self.objective.measure(outputs, y), self.device)
        return loss.to(self.device), Predictions(pairs, [outputs], self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside ``torch.compile``, DDP, DataParallel and our own wrappers."""
        model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        while isinstance(model, (DistributedDataParallel, DataParallel, ModelWrapper)):
            model = model.module
        return model

    def state_dict(self, model: nn.Module) -> dict:
        """Full state dict of the plain model (collective for sharded strategies)."""
        return self.unwrap(model).state_dict()

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state rank 0 saves (collective for sharded strategies: all ranks call)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what ``optimizer_state_dict`` returned on rank 0 (every rank calls it)."""
        optimizer.load_state_dict(state)

    def memory_devices(self) -> List[torch.device]:
        """Devices whose peak memory this worker reports."""
        return list(self.ctx.devices)


def ddp_no_sync(model: nn.Module) -> ContextManager:
    """DDP's ``no_sync()`` for ``model``, also when ``torch.compile`` wrapped it.

    ``torch.compile`` returns an ``OptimizedModule`` holding the DDP module as ``_orig_mod``;
    it is no DDP instance, so checking the wrapper would all-reduce every accumulation
    micro-step (one full gradient all-reduce each).
    """
    inner = getattr(model, "_orig_mod", model)
    return inner.no_sync() if isinstance(inner, DistributedDataParallel) else contextlib.nullcontext()


def check_batch_divisible(cfg: "TrainConfig", replicas: int) -> None:
    """The global batch must split evenly over replicas and accumulation micro-steps."""
    parts = replicas * cfg.grad_accum_steps
    if cfg.batch_size % parts:
        lower = max(parts, cfg.batch_size // parts * parts)
        raise ValueError(
            f"TrainConfig.batch_size={cfg.batch_size} (global) does not split evenly over "
            f"{replicas} data-parallel replica(s) x grad_accum_steps={cfg.grad_accum_steps} = {parts} "
            f"micro-batches. Use a multiple of {parts}, e.g. batch_size={lower} or {lower + parts}.")


def require_one_worker(cfg: "TrainConfig", strategy: str, instead: str) -> None:
    """Single-process strategies (``dp``, ``dp_balanced``, ``mp``) cannot span workers or nodes."""
    if cfg.num_workers != 1:
        raise ValueError(
            f"TrainConfig.num_workers={cfg.num_workers}: strategy={strategy!r} runs in one worker process "
            f"on one node, over its gpus_per_worker devices. Set num_workers=1, or {instead}.")


def data_parallel_workers(cfg: "TrainConfig", num_devices: int) -> int:
    """The most workers (at most ``num_devices``) that split the global batch evenly: 100 samples on 8 GPUs: 5."""
    parts = cfg.batch_size // cfg.grad_accum_steps if cfg.batch_size % cfg.grad_accum_steps == 0 else 1
    return max(w for w in range(1, num_devices + 1) if parts % w == 0)


def num_blocks(cfg: "TrainConfig") -> int:
    """Blocks ``cfg``'s model splits into (built on ``meta``: no memory); ValueError if it cannot be split."""
    from raytrain_mgpu.pipeline.plan import meta_blocks

    return len(meta_blocks(cfg))


_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


@contextlib.contextmanager
def explain_ddp_errors(model: nn.Module) -> Iterator[None]:
    """Re-raise DDP's unused-parameter error with the TrainConfig option that fixes it.

    DDP raises it in the forward *after* a step in which some parameters got no gradient;
    torch lists their indices, which we translate into names.
    """
    try:
        yield
    except RuntimeError as exc:
        if _DDP_UNUSED not in str(exc):
            raise
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(exc))
        unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
        which = f" Parameters that got no gradient: {', '.join(unused)}." if unused else ""
        raise RuntimeError(
            f"DDP: some parameters were not used in producing the loss, so their gradients were never "
            f"all-reduced.{which} Set TrainConfig.find_unused_parameters=True (costs one autograd-graph "
            f"walk per step), or static_graph=True if the same parameters are unused in every step; "
            f"or make every output of forward() take part in the loss. (torch: {exc})") from exc
