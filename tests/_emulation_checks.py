"""What a run under GPU emulation must have recorded (tests/test_emulation.py, tests/test_gpu_report.py)."""

from __future__ import annotations

from collections import defaultdict


def check_devices(row: dict, workers: int, per_worker: int) -> None:
    """The recorded devices are Ray's GPU ids mapped through CUDA_VISIBLE_DEVICES, distinct per node."""
    assert row["backend"] == "nccl" and row["emulated"] is True
    assert len(row["devices_per_rank"]) == workers
    per_node = defaultdict(list)
    for rank in range(workers):
        gpu_ids = row["gpu_ids_per_rank"][rank]
        visible = row["cuda_visible_devices_per_rank"][rank].split(",")
        assert len(gpu_ids) == per_worker, (rank, gpu_ids)
        assert row["devices_per_rank"][rank] == [f"cuda:{visible.index(g)}" for g in gpu_ids]
        per_node[row["node_id_per_rank"][rank]].append(rank)
    for ranks in per_node.values():
        ids = [g for r in ranks for g in row["gpu_ids_per_rank"][r]]
        assert len(set(ids)) == len(ids), ids  # Ray never gives one GPU to two workers of a node
        cuda = [d for r in ranks for d in row["devices_per_rank"][r]]
        assert len(set(cuda)) == len(cuda), cuda
        # Ray Train shows every worker of a node all of that node's workers' GPUs
        assert {frozenset(row["cuda_visible_devices_per_rank"][r].split(",")) for r in ranks} == {frozenset(ids)}
