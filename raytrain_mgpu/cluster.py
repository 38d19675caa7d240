"""Connecting to Ray and checking, before anything is scheduled, that the run can be placed.

A run that cannot be placed would otherwise wait forever for resources; here it fails at
once with what it needs and what the cluster has. On an autoscaling cluster the check is
against the most the cluster can scale to (what Ray Train itself consults).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

import ray

from raytrain_mgpu import devices
from raytrain_mgpu.preflight import probe_ray_address

logger = logging.getLogger(__name__)


def connect(address: Optional[str], verbose: bool, local_has_gpu_check: bool) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``) or start a local instance. Returns True if we started Ray."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    probe_ray_address(address)  # seconds instead of ray.init's minutes, and a refused token named
    if address is None and local_has_gpu_check and not devices.is_emulated():
        import torch

        if not torch.cuda.is_available():
            raise ValueError("TrainConfig.use_gpu=True, but this machine has no CUDA GPU and no Ray "
                             "cluster address is set. Set use_gpu=False, pass --address / RAY_ADDRESS "
                             f"of a cluster with GPUs, or set {devices.EMULATE_ENV}=4 to emulate 4 GPUs "
                             "on the CPU.")
    # A local instance under emulation gets the N fake GPUs; a cluster brings its own.
    local = devices.local_ray_init_kwargs() if address is None else {}
    try:
        # log_to_driver=False: workers' own logs stay in the Ray session folder; errors still
        # reach the driver as exceptions, and progress comes through ProgressSink.
        ray.init(address=address, log_to_driver=verbose, logging_level=logging.WARNING, **local)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r} ({exc}). Check that it is "
                              f"running (`ray status --address {address}`) and the address, or unset "
                              f"RAY_ADDRESS to start a local instance.") from exc
    return True


def _nodes() -> List[Dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _describe(nodes: List[Dict[str, float]]) -> str:
    parts = []
    for i, node in enumerate(nodes):
        cpu, gpu = node.get("CPU", 0), node.get("GPU", 0)
        parts.append(f"node {i}: {cpu:g} CPU, {gpu:g} GPU")
    return "; ".join(parts) or "no alive nodes"


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


def _check_one_bundle_fits_a_node(bundles: List[dict], nodes: List[Dict[str, float]], what: str) -> None:
    """A worker cannot span nodes: say so when one bundle is bigger than every node."""
    for key, option in (("GPU", "gpus_per_worker"), ("CPU", "cpus_per_worker")):
        need = max((b.get(key, 0) for b in bundles), default=0)
        largest = max((n.get(key, 0) for n in nodes), default=0)
        if need > largest:
            raise ValueError(f"{what}: one worker needs {need:g} {key}, but the largest node has {largest:g} "
                             f"({_describe(nodes)}), and a worker cannot span nodes. Set {option} to at most "
                             f"{largest:g}, or add a node with {need:g} {key}.")


def check_placeable(bundles: List[dict], use_gpu: bool, what: str) -> None:
    """Raise ValueError if ``bundles`` can never be placed on this cluster."""
    try:
        max_resources = ray._private.state.state.get_max_resources_from_cluster_config()
    except Exception:  # not an autoscaling cluster, or an older GCS
        max_resources = None
    needed = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
    if max_resources:  # autoscaling: nodes may not exist yet
        for key, amount in needed.items():
            if amount and max_resources.get(key, 0) < amount:
                raise ValueError(f"{what} needs {amount:g} {key} in all, but this autoscaling cluster can "
                                 f"scale to at most {max_resources.get(key, 0):g}. Lower the worker count "
                                 f"or add a node type with {key} to the cluster config.")
        return
    nodes = _nodes()
    total_gpu = sum(n.get("GPU", 0) for n in nodes)
    if use_gpu and total_gpu == 0:
        raise ValueError(f"TrainConfig.use_gpu=True, but the Ray cluster has no GPU ({_describe(nodes)}). "
                         f"Set use_gpu=False, or connect to a cluster with GPUs.")
    _check_one_bundle_fits_a_node(bundles, nodes, what)
    if not _fits(bundles, nodes):
        shape = bundles[0] if bundles else {}
        raise ValueError(f"{what} needs {len(bundles)} x {shape} ({needed['CPU']:g} CPU, {needed['GPU']:g} GPU), "
                         f"which this cluster cannot place ({_describe(nodes)}). Lower num_workers, "
                         f"cpus_per_worker or gpus_per_worker, or add nodes.")


def worker_runtime_env(model: str, dataset: str) -> dict:
    """The runtime env of every training process (Ray Train workers and pipeline stages).

    - Ray starts worker processes at nice 15: on a node where anything else runs (Ray's own
      daemons at nice 0, on a small machine), a training worker yields to it; measured on 2
      cores, ``fit`` with 1 worker ran at 0.90x a plain loop. A worker owns its resources, so
      it runs at normal priority, as Ray's job drivers do.
    - the user's own model/dataset modules, when they live outside installed packages.
    - the GPU emulation switch, so every worker and stage actor emulates too, also when the
      driver called ``ray.init`` itself (workers inherit the raylet's environment, not the driver's).
    """
    from raytrain_mgpu._factory import local_modules_to_ship, upload_modules

    env: dict = {"env_vars": {"RAY_worker_niceness": "0", **devices.runtime_env_vars()}}
    shipped = local_modules_to_ship(model, dataset)
    if shipped:
        env["py_modules"] = upload_modules(shipped)
    return env

