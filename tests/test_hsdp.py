"""HSDP: ``fsdp`` with ``shard_group_size`` shards inside groups of that many workers and replicates across the
groups (FSDP2 on a 2-D device mesh, replicate x shard), as the workers of one node form one group.

Four local processes (gloo, spawned: no Ray) shard an MLP as a Ray Train worker does (the engine's ``build_model``,
then the strategy's ``setup_model``) with ``shard_group_size=2``: every parameter is a DTensor on a 2 x 2 mesh,
replicated over its first dimension and sharded over the second, each rank holding half of it; three steps on
each rank's quarter of the global batch end with the weights one process trains on the whole batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn import functional as F

import _forkserver
from raytrain_mgpu.config.train import TrainConfig
from _reference import plain_weights
from raytrain_mgpu.engine.optim import build_optimizer

WORLD, SHARD, STEPS, BATCH = 4, 2, 3, 16
CFG = dict(model="mlp", model_kwargs={"widths": [16, 16]}, dataset="synthetic", input_shape=[8], num_classes=4,
           strategy="fsdp", num_workers=WORLD, shard_group_size=SHARD, batch_size=BATCH, optimizer="sgd", lr=0.1,
           momentum=0.9, seed=3)


def _batches() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator))
            for _ in range(STEPS)]


def _rank(rank: int, world: int, out: str, interleaved: bool = False) -> None:
    from raytrain_mgpu.parallel import build_worker
    from _reference import build_rank_model as _build_model
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    cfg = TrainConfig(**CFG)
    # two "nodes" of two workers: ranks 0, 1 on node 0 and 2, 3 on node 1 (interleaved: 0, 2 and 1, 3)
    node = rank % SHARD if interleaved else rank // SHARD
    ctx = WorkerContext(rank, world, rank % SHARD, SHARD, node, (torch.device("cpu"),))
    import logging

    handler = logging.FileHandler(os.path.join(out, f"log-{rank}.txt"))
    logging.getLogger("raytrain_mgpu.parallel.replication").addHandler(handler)
    strategy = build_worker(get_strategy("fsdp"), cfg.parallel, ctx)
    model = strategy.setup_model(_build_model(cfg, strategy, (8,), 4))
    weight = model[1][0].weight  # the first Linear
    facts = {"mesh": list(weight.device_mesh.mesh.shape), "dims": list(weight.device_mesh.mesh_dim_names),
             "placements": [str(p) for p in weight.placements], "local": list(weight.to_local().shape),
             "shard_group": weight.device_mesh["shard"].mesh.tolist()}
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    rows = BATCH // world
    for x, y in _batches():  # each rank its quarter of the global batch, as the DistributedSampler gives
        F.cross_entropy(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    full = strategy.replication.state_dict(strategy.unwrap(model))  # collective: the unsharded weights on rank 0
    if rank == 0:
        torch.save(full, os.path.join(out, "weights.pt"))
    with open(os.path.join(out, f"facts-{rank}.json"), "w") as f:
        json.dump(facts, f)


def test_hsdp_shards_inside_groups_replicates_across_them_and_trains_like_one_process(tmp_path):
    _forkserver.start_gloo_ranks(_rank, (str(tmp_path),), nprocs=WORLD)
    assert not any((tmp_path / f"log-{rank}.txt").read_text() for rank in range(WORLD))  # one node a group: no warning
    facts = [json.loads((tmp_path / f"facts-{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, fact in enumerate(facts):
        assert fact["mesh"] == [WORLD // SHARD, SHARD] and fact["dims"] == ["replicate", "shard"], fact
        assert fact["placements"] == ["R", "S(0)"], fact  # Replicate() over the groups, Shard(0) within
        assert fact["local"] == [16 // SHARD, 8], fact  # half of the (16, 8) weight: sharded over 2, not 4
        assert fact["shard_group"] == [SHARD * (rank // SHARD) + i for i in range(SHARD)], fact  # its node's ranks
    cfg = TrainConfig(**{**CFG, "strategy": "ddp", "num_workers": 1, "shard_group_size": None})
    reference = plain_weights(cfg, _batches(), (8,), 4)
    trained = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert trained.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("size, error", [
    (3, "shard_group_size=3: must divide num_workers=4"),
    (0, "shard_group_size=0: must be a positive integer or None"),
])
def test_a_shard_group_size_that_does_not_divide_the_workers_is_refused(size, error):
    with pytest.raises(ValueError, match=error):
        TrainConfig(**{**CFG, "shard_group_size": size})


def test_an_elastic_worker_range_is_refused():
    with pytest.raises(ValueError, match=r"shard_group_size=2: needs a fixed number of workers, not the range "
                                         r"num_workers=\[2, 4\]"):
        TrainConfig(**{**CFG, "num_workers": (2, 4)})


def test_shard_groups_that_span_nodes_are_named():
    """The worker warns (rank 0, at set-up) about groups whose ranks are on several nodes."""
    from raytrain_mgpu.parallel.replication import shard_groups_across_nodes

    assert shard_groups_across_nodes([0, 0, 1, 1], 2) == []  # each node's pair: one group each
    assert shard_groups_across_nodes([0, 1, 0, 1], 2) == [[0, 1], [2, 3]]  # interleaved: both span
    assert shard_groups_across_nodes([0, 0, 0, 1, 1, 1], 2) == [[2, 3]]  # 3 workers a node, groups of 2


def test_shard_groups_that_span_nodes_are_warned_about_naming_the_fix(tmp_path):
    """Ranks 0, 2 on one node and 1, 3 on the other: both shard groups (0, 1) and (2, 3) span the nodes, so every
    all-gather crosses the network; rank 0 says so once, with the fix."""
    _forkserver.start_gloo_ranks(_rank, (str(tmp_path), True), nprocs=WORLD)
    logs = [(tmp_path / f"log-{rank}.txt").read_text() for rank in range(WORLD)]
    assert "shard_group_size=2: the shard groups [[0, 1], [2, 3]] span nodes [[0, 1], [0, 1]]" in logs[0]
    assert "Set shard_group_size to the workers of one node" in logs[0]
    assert logs[1:] == ["", "", ""]
