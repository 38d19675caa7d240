"""Workers go where the user says: custom resources (``resources_per_worker``), a GPU type (``accelerator_type``)
and node labels (``label_selector``), checked against what the cluster has or can add before anything is asked of
Ray (``driver/cluster.check_placeable`` calls :func:`check_requested`): a request no node can ever satisfy would
otherwise leave a placement group pending for ever. A tensor group's workers go to one node (its every layer
communicates): :func:`check_groups_within_nodes` refuses groups that no placement keeps on one node."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, List, Optional

__all__ = ["RAY_OWN_RESOURCES", "check_requested", "check_groups_within_nodes", "label_matches", "requested_keys",
           "only_nodes_with"]

logger = logging.getLogger(__name__)

RAY_OWN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Ray's own resource names; a node's (or a node type's) other keys are custom ones, the user's."""


def check_requested(bundles: List[dict], what: str, capacity, labels: Optional[dict]) -> None:
    """Custom resources, a GPU type and node labels that no node has (alive, or of a node type the autoscaler can
    add) are refused, named, in seconds: Ray would keep the placement group pending for ever. Where the cluster
    may add nodes of types not known here, nothing is refused (the wait is bounded instead: placement_timeout_s)."""
    if getattr(capacity, "node_types_unknown", ""):
        return
    nodes = [n for _, n in capacity.possible_nodes()]
    where = "no node of this cluster" + (" (alive, or of a node type its autoscaler can add)" if capacity.autoscales
                                         else "") + " has"
    for key in sorted({k for b in bundles for k in b if k not in RAY_OWN_RESOURCES}):
        if any(n.get(key, 0) > 0 for n in nodes):
            continue
        if key.startswith("accelerator_type:"):
            types = sorted({k.split(":", 1)[1] for n in nodes for k in n if k.startswith("accelerator_type:")})
            raise ValueError(f"{what}: TrainConfig.accelerator_type={key.split(':', 1)[1]!r}: {where} that GPU type "
                             f"(GPU types there: {', '.join(types) or 'none'}; {capacity.describe()}). Set "
                             f"accelerator_type to one of them, or leave it unset to take any GPU.")
        custom = sorted({k for n in nodes for k in n if k not in RAY_OWN_RESOURCES and not k.startswith(("node:", "accelerator"))})
        raise ValueError(f"{what}: TrainConfig.resources_per_worker asks for the Ray resource {key!r}, which {where} "
                         f"(custom resources there: {', '.join(custom) or 'none'}; {capacity.describe()}). Check its "
                         f"name, declare it in a node type's resources (cluster.yaml) or `ray start --resources`, or "
                         f"leave it out.")
    if labels and not capacity.autoscales:
        alive = _alive_labels()
        if not any(label_matches(labels, node) for node in alive):
            raise ValueError(f"{what}: TrainConfig.label_selector={labels!r} matches no node of this cluster (their "
                             f"labels: {alive}). Check the labels (`ray start --labels`, a node type's labels in "
                             f"cluster.yaml), or leave label_selector unset.")


def _workers_held(node: Dict[str, float], bundle: dict) -> int:
    """How many workers of ``bundle`` one node of ``node``'s resources holds."""
    return min((int(node.get(key, 0) / amount + 1e-9) for key, amount in bundle.items() if amount > 0), default=0)


def check_groups_within_nodes(bundles: List[dict], group_size: int, what: str, capacity,
                              may_span: bool = False) -> None:
    """Every ``group_size`` consecutive workers (a tensor group: Ray Train numbers a node's workers consecutively)
    must share a node. Refused where no placement on the nodes the cluster has, or its node types can add, holds all
    ``bundles`` in whole groups: every node too small for a group, or too few whole groups in all. Where the node
    types are not known here, or a node holds a count Ray may split, the workers' check at set-up refuses a group
    that spans nodes (``parallel/tensor_parallel.py``). ``may_span`` (``tensor_parallel_across_nodes``): the refusal
    is a warning."""
    if group_size <= 1 or not bundles or getattr(capacity, "node_types_unknown", ""):
        return
    held = [_workers_held(node, bundles[0]) for _, node in capacity.possible_nodes(unlimited=len(bundles))]
    whole = sum(n // group_size * group_size for n in held)
    if whole >= len(bundles):
        uneven = sorted({n for n in held if n % group_size})
        if uneven:
            logger.warning("%s: tensor_parallel_size=%d, and some nodes hold %s worker(s) of %s: where Ray puts a "
                           "count that is not a multiple of %d on a node, a group spans two nodes and the workers "
                           "refuse it at set-up (%s)", what, group_size, uneven, bundles[0], group_size,
                           capacity.describe())
        return
    key = "GPU" if bundles[0].get("GPU", 0) else "CPU"
    smaller = [t for t in range(group_size - 1, 0, -1)
               if len(bundles) % t == 0 and sum(n // t * t for n in held) >= len(bundles)]
    sizes = "; ".join(f"{count} node(s) {n} each" for n, count in sorted(Counter(held).items(), reverse=True) if n)
    fewer = f"num_workers={whole}" if whole else "fewer workers"
    message = (
        f"{what}: TrainConfig.tensor_parallel_size={group_size}: a tensor group's {group_size} workers must share a "
        f"node (every layer communicates within it), but the nodes hold at most {max(held, default=0)} worker(s) of "
        f"{bundles[0]} ({sizes or 'no node'}: {capacity.describe()}), so no placement keeps {len(bundles)} workers in "
        f"whole groups of {group_size}. Set tensor_parallel_size={smaller[0] if smaller else 1} or {fewer}, or use "
        f"nodes with a multiple of {group_size} {key}s each (a node type of them in the cluster config).")
    if not may_span:
        raise ValueError(message)
    logger.warning("%s (tensor_parallel_across_nodes=True: training anyway, groups across nodes)", message)


def _alive_labels() -> List[Dict[str, str]]:
    import ray  # late: loads Ray (0.5 s); planning.auto_devices imports the rules above without it

    return [dict(n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")]


def label_matches(selector: Dict[str, str], labels: Dict[str, str]) -> bool:
    """Whether a node's ``labels`` satisfy a Ray label ``selector`` (``"a"``, ``"!a"``, ``"in(a,b)"``, ``"!in(a,b)"``)."""
    for key, want in selector.items():
        negated = want.startswith("!")
        want = want[1:] if negated else want
        values = [v.strip() for v in want[3:-1].split(",")] if want.startswith("in(") and want.endswith(")") else [want]
        if (labels.get(key) in values) == negated:
            return False
    return True


def requested_keys(cfg) -> List[str]:
    """The resource names ``cfg`` asks each worker's node for, beside CPU and GPU."""
    keys = list(getattr(cfg, "resources_per_worker", None) or {})
    if getattr(cfg, "accelerator_type", None):
        keys.append(f"accelerator_type:{cfg.accelerator_type}")
    return keys


def only_nodes_with(capacity, keys: List[str]):
    """``capacity`` less the nodes and node types that lack one of ``keys`` (``strategy="auto"`` counts the devices
    the workers may use, not every device of the cluster)."""
    import dataclasses

    if not keys:
        return capacity
    has = lambda resources: all(resources.get(k, 0) > 0 for k in keys)  # noqa: E731
    return dataclasses.replace(capacity, alive=tuple(n for n in capacity.alive if has(n)),
                               node_types=tuple(t for t in capacity.node_types if has(t.resources)))
