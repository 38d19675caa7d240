"""Connecting to Ray and checking, before anything is scheduled, that the run can be placed.

A run that cannot be placed would otherwise wait forever for resources; here it fails at
once with what it needs and what the cluster has. On an autoscaling cluster (the shipped
``cluster.yaml`` starts with 0 GPU nodes) the check is against what it can have: each
bundle against one node or node type (a worker never spans nodes), the whole set against
every node type at its maximum count (:class:`Capacity`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import ray
import ray._private.worker
import torch

from raytrain_mgpu.config.factories import local_modules_to_ship, upload_modules
from raytrain_mgpu.driver import autoscaler_config
from raytrain_mgpu.engine import devices
from raytrain_mgpu.driver.preflight import probe_ray_address
from raytrain_mgpu.driver.worker_nodes import (RAY_OWN_RESOURCES, check_groups_within_nodes, check_requested,
                                               only_nodes_with)

logger = logging.getLogger(__name__)


def connect(address: Optional[str], verbose: bool, local_has_gpu_check: bool) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``) or start a local instance. Returns True if we started Ray."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    probe_ray_address(address)  # seconds instead of ray.init's minutes, and a refused token named
    if address is None and local_has_gpu_check and not devices.is_emulated():
        if not torch.cuda.is_available():
            raise ValueError("TrainConfig.use_gpu=True, but this machine has no CUDA GPU and no Ray "
                             "cluster address is set. Set use_gpu=False, pass --address / RAY_ADDRESS "
                             f"of a cluster with GPUs, or set {devices.EMULATE_ENV}=4 to emulate 4 GPUs "
                             "on the CPU.")
    # A local instance under emulation gets the N fake GPUs; a cluster brings its own. A local instance is this
    # process's alone and ends with it: no dashboard (its processes took 0.4-1.4 s of Ray's 2.5 s start on 2 cores,
    # and CPU from the workers' start after). A driver that wants it calls ray.init() before fit.
    local = {"include_dashboard": False, **devices.local_ray_init_kwargs()} if address is None else {}
    if address is None:  # the raylet starts every worker with what worker_runtime_env would give each run
        for key, value in worker_env_vars().items():
            os.environ.setdefault(key, value)
    inherited = worker_env_vars()  # what a raylet started now inherits of it
    try:
        # log_to_driver=False: workers' own logs stay in the Ray session folder; errors still
        # reach the driver as exceptions, and progress comes through ProgressSink.
        ray.init(address=address, log_to_driver=verbose, logging_level=logging.WARNING, **local)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r} ({exc}). Check that it is "
                              f"running (`ray status --address {address}`) and the address, or unset "
                              f"RAY_ADDRESS to start a local instance.") from exc
    if address is None:
        _RAYLET_ENV.update(node=_local_node(), env=inherited)
    return True


# The Ray node connect() started and what its raylet (so every worker it starts) inherited of worker_env_vars().
_RAYLET_ENV: dict = {}


def _local_node():
    return getattr(ray._private.worker, "_global_node", None)


def keep_ray_started(started: bool) -> None:
    """A local Ray that ``fit`` or ``compare`` started stays up for the next call in this process (a notebook's
    loop, a sweep: Ray's start is paid once) and is shut down when the process exits."""
    global _RAY_AT_EXIT
    if started and not _RAY_AT_EXIT:
        import atexit

        atexit.register(ray.shutdown)
        _RAY_AT_EXIT = True


_RAY_AT_EXIT = False



# ----------------------------------------------------------------------------- what the cluster can have


@dataclass(frozen=True)
class NodeType:
    """One node type of an autoscaling cluster (an ``available_node_types`` entry of ``ray up``'s config)."""

    name: str
    resources: Dict[str, float]
    max_count: int
    """How many nodes of this type may run at once; -1: no limit."""

    def describe(self) -> str:
        count = "no limit" if self.max_count < 0 else f"up to {self.max_count}"
        custom = "".join(f", {v:g} {k}" for k, v in self.resources.items() if k not in RAY_OWN_RESOURCES)
        return f"{self.name}: {_shape(self.resources)}{custom}, {count}"




@dataclass(frozen=True)
class Capacity:
    """What the cluster can have: the nodes alive now and, when it autoscales, its node types.

    Read once by :func:`read_capacity`; the checks of ``fit``, the pipeline,
    ``strategy="auto"`` and ``compare`` all take their answer from here, so a cluster that
    starts with 0 GPU nodes is judged by what its autoscaler can add.
    """

    alive: Tuple[Dict[str, float], ...]
    node_types: Tuple[NodeType, ...] = ()
    max_resources: Dict[str, float] = field(default_factory=dict)
    """Cluster-wide caps from the autoscaler's config (e.g. ``{"GPU": 16}``); a missing key: no cap."""
    max_worker_nodes: int = -1
    """The config's top-level ``max_workers``: worker nodes of all types at once, the head not counted; -1: none."""
    node_types_source: str = ""
    """Where the node types were read: ``"the GCS"`` or the autoscaler's config file."""
    node_types_unknown: str = ""
    """Why the node types could not be read (the cluster may autoscale, but what it can add is not known
    here); empty when they were read or the cluster has none."""

    @property
    def autoscales(self) -> bool:
        return bool(self.node_types)

    @property
    def alive_gpus(self) -> float:
        return sum(n.get("GPU", 0) for n in self.alive)

    def possible_nodes(self, unlimited: int = 1) -> List[Tuple[str, Dict[str, float]]]:
        """``(label, resources)`` of every node that can exist at once: the alive ones, and each
        node type's nodes not up yet (``unlimited`` of them for a type without a maximum)."""
        nodes = [(f"alive node {i}", dict(n)) for i, n in enumerate(self.alive)]
        return nodes + self._addable(unlimited)

    def _addable(self, unlimited: int) -> List[Tuple[str, Dict[str, float]]]:
        up = _alive_per_type(self.alive, self.node_types)
        nodes = []
        for node_type in self.node_types:
            missing = unlimited if node_type.max_count < 0 else max(node_type.max_count - up[node_type.name], 0)
            nodes.extend((f"node type {node_type.name!r}", dict(node_type.resources)) for _ in range(missing))
        return nodes

    def _richest_in(self, key: str, unlimited: int) -> List[Dict[str, float]]:
        """The alive nodes, and the nodes to add with the most ``key`` that ``max_worker_nodes`` leaves room for
        (every worker node up counts, the head does not)."""
        addable = sorted((n for _, n in self._addable(unlimited)), key=lambda n: n.get(key, 0), reverse=True)
        if self.max_worker_nodes >= 0:
            workers_up = sum(1 for n in self.alive if autoscaler_config.HEAD_RESOURCE not in n)
            addable = addable[:max(self.max_worker_nodes - workers_up, 0)]
        return [dict(n) for n in self.alive] + addable

    def max_total(self, key: str, unlimited: int = 1) -> float:
        """The most of ``key`` the cluster can have at once (the alive nodes' total if it does not autoscale)."""
        total = sum(n.get(key, 0) for n in self._richest_in(key, unlimited))
        cap = self.max_resources.get(key)
        return min(total, cap) if cap else total

    def gpus_per_node(self, unlimited: int = 1) -> Tuple[int, ...]:
        """The GPU count of every node with a GPU that can exist at once (``strategy="auto"``'s devices)."""
        return tuple(int(n.get("GPU", 0)) for n in self._richest_in("GPU", unlimited) if n.get("GPU", 0) >= 1)

    def describe(self) -> str:
        alive = _describe(list(self.alive))
        if not self.autoscales:
            return alive
        return f"node types {'; '.join(t.describe() for t in self.node_types)}; now up: {alive}"


def _shape(resources: Dict[str, float]) -> str:
    return f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def _alive_per_type(alive, node_types) -> Dict[str, int]:
    """How many alive nodes are of each type: a node is of a type when it has exactly the
    type's CPU, GPU and custom resources (the autoscaler starts it with those)."""
    up = {t.name: 0 for t in node_types}
    for node in alive:
        for node_type in node_types:
            keys = {"CPU", "GPU", *node_type.resources}
            same = all(node.get(k, 0) == node_type.resources.get(k, 0) for k in keys)
            if same and (node_type.max_count < 0 or up[node_type.name] < node_type.max_count):
                up[node_type.name] += 1
                break
    return up


def _nodes() -> List[Dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _cluster_config():
    """The autoscaler's ``ClusterConfig`` proto (node types, max counts) from the GCS; None if there is none."""
    try:
        return ray._private.state.state.get_cluster_config()
    except Exception:  # not connected, or a GCS without the key: judge by the alive nodes
        return None


def read_capacity() -> Capacity:
    """What the connected cluster can have: its alive nodes, plus its node types when it autoscales: from the
    GCS where the autoscaler publishes them, else from the config file it reads (``autoscaler_config``)."""
    config = _cluster_config()
    node_types = []
    for i, group in enumerate(config.node_group_configs if config is not None else ()):
        resources = {k: float(v) for k, v in group.resources.items()}
        if resources and group.max_count != 0:  # what Ray's own maximum ignores, too
            node_types.append(NodeType(group.name or f"type {i}", resources, int(group.max_count)))
    if node_types:
        caps = {k: float(v) for k, v in config.max_resources.items()}
        return Capacity(tuple(_nodes()), tuple(node_types), caps, node_types_source="the GCS")
    found = autoscaler_config.read_node_types()
    return Capacity(tuple(_nodes()), tuple(NodeType(*t) for t in found.node_types),
                    max_worker_nodes=found.max_worker_nodes, node_types_source=found.source,
                    node_types_unknown=found.unknown)


# ----------------------------------------------------------------------------- checks


def _describe(nodes: List[Dict[str, float]]) -> str:
    return "; ".join(f"node {i}: {_shape(node)}" for i, node in enumerate(nodes)) or "no alive nodes"


def _fits(bundles: List[dict], nodes: List[Dict[str, float]]) -> bool:
    """Greedy first-fit of the bundles (largest first) into the nodes' total resources."""
    free = [dict(n) for n in nodes]
    for bundle in sorted(bundles, key=lambda b: (b.get("GPU", 0), b.get("CPU", 0)), reverse=True):
        for node in free:
            if all(node.get(k, 0) >= v for k, v in bundle.items()):
                for k, v in bundle.items():
                    node[k] = node.get(k, 0) - v
                break
        else:
            return False
    return True


_OPTIONS = (("GPU", "gpus_per_worker"), ("CPU", "cpus_per_worker"))


def _check_one_bundle_fits_a_node(bundles: List[dict], nodes: List[Dict[str, float]], what: str) -> None:
    """A worker cannot span nodes: say so when one bundle is bigger than every node."""
    for key, option in _OPTIONS:
        need = max((b.get(key, 0) for b in bundles), default=0)
        largest = max((n.get(key, 0) for n in nodes), default=0)
        if need > largest:
            raise ValueError(f"{what}: one worker needs {need:g} {key}, but the largest node has {largest:g} "
                             f"({_describe(nodes)}), and a worker cannot span nodes. Set {option} to at most "
                             f"{largest:g}, or add a node with {need:g} {key}.")


def _check_alive(bundles: List[dict], use_gpu: bool, what: str, nodes: List[Dict[str, float]]) -> None:
    """A cluster that does not autoscale: what is alive now is all there is."""
    needed = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    if use_gpu and sum(n.get("GPU", 0) for n in nodes) == 0:
        raise ValueError(f"TrainConfig.use_gpu=True, but the Ray cluster has no GPU ({_describe(nodes)}). "
                         f"Set use_gpu=False, or connect to a cluster with GPUs.")
    _check_one_bundle_fits_a_node(bundles, nodes, what)
    if not _fits(bundles, nodes):
        shape = bundles[0] if bundles else {}
        raise ValueError(f"{what} needs {len(bundles)} x {shape} ({needed['CPU']:g} CPU, {needed['GPU']:g} GPU), "
                         f"which this cluster cannot place ({_describe(nodes)}). Lower num_workers, "
                         f"cpus_per_worker or gpus_per_worker, or add nodes.")


def _check_autoscaling(bundles: List[dict], use_gpu: bool, what: str, capacity: Capacity) -> None:
    """Each bundle against one node (alive or a node type), and the whole set against what can exist."""
    possible = capacity.possible_nodes(unlimited=max(len(bundles), 1))
    if use_gpu and capacity.max_total("GPU") == 0:
        raise ValueError(f"TrainConfig.use_gpu=True, but the Ray cluster has no GPU and none of its node types "
                         f"has one ({capacity.describe()}). Set use_gpu=False, or add a node type with GPU to "
                         f"the cluster config.")
    for key, option in _OPTIONS:
        need = max((b.get(key, 0) for b in bundles), default=0)
        label, largest = max(possible, key=lambda p: (p[1].get(key, 0), p[0].startswith("node type")),
                             default=("no node", {}))
        if need > largest.get(key, 0):
            raise ValueError(f"{what}: one worker needs {need:g} {key}, but the largest {label} has "
                             f"{largest.get(key, 0):g} {key} ({capacity.describe()}), and a worker cannot span "
                             f"nodes. Set {option} to at most {largest.get(key, 0):g}, or add a node type with "
                             f"{need:g} {key} to the cluster config.")
    for key in ("CPU", "GPU"):
        amount, most = sum(b.get(key, 0) for b in bundles), capacity.max_total(key, unlimited=len(bundles))
        if amount > most:
            raise ValueError(f"{what} needs {amount:g} {key} in all, but this autoscaling cluster can scale to at "
                             f"most {most:g} ({capacity.describe()}). Lower the worker count, or raise max_workers "
                             f"of a node type with {key} in the cluster config.")
    scarce = "GPU" if any(b.get("GPU", 0) for b in bundles) else "CPU"  # the nodes max_workers lets up at once
    if not _fits(bundles, capacity._richest_in(scarce, max(len(bundles), 1))):
        raise ValueError(f"{what} needs {len(bundles)} x {bundles[0]}, which this autoscaling cluster cannot place "
                         f"even at its largest ({capacity.describe()}). Lower num_workers, cpus_per_worker or "
                         f"gpus_per_worker, or raise max_workers of a node type in the cluster config.")
    if not _fits(bundles, list(capacity.alive)):
        logger.info("%s: the nodes up now cannot place it; it waits for the autoscaler to add nodes (%s)",
                    what, capacity.describe())


def pending_message(bundles: List[dict], what: str, timeout_s: float) -> str:
    """Why a run fails when its resources were not granted in ``timeout_s``: what is pending and what the cluster is."""
    try:
        capacity = read_capacity()
        state = capacity.describe() + (f"; its node types are not known here: {capacity.node_types_unknown}"
                                       if capacity.node_types_unknown else "")
    except Exception as exc:  # the cluster went away: say so, not more
        state = f"the cluster could not be read: {exc}"
    shapes = sorted({repr(b) for b in bundles})
    return (f"{what}: the cluster did not grant {len(bundles)} bundle(s) ({', '.join(shapes)}) within "
            f"placement_timeout_s={timeout_s:g} s ({state}). An autoscaling cluster may still be starting nodes (raise "
            f"placement_timeout_s); otherwise lower num_workers, cpus_per_worker, gpus_per_worker or "
            f"resources_per_worker, or add nodes or node types that have them.")


def check_placeable(bundles: List[dict], use_gpu: bool, what: str, capacity: Optional[Capacity] = None,
                    labels: Optional[dict] = None, group_size: int = 1,
                    groups_may_span: bool = False) -> None:
    """Raise ValueError if ``bundles`` can never be placed on this cluster (``capacity``: read if not given) on nodes
    that carry ``labels`` (a Ray label selector), with every ``group_size`` consecutive workers on one node."""
    capacity = capacity if capacity is not None else read_capacity()
    if capacity.node_types_unknown and not _fits(bundles, list(capacity.alive)):
        # it may autoscale, but what it can add is not known here: ask, and let placement_timeout_s bound the wait
        logger.warning("%s: the nodes up now cannot place %d x %s, and this cluster's node types are not known here "
                       "(%s); not refused: the workers wait up to placement_timeout_s for nodes", what, len(bundles),
                       bundles[0] if bundles else {}, capacity.node_types_unknown)
        return
    check_requested(bundles, what, capacity, labels)
    capacity = only_nodes_with(capacity, sorted({k for b in bundles for k in b if k not in ("CPU", "GPU")}))
    if capacity.autoscales:
        _check_autoscaling(bundles, use_gpu, what, capacity)
    else:
        _check_alive(bundles, use_gpu, what, list(capacity.alive))
    check_groups_within_nodes(bundles, group_size, what, capacity, groups_may_span)


def worker_runtime_env(*specs: str) -> dict:
    """The runtime env of every training process (Ray Train workers and pipeline stages).

    - Ray starts worker processes at nice 15: on a node where anything else runs (Ray's own
      daemons at nice 0, on a small machine), a training worker yields to it; measured on 2
      cores, ``fit`` with 1 worker ran at 0.90x a plain loop. A worker owns its resources, so
      it runs at normal priority, as Ray's job drivers do.
    - the user's own modules that ``specs`` name (``TrainConfig.code_specs()``: model, dataset,
      optimizer, ...), when they live outside installed packages.
    - the GPU emulation switch, so every worker and stage actor emulates too, also when the
      driver called ``ray.init`` itself (workers inherit the raylet's environment, not the driver's).
    """
    # On a Ray that connect() started, its raylet has what the driver's environment held then, and a runtime env
    # that sets nothing new lets Ray hand the run its pre-started worker processes (each a Python that has
    # imported Ray already) instead of starting new ones with that env. A value set since (or a Ray started or
    # joined otherwise) goes in the runtime env: the workers inherit the raylet's environment, not the driver's.
    node = _local_node()
    inherited = _RAYLET_ENV["env"] if node is not None and _RAYLET_ENV.get("node") is node else {}
    missing = {key: value for key, value in worker_env_vars().items() if inherited.get(key) != value}
    env: dict = {"env_vars": missing} if missing else {}
    shipped = local_modules_to_ship(*specs)
    if shipped:
        env["py_modules"] = upload_modules(shipped)
    return env


def worker_env_vars() -> dict:
    """Environment every training process needs: normal priority (Ray starts workers at nice 15), GPU emulation, and
    the driver's choice of asynchronous sharded saves (``engine/checkpoints.ASYNC_SHARDED_ENV``)."""
    switch = "RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE"
    return {"RAY_worker_niceness": "0", **devices.runtime_env_vars(),
            **({switch: os.environ[switch]} if switch in os.environ else {})}



