"""The interface every training strategy implements, on the driver: plain rules, no torch.

A strategy decides, before Ray is touched (class methods, pure):

1. whether a config makes sense for it (``validate``; ``check_model`` once the data's
   shapes are known), what each worker needs (``worker_resources``, ``bundles``), and how
   many replicas split the global batch (``data_parallel_size``);
2. how ``strategy="auto"``, the memory estimate and ``gpu-report`` lay it out
   (``auto_layout``, ``auto_rank``, ``device_memory``, ``demo_layout``);
3. which runner trains it (``runner``) and, on the Ray Train runner, the two steps each
   worker applies to the model in order (``placement``, then ``replication``): the worker
   side lives in :mod:`raytrain_mgpu.parallel`, which composes them.

Options a strategy does not read (``options_used``) are warned about by the config's
validation (``config_checks.validate``), so ``bucket_cap_mb`` with ``dp`` does not pass
silently. Nothing here imports torch: ``import raytrain_mgpu; TrainConfig(...)`` asks these
classes without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, FrozenSet, List, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    import torch

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.engine.devices import DeviceAssignment
    from raytrain_mgpu.strategies._memory import DeviceMemory


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
    # fault_tolerance="replica_groups": (this worker's group, groups). Its process group is itself alone
    # (world 1 above) and its data shard the group's (engine/replica_groups.py).
    replica_group: Optional[Tuple[int, int]] = None


# TrainConfig fields some strategies read and others ignore (each strategy's ``options_used``);
# a value other than the field's default with a strategy that ignores it gets a warning.
OPTIONAL_FIELDS = ("gpus_per_worker", "output_device", "balance", "find_unused_parameters", "static_graph",
                   "bucket_cap_mb", "gradient_as_bucket_view", "sync_batchnorm", "num_stages",
                   "num_microbatches", "schedule", "shard_group_size", "cpu_offload", "tensor_parallel_size",
                   "tensor_parallel_plan", "tensor_parallel_across_nodes")
DDP_OPTIONS = frozenset({"find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view"})

# The worker steps a strategy may name, without torch (their code: ``raytrain_mgpu/parallel/``, whose
# PLACEMENTS and REPLICATIONS have exactly these keys: tests/test_architecture.py). A class naming
# another fails where it is defined, on the driver, not on a worker once the cluster is reserved.
PLACEMENT_STEPS = ("device", "keep", "data_parallel", "balanced", "split")
REPLICATION_STEPS = ("none", "replicate", "fully_shard")

class Refusal(NamedTuple):
    """A configuration a strategy cannot run: where ``applies(cfg)``, :meth:`Strategy.validate` raises
    ``ValueError(message.format(cfg=cfg))``, a message naming the field, why, and the fix."""

    applies: Callable[["TrainConfig"], bool]
    message: str


TENSOR_PARALLEL_OPTIONS = frozenset({"tensor_parallel_size", "tensor_parallel_plan", "tensor_parallel_across_nodes"})
TENSOR_PARALLEL_REFUSALS = (
    Refusal(lambda cfg: cfg.num_workers % cfg.tensor_parallel_size != 0,
            "TrainConfig.tensor_parallel_size={cfg.tensor_parallel_size}: must divide num_workers={cfg.num_workers} "
            "(every group of that many consecutive workers splits each layer; the groups are the data-parallel "
            "replicas). Set num_workers to a multiple of it, e.g. {cfg.tensor_parallel_size} or "
            "{cfg.tensor_parallel_size}x2."),
    Refusal(lambda cfg: cfg.tensor_parallel_size > 1 and cfg.shard_group_size is not None,
            "TrainConfig.shard_group_size={cfg.shard_group_size} with tensor_parallel_size={cfg.tensor_parallel_size}: "
            "HSDP and tensor parallel together need a 3-D mesh, which this package does not build. Leave "
            "shard_group_size unset (FSDP shards over all the tensor groups), or set tensor_parallel_size=1."),
    Refusal(lambda cfg: cfg.tensor_parallel_size > 1 and cfg.precision == "16-mixed",
            "TrainConfig.precision='16-mixed' with tensor_parallel_size={cfg.tensor_parallel_size}: the GradScaler's "
            "overflow check sees only this worker's part of each layer, so workers could disagree on skipping a "
            "step. Use precision='bf16-mixed'."),
    Refusal(lambda cfg: cfg.tensor_parallel_size > 1 and cfg.ingest == "ray_data",
            "TrainConfig.ingest='ray_data' with tensor_parallel_size={cfg.tensor_parallel_size}: the workers of a "
            "tensor group must read the same batches, and a stream shared by a group is not tested yet. Use "
            "ingest='loader' (a Ray Dataset: write it to Parquet, then dataset='parquet')."),
)
"""What tensor parallel (``fsdp``, ``ddp``) cannot run, checked by those strategies' ``validate``."""


def tensor_parallel_replicas(cfg: "TrainConfig") -> int:
    """Data-parallel replicas of a run whose workers form tensor groups of ``tensor_parallel_size``."""
    return cfg.num_workers // cfg.tensor_parallel_size


# ``Strategy.auto_rank`` bands: the plain model first; below AUTO_MEASURE_ONLY the strategies the
# memory estimate tries when it does not fit one device; from AUTO_MEASURE_ONLY up, timed only.
AUTO_FIRST, AUTO_MEASURE_ONLY = 0, 10


class Strategy:
    """One way of spreading training over processes and devices."""

    name: ClassVar[str]
    runner: ClassVar[str] = "train_workers"  # or "actor_group" (own runtime, see pipeline/)
    placement: ClassVar[str] = "device"
    """Step 1 on a worker, where its copy of the model lives: ``device``, ``keep``, ``data_parallel``,
    ``balanced`` or ``split`` (``raytrain_mgpu/parallel/placement.py``)."""
    replication: ClassVar[str] = "replicate"
    """Step 2, how the workers' copies stay equal: ``none``, ``replicate`` (DDP) or ``fully_shard`` (FSDP2)
    (``parallel/replication.py``)."""
    options_used: ClassVar[FrozenSet[str]] = DDP_OPTIONS | {"sync_batchnorm"}
    """Which of the optional TrainConfig fields this strategy reads; others set are warned about."""
    refusals: ClassVar[Tuple[Refusal, ...]] = ()
    """The configurations this strategy cannot run, checked first by ``validate``, in order."""
    trains_lora: ClassVar[bool] = False
    """Whether ``TrainConfig.lora`` (peft's adapters on a whole model per worker) trains with it: its workers
    hold the whole model (``ddp``) or shard it whole (``fsdp``), and its checkpoints hold the trainable part."""
    elastic: ClassVar[bool] = False
    """Whether ``num_workers=(min, max)`` may resize it: its workers are plain data-parallel replicas on
    the Ray Train runner, so any count in the range trains the same steps (``strategies/elastic.py``)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.runner != "train_workers":  # a pipeline's stages have a runtime of their own (pipeline/)
            return
        for step, value, known in (("placement", cls.placement, PLACEMENT_STEPS),
                                   ("replication", cls.replication, REPLICATION_STEPS)):
            if value not in known:
                raise TypeError(f"strategy class {cls.__name__} sets {step}={value!r}, which is not one of "
                                f"{', '.join(known)}. Set {step} to one of them (raytrain_mgpu/parallel/ has "
                                f"their code).")

    # ------------------------------------------------------------- driver side (pure)

    @classmethod
    def validate(cls, cfg: "TrainConfig") -> None:
        """Raise ValueError for configs this strategy cannot run. Default: batch maths.

        Pure checks, no warnings: ``config_checks.validate`` calls it once per config and
        warns about the options this strategy does not read (``options_used``).
        """
        for refusal in cls.refusals:
            if refusal.applies(cfg):
                raise ValueError(refusal.message.format(cfg=cfg))
        check_batch_divisible(cfg, cls.data_parallel_size(cfg))
        if cfg.compile == "blocks" and cls.placement in ("data_parallel", "balanced"):
            raise ValueError(
                f"TrainConfig.compile='blocks' with strategy={cls.name!r}: DataParallel copies the model onto each "
                f"device every step, and a block compiled in place would run the first device's copy. Set "
                f"compile=True (the whole model), or use strategy='ddp' (one device a worker).")
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
        resources.update(getattr(cfg, "resources_per_worker", None) or {})  # custom: {"spot": 1}
        if getattr(cfg, "accelerator_type", None):  # as Ray's ScalingConfig(accelerator_type=...) asks for it
            resources[f"accelerator_type:{cfg.accelerator_type}"] = 0.001
        return resources

    @classmethod
    def devices_per_worker(cls, cfg: "TrainConfig") -> int:
        return 1

    @classmethod
    def tensor_group_size(cls, cfg) -> int:
        """Workers per tensor group with ``cfg`` (a TrainConfig or its parallel section): its
        ``tensor_parallel_size`` where this strategy reads that option, else 1 (the run plan's, and the worker's
        in ``parallel.build_worker``)."""
        return cfg.tensor_parallel_size if "tensor_parallel_size" in cls.options_used else 1

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
    def auto_num_workers(cls, cfg: "TrainConfig", info) -> Optional[int]:
        """``auto_layout``'s worker count alone, without building the model or reading data: what the config's
        check at construction lays ``num_workers="auto"`` out with (``strategies/layout.provisional``). None: no
        count of its own (one worker per device). Default: ``auto_layout``'s."""
        return cls.auto_layout(cfg, info).get("num_workers")

    @classmethod
    def auto_variants(cls, cfg: "TrainConfig", info) -> Tuple[dict, ...]:
        """Further layouts (TrainConfig changes over ``auto_layout``'s) that ``auto`` tries in order when this
        strategy's own does not fit (fsdp's tensor groups). Default: none."""
        return ()

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


class NodeDevices(Strategy):
    """Base of the strategies whose worker holds ``gpus_per_worker`` devices (``dp``, ``dp_balanced``,
    ``mp``, ``ddp_mp``, ``ddp2``): one worker over a node's devices for auto and gpu-report."""

    one_worker_instead: ClassVar[Optional[str]] = None
    """The one-process strategies (``dp``, ``dp_balanced``, ``mp``): the fix their refusal of
    ``num_workers > 1`` names. None: any number of workers."""

    @classmethod
    def validate(cls, cfg: "TrainConfig") -> None:
        if cls.one_worker_instead is not None:
            require_one_worker(cfg, cls.name, cls.one_worker_instead)
        super().validate(cfg)

    @classmethod
    def devices_per_worker(cls, cfg: "TrainConfig") -> int:
        return cfg.gpus_per_worker

    @classmethod
    def auto_layout(cls, cfg: "TrainConfig", info) -> dict:
        return {"num_workers": 1, "gpus_per_worker": max(info.devices_per_node)}  # the largest node's devices

    @classmethod
    def demo_layout(cls, num_gpus: int) -> dict:
        return {"num_workers": 1, "gpus_per_worker": min(num_gpus, 4)}


class TensorGroups(Strategy):
    """Base of the strategies whose workers each hold (or shard) the whole model and may form tensor groups of
    ``tensor_parallel_size`` (``ddp``, ``fsdp``): a group shares one replica's batch; one worker per device."""

    trains_lora = True  # the whole model per worker (sharded by fsdp): peft's adapters train as any parameter
    elastic = True  # one replica per worker: num_workers=(min, max) resizes it

    @classmethod
    def data_parallel_size(cls, cfg: "TrainConfig") -> int:
        return tensor_parallel_replicas(cfg)  # a tensor group's workers share one replica's batch

    @classmethod
    def check_model(cls, cfg: "TrainConfig", input_shape: tuple, num_classes: int) -> None:
        check_tensor_parallel_model(cfg, input_shape, num_classes)

    @classmethod
    def auto_layout(cls, cfg: "TrainConfig", info) -> dict:
        return {"num_workers": data_parallel_workers(cfg, info.num_devices)}


def check_batch_divisible(cfg: "TrainConfig", replicas: int) -> None:
    """The global batch must split evenly over replicas and accumulation micro-steps."""
    parts = replicas * cfg.grad_accum_steps
    if cfg.batch_size % parts:
        lower = max(parts, cfg.batch_size // parts * parts)
        raise ValueError(
            f"TrainConfig.batch_size={cfg.batch_size} (global) does not split evenly over "
            f"{replicas} data-parallel replica(s) x grad_accum_steps={cfg.grad_accum_steps} = {parts} "
            f"micro-batches. Use a multiple of {parts}, e.g. batch_size={lower} or {lower + parts}.")


def check_lora_strategy(cfg: "TrainConfig", strategy_cls) -> None:
    """``TrainConfig.lora`` with a strategy that trains it, without tensor groups."""
    if getattr(cfg, "lora", None) is None:
        return
    if not strategy_cls.trains_lora:
        raise ValueError(
            f"TrainConfig.lora with strategy={strategy_cls.name!r}: LoRA is trained by ddp and fsdp, whose workers "
            f"hold (or shard) the whole model; {strategy_cls.name} splits or copies it (blocks over stages or devices, "
            f"which a peft model does not expose, or a copy per device each step) and is not tested with adapters. "
            f"Use strategy='ddp', or 'fsdp' where the base model does not fit one device.")
    if strategy_cls.tensor_group_size(cfg) > 1:
        raise ValueError(
            f"TrainConfig.lora with tensor_parallel_size={cfg.tensor_parallel_size}: a tensor plan splits the base "
            f"layers, and peft wraps them (q_proj becomes q_proj.base_layer beside lora_A/lora_B), so the plan's "
            f"paths no longer name them. Set tensor_parallel_size=1; with fsdp the base is sharded over all workers.")


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


def check_tensor_parallel_model(cfg: "TrainConfig", input_shape: tuple, num_classes: int) -> None:
    """With ``tensor_parallel_size > 1``: the model (built on ``meta``) has a plan that splits evenly, before Ray."""
    if cfg.tensor_parallel_size > 1:
        # late: loads torch; the rules here need none
        from raytrain_mgpu.parallel.tensor_parallel import check_model_plan

        check_model_plan(cfg, input_shape, num_classes)


def num_blocks(cfg: "TrainConfig") -> int:
    """Blocks ``cfg``'s model splits into (built on ``meta``: no memory); ValueError if it cannot be split."""
    from raytrain_mgpu.pipeline.plan import meta_blocks  # late: loads torch; the rules here need none

    return len(meta_blocks(cfg))
