"""Partitioning: which models split, how blocks are balanced, and stage checkpoints' names."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from raytrain_mgpu.models.mlp import MLP
from raytrain_mgpu.models.transformer import TransformerLM
from raytrain_mgpu.models.partition import (balanced_split, blocks_of, build_stage_modules, param_costs,
                                              plan_partition, profile_costs)


class WithBlocks(nn.Module):
    """A model that is not an nn.Sequential but exposes its blocks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mid = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.out = nn.Linear(8, 2)

    def blocks(self):
        return [self.inp, *self.mid, self.out]

    def forward(self, x):
        for block in self.blocks():
            x = block(x)
        return x


class Tied(nn.Sequential):
    def __init__(self):
        embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        head.weight = embed.weight
        super().__init__(embed, head)


class OutsideParam(WithBlocks):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.b(self.a(x)) + x


def test_blocks_of_sequential_and_blocks_method():
    mlp = MLP(input_shape=(1, 4, 4), num_classes=3, widths=(8, 8))
    assert blocks_of(mlp) == list(mlp.children())  # Flatten, 2 Linear+ReLU, classifier
    assert len(blocks_of(WithBlocks())) == 5
    assert len(blocks_of(TransformerLM(seq_len=8, vocab_size=16, num_layers=3, hidden=8, num_heads=2))) == 5


@pytest.mark.parametrize("model,message", [
    (Opaque(), r"model Opaque cannot be split into stages: it is not an nn.Sequential and has no blocks\(\) method"),
    (Tied(), r"blocks 0 and 1 share a parameter \(tied weights"),
    (OutsideParam(), r"parameters \['scale'\] belong to no block"),
    (nn.Sequential(), "is empty"),
])
def test_models_that_cannot_be_split_say_why(model, message):
    with pytest.raises(ValueError, match=message):
        blocks_of(model)


def test_balanced_split_is_the_best_contiguous_split():
    costs_cases = [[1, 2, 3, 4, 5, 6], [5, 1, 1, 1, 1, 5], [1] * 7, [10, 1, 1, 1], [3, 3, 3, 9, 1, 1, 1]]
    for costs in costs_cases:
        for parts in range(1, len(costs) + 1):
            counts = balanced_split(costs, parts)
            assert sum(counts) == len(costs) and min(counts) >= 1 and len(counts) == parts
            best = min(_max_part(costs, cuts) for cuts in itertools.combinations(range(1, len(costs)), parts - 1))
            assert _max_part(costs, _cuts(counts)) == pytest.approx(best)


def _cuts(counts):
    return list(itertools.accumulate(counts))[:-1]


def _max_part(costs, cuts):
    bounds = [0, *cuts, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_plan_partition_by_params_time_and_list():
    blocks = [nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 100), nn.Linear(100, 10)]
    by_params = plan_partition(blocks, 2, "params")
    assert by_params.counts == (3, 1) and by_params.params == (1320, 1010)
    by_time = plan_partition(blocks, 2, "time", time_costs=lambda: [1.0, 1.0, 1.0, 3.0])
    assert by_time.counts == (3, 1) and by_time.costs == (3.0, 3.0)
    explicit = plan_partition(blocks, 2, (1, 3))
    assert explicit.counts == (1, 3) and explicit.bounds() == [(0, 1), (1, 4)]
    assert "stage 1: blocks 1-3 (3 blocks, 95.3% of parameters)" in explicit.describe()
    assert "50.0% of time" in by_time.describe()


def test_plan_partition_errors():
    blocks = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match=r"num_stages=4 is more than the 3 blocks.*at most 3"):
        plan_partition(blocks, 4, "params")
    with pytest.raises(ValueError, match=r"balance=\[2, 2\] must list 2 positive block counts.*summing to the "
                                         r"model's 3 blocks; it has 2 entries summing to 4"):
        plan_partition(blocks, 2, (2, 2))
    with pytest.raises(ValueError, match=r"balance=\[3\] must list 2"):
        plan_partition(blocks, 2, (3,))


def test_profile_costs_times_every_block():
    model = MLP(input_shape=(16,), num_classes=4, widths=(64, 512, 64))
    costs = profile_costs(blocks_of(model), torch.randn(32, 16), torch.device("cpu"), repeats=2)
    assert len(costs) == 5 and all(c > 0 for c in costs)
    assert costs[2] > costs[0]  # 64x512 matmuls cost more than a Flatten
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind


def test_params_on_the_meta_device():
    with torch.device("meta"):
        model = TransformerLM(seq_len=128, vocab_size=30522)
    costs = param_costs(blocks_of(model))
    assert len(costs) == 10 and sum(costs) == sum(p.numel() for p in model.parameters())


def test_stage_state_dicts_use_the_unsplit_names_and_compose_to_the_model():
    torch.manual_seed(0)
    model = TransformerLM(seq_len=8, vocab_size=16, num_layers=3, hidden=8, num_heads=2)
    partition = plan_partition(blocks_of(model), 3, "params")
    stages = build_stage_modules(model, partition)
    merged = {}
    for stage in stages:
        part = stage.model_state_dict()
        assert not set(part) & set(merged)
        merged.update(part)
    assert merged.keys() == model.state_dict().keys()
    x = torch.randint(0, 16, (2, 8))
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x))
