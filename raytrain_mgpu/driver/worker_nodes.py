"""Workers go where the user says: custom resources (``resources_per_worker``), a GPU type (``accelerator_type``)
and node labels (``label_selector``), checked against what the cluster has or can add before anything is asked of
Ray (``driver/cluster.check_placeable`` calls :func:`check_requested`): a request no node can ever satisfy would
otherwise leave a placement group pending for ever."""

from __future__ import annotations

from typing import Dict, List, Optional

__all__ = ["RAY_OWN_RESOURCES", "check_requested", "label_matches", "requested_keys", "only_nodes_with"]

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


def _alive_labels() -> List[Dict[str, str]]:
    import ray

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
