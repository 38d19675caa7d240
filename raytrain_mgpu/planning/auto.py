"""``strategy="auto"``: choose a strategy and its layout before training, from what is cheap to know.

The seeds' advice, made into a rule over a memory estimate (:mod:`raytrain_mgpu.planning.memory`)
and the devices the cluster has:

1. the model, its optimizer state and its share of the batch fit on one device
   -> ``ddp`` over every device (one device: ``ddp`` with one worker, the plain model).
   Large outputs are why not ``dp``: it gathers every device's logits on the first one.
2. they do not fit -> ``fsdp`` (shards the model state; one node) or ``pipeline``
   (splits the model; first choice across nodes, where only activations cross the
   network), whichever the estimate says fits;
3. nothing fits -> a ``ValueError`` with the largest batch that would.

With ``auto_measure=True`` the strategies that fit are also timed in a short
:func:`raytrain_mgpu.planning.compare.compare` run and the fastest wins.

:func:`choose_strategy` is pure given a :class:`ClusterInfo`; :func:`resolve_auto` reads
the cluster (Ray must be connected) and returns the config to train.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import List, Optional, Tuple

import torch

from raytrain_mgpu.checkpointing.run_folder import RunFolder, run_uri
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import check_data
from raytrain_mgpu.driver.worker_nodes import only_nodes_with, requested_keys
from raytrain_mgpu.engine.devices import EMULATE_ENV, is_emulated
from raytrain_mgpu.pipeline.plan import check_splittable
from raytrain_mgpu.planning.memory import (ModelProfile, device_memory, format_bytes, max_batch_within_budget,
                                  profile_config)
from raytrain_mgpu.strategies import STRATEGIES, get_strategy
from raytrain_mgpu.strategies.base import AUTO_MEASURE_ONLY, OPTIONAL_FIELDS
from raytrain_mgpu.strategies.layout import Devices, is_auto
from raytrain_mgpu.strategies.plan import build_plan

logger = logging.getLogger(__name__)

__all__ = ["ClusterInfo", "cluster_info", "candidates", "layouts", "plan_config", "choose_strategy", "resolve_auto"]

@dataclass(frozen=True)
class ClusterInfo(Devices):
    """The devices a run can use (``strategies.layout.Devices``), with one device's memory.

    On GPU a device is a GPU; on CPU it is a worker process (``TrainConfig.num_workers``
    of them: CPU cores are shared, so more processes are no more devices).
    """

    device_memory_bytes: Optional[int] = None
    """Memory of one device (GPU); None on CPU."""

    def describe(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU worker"
        memory = f" of {format_bytes(self.device_memory_bytes)}" if self.device_memory_bytes else ""
        return f"{self.num_devices} {kind}(s){memory} on {self.num_nodes} node(s)"


def cluster_info(cfg, capacity=None) -> ClusterInfo:
    """The devices ``cfg`` can use on the connected cluster (``capacity``: read if not given).

    On GPU: every GPU of every node the cluster can have (an autoscaling cluster's node
    types at their maximum count, a type without a maximum once), and one GPU's memory
    from torch here or a one-GPU probe task, but only when a GPU node is up: from cold the
    probe would wait for the autoscaler.
    """
    if not cfg.use_gpu:
        return ClusterInfo((cfg.num_workers,), False)
    from raytrain_mgpu.driver.cluster import read_capacity  # late: loads Ray, read only for GPUs

    capacity = capacity if capacity is not None else read_capacity()
    capacity = only_nodes_with(capacity, requested_keys(cfg))  # the nodes the workers may use (resources_per_worker)
    gpus = capacity.gpus_per_node()
    if capacity.autoscales:
        logger.info("auto: counting the %d GPU(s) this autoscaling cluster can scale to, %g of them up now (%s)",
                    sum(gpus), capacity.alive_gpus, capacity.describe())
    return ClusterInfo(gpus or (0,), True, _gpu_memory_bytes(cfg, capacity) if gpus else None)


def _gpu_memory_bytes(cfg, capacity) -> Optional[int]:
    budget = getattr(cfg, "memory_budget_bytes", None)
    instead = (f"memory_budget_bytes={budget}" if budget else
               "the estimate without a memory limit (set memory_budget_bytes to one GPU's memory to choose by it)")
    if is_emulated():  # tensors live on the CPU: no GPU's memory is what the run will have
        logger.info("auto: the GPUs are emulated (%s), so there is no GPU memory to read; using %s",
                    EMULATE_ENV, instead)
        return None
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    if capacity.alive_gpus == 0:
        logger.info("auto: no GPU node is up yet (the autoscaler adds them on demand), so GPU memory is not "
                    "probed (the probe task would wait for one); using %s", instead)
        return None
    return _probe_gpu_memory()


def _probe_gpu_memory() -> Optional[int]:
    """One GPU's memory, read by a one-GPU task (the driver may have no GPU)."""
    import ray  # late: loads Ray, read only for GPUs (as read_capacity above)

    @ray.remote(num_gpus=1, num_cpus=0)
    def probe() -> int:
        import torch  # late: imported where the task runs

        return int(torch.cuda.get_device_properties(0).total_memory)

    try:
        return ray.get(probe.remote(), timeout=120)
    except Exception as exc:  # every GPU busy, or the probe failed: estimate without a limit
        logger.warning("could not read the GPUs' memory (%s); set memory_budget_bytes", exc)
        return None


# ----------------------------------------------------------------------------- layouts


def candidates(info: ClusterInfo, measured: bool = False) -> List[str]:
    """The strategies ``auto`` tries on ``info``'s devices, in order (each class's ``auto_rank``).

    The first is the plain model (chosen when it fits one device), then the strategies that
    spread the model, which the estimate tries when it does not; ``measured=True`` adds those
    only ``auto_measure`` times.
    """
    ranks = {name: cls.auto_rank(info) for name, cls in STRATEGIES.items()}
    ranked = sorted((rank, order, name) for order, (name, rank) in enumerate(ranks.items())
                    if rank is not None and (measured or rank < AUTO_MEASURE_ONLY))
    return [name for _, _, name in ranked]


def plan_config(cfg, name: str, info: ClusterInfo, variant: Optional[dict] = None):
    """``cfg`` for strategy ``name`` laid out on ``info``'s devices, validated (ValueError: why not).

    Options the strategy does not read go back to their defaults: the planned config records
    only what the run uses (``num_stages`` is part of a run's identity in ``run.json``, and a
    resumed ``auto`` run re-reads the layout from ``meta.json``), and warns about nothing. The
    model checks that need its structure (a split over devices or stages) run here, before Ray. ``variant``: one
    of the strategy's ``auto_variants`` over its ``auto_layout``.
    """
    cls = get_strategy(name)
    if info.num_devices < 1:
        raise ValueError("the cluster has no device to train on")
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in OPTIONAL_FIELDS}
    changes = {option: value for option, value in defaults.items() if option not in cls.options_used}
    if not isinstance(cfg.balance, str):
        changes["balance"] = "params"  # an explicit split was for another device count
    changes["strategy"] = name
    # A config fit has not resolved (use_gpu/num_workers "auto"): what info's devices are, one worker each
    changes.update({key: value for key, value in (("use_gpu", info.use_gpu), ("num_workers", info.num_devices))
                    if is_auto(getattr(cfg, key))})
    # Worker, device and stage counts (a split gets at most one part per block of the model).
    changes.update(cls.auto_layout(cfg, info))
    changes.update(variant or {})
    planned = cfg.replace(**changes)
    input_shape, num_classes = check_data(planned.data)
    cls.check_model(planned, input_shape, num_classes)
    if cls.runner == "actor_group":
        check_splittable(planned)
    return planned


def layouts(cfg, name: str, info: ClusterInfo) -> Tuple[dict, ...]:
    """The layouts of strategy ``name`` that ``auto`` tries and ``compare`` lists, in order: its own (``{}``), then
    its ``auto_variants`` (``fsdp``'s tensor groups), each a change over its ``auto_layout`` for :func:`plan_config`."""
    return ({}, *get_strategy(name).auto_variants(cfg, info))


def layout_label(name: str, variant: dict) -> str:
    """``"fsdp"``, ``"fsdp, tensor_parallel_size=2"``: the strategy and what a variant changes beside the counts."""
    return "".join([name, *(f", {key}={value}" for key, value in variant.items() if key != "num_workers")])


def describe_layout(cfg) -> str:
    """``"2 workers"``, ``"1 worker x 2 devices"``, ``"2 stages x 4 micro-batches"``, ``"4 workers, 2 tensor groups
    of 2"``."""
    plan = build_plan(cfg)
    if plan.runner == "actor_group":
        prefix = f"{plan.replicas} x " if plan.replicas > 1 else ""
        return f"{prefix}{cfg.num_stages} stages, {cfg.num_microbatches} micro-batches"
    workers = f"{cfg.num_workers} worker{'s' if cfg.num_workers > 1 else ''}"
    if plan.tensor_group_size > 1:
        return f"{workers}, {cfg.num_workers // plan.tensor_group_size} tensor group(s) of {plan.tensor_group_size}"
    return f"{workers} x {plan.devices_per_worker} devices" if plan.devices_per_worker > 1 else workers


# ----------------------------------------------------------------------------- the choice


def _peak(name: str, cfg, profile: ModelProfile) -> int:
    return max(d.at(cfg.batch_size) for d in device_memory(name, cfg, profile))


def _output_note(profile: ModelProfile, cfg) -> str:
    """Seed 001: DataParallel gathers every output on one device; say whether that would matter."""
    gathered = profile.output_bytes * cfg.batch_size
    ratio = gathered / max(profile.param_bytes, 1)
    size = "large" if ratio > 1 else "small"
    return (f"outputs {format_bytes(gathered)} per step are {size} next to the model's "
            f"{format_bytes(profile.param_bytes)} ({ratio:.1f}x), "
            f"{'so dp (which gathers them on one device) is out' if ratio > 1 else 'and ddp beats dp anyway'}")


def choose_strategy(cfg, info: ClusterInfo, memory_budget_bytes: Optional[int] = None,
                    profile: Optional[ModelProfile] = None) -> Tuple[str, str, dict]:
    """``(strategy name, one-line reason, layout variant)`` for ``cfg`` on ``info``'s devices; pure given ``info``.

    ``memory_budget_bytes`` (default: the device's memory) is what one device may hold;
    on CPU without a budget the model is taken to fit. The candidates come in the order
    of their classes' ``auto_rank``: the plain model first, the first that fits wins. The
    variant (``Strategy.auto_variants``, ``{}`` for the plain layout) is what :func:`plan_config` needs.
    """
    profile = profile or profile_config(cfg)
    budget = memory_budget_bytes or info.device_memory_bytes
    where = info.describe()
    first, *spread = candidates(info)
    planned = plan_config(cfg, first, info)
    need = _peak(first, planned, profile)
    if budget is None or need <= budget:
        fits = (f"fits one device ({format_bytes(need)} at {build_plan(planned).micro_batch} samples per device"
                + (f" <= budget {format_bytes(budget)})" if budget else "; no memory budget known on CPU)"))
        reason = get_strategy(first).auto_reason(info)
        return first, f"{reason}: the model {fits}; {_output_note(profile, cfg)} [{where}]", {}
    if info.num_devices == 1:
        raise ValueError(_nothing_fits(cfg, profile, budget, [first], info))
    needs = {}
    for name in spread:
        for variant in layouts(cfg, name, info):
            try:
                peak = _peak(name, plan_config(cfg, name, info, variant), profile)
            except ValueError as exc:
                logger.debug("auto: %s %s is not possible here: %s", name, variant, exc)
                continue
            needs.setdefault(name, peak)
            if peak <= budget:
                label = layout_label(name, variant)
                return name, (f"{label}: {first} would need {format_bytes(need)} per device, over the budget "
                              f"{format_bytes(budget)}; {get_strategy(name).auto_reason(info)}"
                              f"{' (each layer split over a tensor group of one node)' if label != name else ''} "
                              f"and needs {format_bytes(peak)} [{where}]"), variant
    raise ValueError(_nothing_fits(cfg, profile, budget, [first, *needs], info))


def _nothing_fits(cfg, profile: ModelProfile, budget: int, tried: list, info: ClusterInfo) -> str:
    hints = []
    for name in tried:
        planned = plan_config(cfg, name, info)
        try:
            hints.append(f"{name} fits up to batch_size={max_batch_within_budget(name, planned, profile, budget)}")
        except ValueError:
            hints.append(f"{name} fits no batch (its model state alone needs "
                         f"{format_bytes(max(d.fixed for d in device_memory(name, planned, profile)))})")
    return (f"TrainConfig.strategy='auto': no strategy fits batch_size={cfg.batch_size} into "
            f"{format_bytes(budget)} per device on {info.describe()}. By the estimate: {'; '.join(hints)}. "
            f"Lower batch_size, raise grad_accum_steps, or add devices (fsdp and pipeline spread the model "
            f"over them).")


RESUMING = "resuming: the run keeps the strategy it started with"


def previous_layout(cfg) -> Optional[dict]:
    """The strategy and layout a run of this name started with (a resume must keep them).

    Read from the newest checkpoint's meta in the run folder, local or remote, whichever
    runner wrote it (both store the whole config). No Ray: ``fit`` answers a resumed or
    finished ``auto`` run from it before connecting.
    """
    newest = RunFolder.of(cfg).newest_checkpoint()
    saved = newest.meta.get("config", {}) if newest is not None else {}
    keys = ("strategy", "num_workers", "gpus_per_worker", "num_stages", "num_microbatches", "schedule",
            "balance", "placement", "tensor_parallel_size")
    layout = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in keys}
    return layout if layout.get("strategy") else None


def resolve_auto(cfg, info: Optional[ClusterInfo] = None, compare=None) -> Tuple[object, dict]:
    """The config ``fit`` trains for ``strategy="auto"``, and the record it adds to each history row.

    Ray must be connected (the cluster is read unless ``info`` is given). A run that
    already has checkpoints keeps the strategy it started with. ``compare`` times the
    candidates under ``auto_measure`` (``fit`` passes ``raytrain_mgpu.api.compare``, whose
    runs are fits: planning never imports the api above it).
    """
    budget = getattr(cfg, "memory_budget_bytes", None)
    info = info or cluster_info(cfg)
    previous = previous_layout(cfg)
    if previous:
        name, reason = previous["strategy"], RESUMING
        resolved = cfg.replace(**previous)
    else:
        profile = profile_config(cfg)
        name, reason, variant = choose_strategy(cfg, info, budget, profile)
        resolved = plan_config(cfg, name, info, variant)
        if getattr(cfg, "auto_measure", False):
            name, reason, measured = _measure(cfg, info, budget, profile, name, reason, compare)
            resolved = measured if measured is not None else resolved
    logger.info("strategy=auto chose %s: %s", name, reason)
    return resolved, {"auto_strategy": name, "auto_reason": reason}


def _measure(cfg, info: ClusterInfo, budget, profile: ModelProfile, name: str, reason: str, compare) -> tuple:
    """Time the strategies the estimate lets fit in one of their layouts (``fsdp`` with tensor groups too) in a
    short compare run: ``(name, reason, config)``."""
    if compare is None:
        raise TypeError("resolve_auto: TrainConfig.auto_measure=True needs compare= (raytrain_mgpu.api.compare)")
    fitting = []  # the strategies one of whose layouts fits (compare times each of their layouts)
    for candidate in candidates(info, measured=True):
        for variant in layouts(cfg, candidate, info):
            try:
                planned = plan_config(cfg, candidate, info, variant)
            except ValueError:
                continue
            if budget is None or _peak(candidate, planned, profile) <= budget:
                fitting.append(candidate)
                break
    if not fitting:
        return name, reason, None
    report = compare(cfg, strategies=fitting, steps=10, warmup_steps=2, memory_budget_bytes=budget,
                     storage_path=run_uri(cfg.storage_path, f"{cfg.name}-auto-measure"))
    best = report.recommendation
    if best.strategy is None:
        return name, f"{reason} (auto_measure found nothing better: {best.reason})", None
    return best.strategy, f"measured in {report.paths.get('markdown', 'a compare run')}: {best.reason}", best.config
