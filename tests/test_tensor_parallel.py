"""Tensor parallel (``tensor_parallel_size``): each layer split over a group of workers on a 2-D mesh (data parallel x
tensor), FSDP2 sharding or replicating over the groups.

Local gloo ranks (tests/_forkserver.py, no Ray) run the engine a Ray Train worker runs (tests/_engine.py): every
parameter is a DTensor on the ``tensor`` sub-mesh, split as the plan says; the ranks of a tensor group read the same
batch and count it once; two epochs end with the weights one process trains (the in-process runner,
tests/_reference.py), within 1e-4 (as plain FSDP's would: the placements tell that the plan was applied, here and
through Ray Train); ``TrainResult.load_model()`` consolidates the sharded checkpoint into the plain
module; a checkpoint of tensor groups resumes at another shape (the next attempt trains epoch 2 only) and ends with
the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import _forkserver
import raytrain_mgpu as rtm

LM = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[8], num_classes=24, num_samples=96,
          model_kwargs={"num_layers": 2, "hidden": 16, "num_heads": 4}, batch_size=8, epochs=2, optimizer="sgd",
          lr=0.1, momentum=0.9, seed=3, strategy="fsdp", use_gpu=False)


def _engine_rank(rank: int, world: int, fields: dict, out: str) -> None:
    """Rank ``rank``'s engine of ``fields`` over ``world`` ranks, run to its end; what it sees recorded in ``out``."""
    from _engine import make_engine

    engine = make_engine(fields, rank=rank, world=world, setup=False)
    engine.run()
    model = engine.steps.named_model()
    q = dict(model.named_parameters())["1.attn.q.weight"]
    proj = dict(model.named_parameters())["1.attn.proj.weight"]
    facts = {"shard": list(engine.steps.shard), "mesh": list(q.device_mesh.mesh.shape),
             "dims": list(q.device_mesh.mesh_dim_names or ()), "q": [str(p) for p in q.placements],
             "proj": [str(p) for p in proj.placements], "q_local": list(q.to_local().shape)}
    with open(os.path.join(out, f"facts-{rank}.json"), "w") as f:
        json.dump(facts, f)


def _run(fields: dict, world: int, storage: str, name: str) -> list:
    """``fields`` trained over ``world`` local ranks into ``storage/name``; every rank's facts."""
    fields = {**fields, "storage_path": storage, "name": name}
    _forkserver.start_gloo_ranks(_engine_rank, (fields, storage), nprocs=world)
    return [json.loads(open(os.path.join(storage, f"facts-{rank}.json")).read()) for rank in range(world)]


def _result(fields: dict, storage: str, name: str) -> "rtm.TrainResult":
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    folder = RunFolder(os.path.join(storage, name))
    cfg = rtm.TrainConfig(**{**fields, "storage_path": storage, "name": name})
    return rtm.TrainResult(cfg, folder.state().history, folder.newest_checkpoint().uri, folder.uri)


def _one_process(fields: dict, epochs=None) -> tuple:
    from _reference import train_one_worker

    plain = {k: v for k, v in fields.items() if not k.startswith("tensor_parallel")}
    weights, _, _, history = train_one_worker({**plain, "strategy": "ddp"}, epochs=epochs)
    return weights, history


def _assert_close(trained: dict, reference: dict, rtol: float = 1e-4) -> None:
    assert trained.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(trained[key], value, rtol=rtol, atol=rtol * value.abs().max().item(), msg=key)


def _layouts(model: torch.nn.Module) -> dict:
    """Each parameter's ``[mesh dimension names, placements, local shape]`` by name."""
    from _probe_data import param_layout

    return {name: param_layout(p) for name, p in model.named_parameters()}


def _assert_split(layouts: dict, planned: dict) -> None:
    """Each parameter of ``planned`` (name: its placement over ``tensor``, its local shape) is a DTensor split over the
    mesh's ``tensor`` dimension as the plan says. Plain FSDP over the same ranks ends with the same weights: only
    this tells that the plan was applied."""
    for name, (placement, local) in planned.items():
        dims, placements, shape = layouts[name]
        assert dims[-1:] == ["tensor"] and placements[-1:] == [placement] and shape == local, (name, layouts[name])


def test_tensor_parallel_2_on_2_ranks_ends_with_one_workers_weights_and_loads_as_a_plain_module(tmp_path):
    fields = {**LM, "tensor_parallel_size": 2}
    facts = _run(fields, 2, str(tmp_path), "tp2")
    for fact in facts:
        assert fact["shard"] == [0, 1], fact  # one tensor group: both ranks read the one replica's batches
        assert fact["mesh"] == [1, 2] and fact["dims"] == ["data", "tensor"], fact
        # over "data" FSDP's shard of the whole (one group: all of it), over "tensor" column- and row-wise halves
        assert fact["q"][-1] == "S(0)" and fact["proj"][-1] == "S(1)", fact
        assert fact["q_local"] == [8, 16], fact  # half of q's (16, 16): this rank's 2 of the 4 heads
    result = _result(fields, str(tmp_path), "tp2")
    model = result.load_model()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # a plain module, no DTensor
    weights, history = _one_process(fields)
    _assert_close(model.state_dict(), weights)
    for ours, theirs in zip(result.history, history):  # a group's batch counted once: the same samples and loss
        tokens = LM["num_samples"] // LM["batch_size"] * LM["batch_size"] * LM["input_shape"][0]  # an epoch's targets
        assert ours["samples_per_s"] * ours["training_s"] == pytest.approx(tokens), ours
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
        assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-5)


def test_fsdp_2_by_tensor_parallel_2_on_4_ranks_ends_with_one_workers_weights(tmp_path):
    fields = {**LM, "tensor_parallel_size": 2, "epochs": 1}
    facts = _run(fields, 4, str(tmp_path), "fsdp2xtp2")
    for rank, fact in enumerate(facts):
        assert fact["shard"] == [rank // 2, 2], fact  # ranks 0, 1 read replica 0's batches, ranks 2, 3 replica 1's
        assert fact["mesh"] == [2, 2] and fact["q"][-1] == "S(0)", fact
        assert fact["q_local"] == [4, 16], fact  # q's (16, 16): half its heads (tensor), half of those (FSDP)
    weights, _ = _one_process(fields)
    _assert_close(_result(fields, str(tmp_path), "fsdp2xtp2").load_model().state_dict(), weights)


def test_ddp_over_2_tensor_groups_on_4_ranks_ends_with_one_workers_weights(tmp_path):
    fields = {**LM, "tensor_parallel_size": 2, "epochs": 1, "strategy": "ddp"}
    facts = _run(fields, 4, str(tmp_path), "ddp2xtp2")
    for rank, fact in enumerate(facts):
        assert fact["shard"] == [rank // 2, 2], fact
        assert fact["q"] == ["R", "S(0)"] and fact["q_local"] == [8, 16], fact  # replicated over data, split over tensor
    weights, _ = _one_process(fields)
    _assert_close(_result(fields, str(tmp_path), "ddp2xtp2").load_model().state_dict(), weights)


@pytest.mark.parametrize("world, tensor_parallel", [(1, 1), (2, 1)], ids=["one-worker", "fsdp-2"])
def test_a_tensor_parallel_checkpoint_resumes_at_another_shape_with_the_uninterrupted_runs_weights(
        tmp_path, world, tensor_parallel):
    first = {**LM, "tensor_parallel_size": 2, "epochs": 1}
    _run(first, 2, str(tmp_path), "resumed")  # epoch 1 in one tensor group of 2
    rest = {**LM, "tensor_parallel_size": tensor_parallel}
    _run(rest, world, str(tmp_path), "resumed")  # epoch 2 from its sharded checkpoint, resharded
    result = _result(rest, str(tmp_path), "resumed")
    assert [row["epoch"] for row in result.history] == [1, 2]
    # epoch 2 by the resumed attempt, from step 12: a run that retrained from scratch writes attempt 0 twice
    assert [(row["attempt"], row["step"]) for row in result.history] == [(0, 12), (1, 24)], result.history
    weights, _ = _one_process(LM)
    _assert_close(result.load_model().state_dict(), weights)


def test_a_sharded_checkpoint_resumed_by_a_layout_that_reads_whole_state_is_refused_naming_the_fix(tmp_path):
    """ddp with tensor groups writes every rank's shards; the same run resumed with tensor_parallel_size=1 (plain
    ddp, which reads the whole state) is refused with the two ways out, not a bare NotImplementedError."""
    import contextlib

    from raytrain_mgpu.checkpointing import files as ckpt_format
    from raytrain_mgpu.checkpointing.store import CheckpointSource
    from raytrain_mgpu.checkpointing.contents import read
    from raytrain_mgpu.engine.run_state import RunState, checkpoint_meta

    written = rtm.TrainConfig(**{**LM, "strategy": "ddp", "tensor_parallel_size": 2})
    folder = tmp_path / "checkpoint_epoch000001"
    (folder / ckpt_format.SHARDED_DIR).mkdir(parents=True)
    ckpt_format.write_checkpoint(str(folder), meta=checkpoint_meta(written, RunState(epoch=1), {}), history=[])
    resumed = rtm.TrainConfig(**{**LM, "strategy": "ddp", "tensor_parallel_size": 1})
    source = CheckpointSource(str(folder), lambda: contextlib.nullcontext(str(folder)))
    whole = SimpleNamespace(sharded=False, build_on_meta=lambda: False, part=None)  # plain ddp's step runner
    with pytest.raises(ValueError, match=r"holds every rank's shards \(strategy='ddp' with tensor_parallel_size=2\), "
                                         r"which this run's layout \(tensor_parallel_size=1\) saves and reads whole. "
                                         r"Resume with tensor_parallel_size=2, or start a new run \(another `name`\) "
                                         r"from its weights: init_from="):
        read(resumed, source, whole, 0)


def _user_plan_rank(rank: int, world: int, out: str) -> None:
    from torch.nn import functional as F

    from raytrain_mgpu.models import build_model
    from raytrain_mgpu.engine.objectives import Objective
    from raytrain_mgpu.engine.optim import build_optimizer
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    cfg = rtm.TrainConfig(**MLP_PLAN)
    ctx = WorkerContext(rank, world, rank, world, 0, (torch.device("cpu"),))
    strategy = build_worker(get_strategy("fsdp"), cfg.parallel, ctx, Objective())
    torch.manual_seed(cfg.seed)
    model = strategy.setup_model(build_model(cfg.model, (8,), 4, cfg.model_kwargs))
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    for x, y in _mlp_batches():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    full = strategy.replication.state_dict(strategy.unwrap(model))  # collective
    with open(os.path.join(out, f"layouts-{rank}.json"), "w") as f:
        json.dump(_layouts(model), f)
    if rank == 0:
        torch.save(full, os.path.join(out, "weights.pt"))


MLP_PLAN = dict(model="mlp", model_kwargs={"widths": [16, 16]}, dataset="synthetic", input_shape=[8], num_classes=4,
                strategy="fsdp", num_workers=2, use_gpu=False, tensor_parallel_size=2, batch_size=16, optimizer="sgd",
                lr=0.1, tensor_parallel_plan={"1.0": "colwise", "2.0": "rowwise", "3": "colwise_gather_output"})


def _mlp_batches() -> list:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator))
            for _ in range(3)]


def test_a_users_plan_splits_a_model_that_has_none_and_trains_like_one_process(tmp_path):
    from _reference import plain_weights

    _forkserver.start_gloo_ranks(_user_plan_rank, (str(tmp_path),), nprocs=2)
    for rank in range(2):  # colwise halves a weight's output rows (S(0)), rowwise its input columns (S(1))
        _assert_split(json.loads((tmp_path / f"layouts-{rank}.json").read_text()),
                      {"1.0.weight": ("S(0)", [8, 8]), "2.0.weight": ("S(1)", [16, 8]), "3.weight": ("S(0)", [2, 16])})
    cfg = rtm.TrainConfig(**{**MLP_PLAN, "tensor_parallel_size": 1, "tensor_parallel_plan": None})
    _assert_close(torch.load(tmp_path / "weights.pt", weights_only=True), plain_weights(cfg, _mlp_batches(), (8,), 4),
                  rtol=1e-5)


# ----------------------------------------------------------------------------- a Hugging Face model's own plan


class TinyLlama(torch.nn.Module):
    """``LlamaForCausalLM`` at test size from its config (no download), logits as the package's LM gives them:
    ``(batch, vocab, seq)``. Its own tensor-parallel plan (``_tp_plan``) is found inside the wrapper."""

    def __init__(self, seq_len: int, vocab: int):
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len)
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, ids):
        return self.lm(input_ids=ids).logits.transpose(1, 2)


def tiny_llama(input_shape, num_classes):
    return TinyLlama(input_shape[0], num_classes)


def test_a_hugging_face_causal_lm_trains_with_its_own_plan_on_2_ranks_like_one_process(tmp_path):
    from _extras import require

    require("transformers")  # skipped where it is missing; on CI, a failure
    fields = {**LM, "model": "test_tensor_parallel:tiny_llama", "model_kwargs": {}, "tensor_parallel_size": 2,
              "epochs": 1}
    from raytrain_mgpu.models import build_model_shapes
    from raytrain_mgpu.parallel.tensor_parallel import model_plan

    source, names, _ = model_plan(build_model_shapes(fields["model"], (8,), 24, {}), None)
    assert source == "LlamaForCausalLM._tp_plan" and names["lm.model.layers.*.self_attn.q_proj"] == "colwise"
    _run_hf(fields, str(tmp_path))
    for rank in range(2):  # Llama's plan: q_proj colwise (its output rows halved), o_proj rowwise (input columns)
        _assert_split(json.loads((tmp_path / f"layouts-{rank}.json").read_text()),
                      {"lm.model.layers.0.self_attn.q_proj.weight": ("S(0)", [8, 16]),
                       "lm.model.layers.1.self_attn.o_proj.weight": ("S(1)", [16, 8])})
    weights, _ = _one_process(fields)
    _assert_close(_result(fields, str(tmp_path), "llama").load_model().state_dict(), weights)


def _hf_rank(rank: int, world: int, fields: dict, out: str) -> None:
    from _engine import make_engine

    engine = make_engine(fields, rank=rank, world=world, setup=False)
    engine.run()
    with open(os.path.join(out, f"layouts-{rank}.json"), "w") as f:
        json.dump(_layouts(engine.steps.named_model()), f)


def _run_hf(fields: dict, storage: str) -> None:
    _forkserver.start_gloo_ranks(_hf_rank, ({**fields, "storage_path": storage, "name": "llama"}, storage), nprocs=2)


# ----------------------------------------------------------------------------- refused before Ray


@pytest.mark.parametrize("change, error", [
    ({"num_workers": 3}, r"tensor_parallel_size=2: must divide num_workers=3"),
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0: must be a positive integer"),
    ({"num_workers": (2, 4)}, r"tensor_parallel_size=2: needs a fixed number of workers, not the range "
                              r"num_workers=\[2, 4\]"),
    ({"shard_group_size": 2}, r"shard_group_size=2 with tensor_parallel_size=2: HSDP and tensor parallel together "
                              r"need a 3-D mesh"),
    ({"use_gpu": True, "precision": "16-mixed", "strategy": "ddp"},
     r"precision='16-mixed' with tensor_parallel_size=2: the GradScaler's overflow check"),
    ({"dataset": "parquet", "data_root": "/tmp/none.parquet", "ingest": "ray_data"},
     r"ingest='ray_data' with tensor_parallel_size=2: the workers of a tensor group must read the same batches"),
    ({"tensor_parallel_plan": {"1.0": "columns"}}, r"tensor_parallel_plan=\{'1.0': 'columns'\}: must map module paths "
                                                   r"to styles, one of \['colwise', 'rowwise'"),
])
def test_a_config_tensor_parallel_cannot_run_is_refused_naming_the_fix(change, error):
    with pytest.raises(ValueError, match=error):
        rtm.TrainConfig(**{**LM, "num_workers": 2, "tensor_parallel_size": 2, **change})


def test_a_strategy_without_tensor_parallel_warns_that_the_option_has_no_effect():
    with pytest.warns(UserWarning, match=r"tensor_parallel_size=2 has no effect with strategy='dp'; it is read by "
                                         r"ddp, fsdp"):
        rtm.TrainConfig(strategy="dp", num_workers=1, tensor_parallel_size=2)


@pytest.mark.parametrize("change, error", [
    ({"model": "mlp", "model_kwargs": {"widths": [16]}, "dataset": "synthetic", "num_classes": 4},
     r"model MLP has no tensor-parallel plan \(neither transformer_lm nor a Hugging Face model with a _tp_plan\). "
     r"Add TrainConfig.tensor_parallel_plan"),
    ({"model_kwargs": {"num_layers": 2, "hidden": 18, "num_heads": 3}},
     r"transformer_lm's plan: Block.num_heads=3 heads do not split over tensor_parallel_size=2 \(each rank computes "
     r"whole heads\)"),
    ({"model": "mlp", "model_kwargs": {"widths": [15]}, "dataset": "synthetic", "num_classes": 4,
      "tensor_parallel_plan": {"1.0": "colwise"}},
     r"tensor_parallel_plan: 1.0 has out_features=15, which tensor_parallel_size=2 does not divide"),
    ({"input_shape": [9]}, r"the sequence length 9 does not split over tensor_parallel_size=2"),
    ({"tensor_parallel_plan": {"1.attn.query": "colwise"}},
     r"tensor_parallel_plan: path '1.attn.query' names no module of TransformerLM"),
])
def test_a_model_tensor_parallel_cannot_split_is_refused_before_ray(monkeypatch, change, error):
    from raytrain_mgpu import api

    # fit's connect, not ray.init: connect skips ray.init where this process's shared Ray is already up
    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("fit connected to Ray before the check"))
    cfg = rtm.TrainConfig(**{**LM, "num_workers": 2, "tensor_parallel_size": 2, "runner": "ray", **change})
    with pytest.raises(ValueError, match=error):
        rtm.fit(cfg)


def test_a_plan_that_leaves_attention_whole_is_not_held_to_the_head_count():
    """3 heads do not split over 2 ranks, but a user's plan that splits only the MLPs does not split them."""
    from raytrain_mgpu.parallel.tensor_parallel import check_model_plan

    fields = {**LM, "model_kwargs": {"num_layers": 2, "hidden": 18, "num_heads": 3}, "num_workers": 2,
              "tensor_parallel_size": 2}
    mlp_only = rtm.TrainConfig(**fields, tensor_parallel_plan={"*.mlp.0": "colwise", "*.mlp.2": "rowwise"})
    check_model_plan(mlp_only, (8,), 24)  # accepted
    with_attention = rtm.TrainConfig(**fields, tensor_parallel_plan={"*.mlp.0": "colwise", "*.attn.q": "colwise"})
    with pytest.raises(ValueError, match=r"tensor_parallel_plan: (Block|Attention).num_heads=3 heads do not split"):
        check_model_plan(with_attention, (8,), 24)


GPU_NODE = {"CPU": 8.0, "GPU": 1.0}


def _capacity(alive, node_types=(), unknown=""):
    from raytrain_mgpu.driver.cluster import Capacity, NodeType

    return Capacity(tuple(alive), tuple(NodeType(*t) for t in node_types), node_types_unknown=unknown)


def test_tensor_groups_no_node_can_hold_are_refused_naming_the_nodes_sizes_and_the_fix(caplog):
    """Known capacity, no Ray: a group of T workers needs a node with T of their GPUs, and all the groups need nodes
    that hold them whole; an autoscaler's node types count, and unknown node types leave it to the workers' check."""
    from raytrain_mgpu.driver.cluster import check_placeable

    def check(num_workers, group, capacity):
        check_placeable([{"CPU": 1, "GPU": 1}] * num_workers, True, "strategy='fsdp'", capacity, group_size=group)

    ones = _capacity([GPU_NODE, GPU_NODE])
    check(2, 1, ones)  # no tensor parallel: one GPU a node places 2 workers
    with pytest.raises(ValueError, match=r"strategy='fsdp': TrainConfig.tensor_parallel_size=2: a tensor group's 2 "
                                         r"workers must share a node .* hold at most 1 worker\(s\) of \{'CPU': 1, "
                                         r"'GPU': 1\} \(2 node\(s\) 1 each: node 0: 8 CPU, 1 GPU; node 1: 8 CPU, 1 GPU"
                                         r"\), .* Set tensor_parallel_size=1 or fewer workers, or use nodes with a "
                                         r"multiple of 2 GPUs"):
        check(2, 2, ones)
    threes = [{"CPU": 8.0, "GPU": 3.0}] * 2  # 6 GPUs, but whole groups of 2 take only 4 of them
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .* at most 3 worker\(s\) .* \(2 node\(s\) 3 each"
                                         r".* no placement keeps 6 workers in whole groups of 2\. Set tensor_parallel_size=1 or "
                                         r"num_workers=4"):
        check(6, 2, _capacity(threes))
    with caplog.at_level("WARNING", logger="raytrain_mgpu.driver.worker_nodes"):
        check(6, 2, _capacity(threes + threes[:1]))  # 3 nodes: a placement exists, but Ray may split a group
    assert "some nodes hold [3] worker(s)" in caplog.text
    autoscaling = [{"CPU": 4.0}]  # the head, no GPU node up
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: .* at most 1 worker.*\(8 node\(s\) 1 each: node types "
                                         r"gpu1: 8 CPU, 1 GPU, up to 8.* Set tensor_parallel_size=1"):
        check(4, 4, _capacity(autoscaling, [("gpu1", GPU_NODE, 8)]))
    check(4, 4, _capacity(autoscaling, [("gpu1", GPU_NODE, 8), ("gpu4", {"CPU": 32.0, "GPU": 4.0}, 1)]))
    check(2, 2, _capacity([GPU_NODE, GPU_NODE, GPU_NODE], unknown="no monitor here"))  # the workers will tell
    caplog.clear()
    with caplog.at_level("WARNING", logger="raytrain_mgpu.driver.worker_nodes"):  # the user forces it: warned
        check_placeable([{"CPU": 1, "GPU": 1}] * 2, True, "strategy='fsdp'", ones, group_size=2, groups_may_span=True)
    assert "must share a node" in caplog.text and "tensor_parallel_across_nodes=True: training anyway" in caplog.text


def _spanning_rank(rank: int, world: int, across: bool, out: str) -> None:
    """Rank ``rank`` of a tensor group of 2 whose ranks sit on two nodes; what its set-up did, in ``out``."""
    import logging

    from _reference import build_rank_model
    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    cfg = TrainConfig(**{**LM, "num_workers": 2, "tensor_parallel_size": 2, "tensor_parallel_across_nodes": across})
    ctx = WorkerContext(rank, world, 0, 1, rank, (torch.device("cpu"),))  # node rank = rank: one worker a node
    logging.getLogger("raytrain_mgpu.parallel.tensor_parallel").addHandler(
        logging.FileHandler(os.path.join(out, f"log-{rank}.txt")))
    strategy = build_worker(get_strategy("fsdp"), cfg.parallel, ctx)
    try:
        strategy.setup_model(build_rank_model(cfg, strategy, (8,), 24))
        outcome = "trained"
    except ValueError as exc:
        outcome = str(exc)
    with open(os.path.join(out, f"outcome-{rank}.txt"), "w") as f:
        f.write(outcome)


@pytest.mark.parametrize("across", [False, True])
def test_a_tensor_group_across_nodes_is_refused_at_set_up_or_warned_where_forced(tmp_path, across):
    _forkserver.start_gloo_ranks(_spanning_rank, (across, str(tmp_path)), nprocs=2)
    outcomes = [(tmp_path / f"outcome-{rank}.txt").read_text() for rank in range(2)]
    if not across:  # every rank refuses alike, naming the groups, their nodes and the fix
        assert all(o.startswith("TrainConfig.tensor_parallel_size=2: the tensor groups [[0, 1]] span nodes [[0, 1]]")
                   and "Give every node a multiple of 2 workers" in o for o in outcomes), outcomes
        return
    assert outcomes == ["trained", "trained"]
    assert "tensor_parallel_across_nodes=True: training anyway" in (tmp_path / "log-0.txt").read_text()


def test_fit_refuses_tensor_groups_that_would_span_nodes_before_ray_train_asks_for_workers(monkeypatch, tmp_path):
    from raytrain_mgpu import api
    from raytrain_mgpu.driver import cluster

    monkeypatch.setattr(api, "connect", lambda *a, **k: False)  # "connected" to the cluster read_capacity fakes
    monkeypatch.setattr(cluster, "read_capacity", lambda: _capacity([{"CPU": 2.0}, GPU_NODE, GPU_NODE]))
    monkeypatch.setattr(api, "carrier", lambda *a: pytest.fail("the run started"))
    cfg = rtm.TrainConfig(**{**LM, "num_workers": 2, "tensor_parallel_size": 2, "use_gpu": True,
                             "storage_path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"strategy='fsdp': TrainConfig.tensor_parallel_size=2: .* at most 1 worker"
                                         r".*Set tensor_parallel_size=1"):
        rtm.fit(cfg)


def test_the_cli_takes_the_tensor_parallel_size_and_a_plan_and_refuses_a_bad_size(capsys):
    from raytrain_mgpu.cli import _build_parser, config_from_args, main

    args = _build_parser().parse_args(["train", "--strategy", "fsdp", "--num-workers", "4", "--tensor-parallel-size",
                                       "2", "--tensor-parallel-plan", "{'1.0': colwise, '2.0': rowwise}"])
    cfg = config_from_args(args)
    assert cfg.tensor_parallel_size == 2 and cfg.tensor_parallel_plan == {"1.0": "colwise", "2.0": "rowwise"}
    assert cfg.parallel.tensor_parallel_size == 2  # the section the worker receives
    assert main(["train", "--strategy", "fsdp", "--num-workers", "3", "--tensor-parallel-size", "2"]) == 2
    assert "TrainConfig.tensor_parallel_size=2: must divide num_workers=3" in capsys.readouterr().err


# ----------------------------------------------------------------------------- planning: the estimate and auto


def test_the_memory_estimate_splits_each_layer_over_the_tensor_group():
    from raytrain_mgpu.planning.memory import ModelProfile, device_memory

    # three blocks of 100, 400 and 100 parameter bytes; AdamW: state = 4 x parameters
    profile = ModelProfile((100, 400, 100), (10.0, 20.0, 10.0), 5.0, 1.0, 2.0, True)
    fields = {**LM, "num_workers": 4, "batch_size": 8}
    fsdp = device_memory("fsdp", rtm.TrainConfig(**fields), profile)
    tp = device_memory("fsdp", rtm.TrainConfig(**fields, tensor_parallel_size=2), profile)
    ddp_tp = device_memory("ddp", rtm.TrainConfig(**{**fields, "strategy": "ddp"}, tensor_parallel_size=2), profile)
    assert len(tp) == len(ddp_tp) == 4
    assert fsdp[0].fixed == 2400 / 4 + 2 * 400  # a quarter of the state, the largest block gathered whole
    assert tp[0].fixed == 2400 / 4 + 2 * 400 / 2  # a quarter of the state, the largest block's half gathered
    assert ddp_tp[0].fixed == 2400 / 2  # half of every layer, replicated over the 2 groups
    # per sample: each group takes half the batch, each rank a half of its activations; inputs and outputs whole
    assert tp[0].per_sample == ddp_tp[0].per_sample == 40 / 2 / 2 + (1 + 5) / 2


def test_auto_chooses_tensor_groups_when_a_layer_does_not_fit_even_sharded(tmp_path):
    from raytrain_mgpu.planning.auto import ClusterInfo, choose_strategy, resolve_auto
    from raytrain_mgpu.planning.memory import device_memory, profile_config

    cfg = rtm.TrainConfig(**{**LM, "strategy": "auto", "storage_path": str(tmp_path), "optimizer": "adamw",
                             "input_shape": [8], "num_classes": 4096, "batch_size": 8,
                             "model_kwargs": {"num_layers": 2, "hidden": 256, "num_heads": 4}})
    info = ClusterInfo((4,), True, 2**30)
    profile = profile_config(cfg)
    fsdp = max(d.at(8) for d in device_memory("fsdp", cfg.replace(strategy="fsdp", num_workers=4), profile))
    split = max(d.at(8) for d in device_memory(
        "fsdp", cfg.replace(strategy="fsdp", num_workers=4, tensor_parallel_size=2), profile))
    assert split < fsdp  # the vocabulary projection, the largest block, gathered by halves
    budget = (split + fsdp) // 2
    name, reason, _ = choose_strategy(cfg, info, budget, profile)
    assert name == "fsdp" and reason.startswith("fsdp, tensor_parallel_size=2: ddp would need"), reason
    resolved, record = resolve_auto(cfg.replace(memory_budget_bytes=budget), info)
    assert (resolved.strategy, resolved.num_workers, resolved.tensor_parallel_size) == ("fsdp", 4, 2)
    timed = []  # auto_measure times fsdp too: it fits with tensor groups, although not without

    def compare(cfg, strategies, **run):
        from raytrain_mgpu.planning.compare_report import Recommendation

        timed.extend(strategies)
        return SimpleNamespace(recommendation=Recommendation(None, None, "nothing measured here"), paths={})

    resolved, record = resolve_auto(cfg.replace(memory_budget_bytes=budget, auto_measure=True), info, compare=compare)
    assert "fsdp" in timed and resolved.tensor_parallel_size == 2, (timed, record)


def test_transformer_lm_weights_saved_with_the_fused_qkv_layout_still_load_and_compute_the_same():
    """Before tensor parallel, a block's attention was one fused ``qkv`` Linear and ``proj`` in the block: weights a
    user saved then load into the separate ``attn.q/k/v/proj`` and give the same logits."""
    from raytrain_mgpu.models import build_model

    kwargs = {"num_layers": 2, "hidden": 16, "num_heads": 4, "ffn_hidden": 32}
    torch.manual_seed(0)
    model = build_model("transformer_lm", (8,), 50, kwargs).eval()
    old = {}
    for key, value in model.state_dict().items():  # the same weights, written as the fused layout named them
        if ".attn.q." in key:
            kind = key.rsplit(".", 1)[1]
            block = key.split(".attn.")[0]
            old[f"{block}.qkv.{kind}"] = torch.cat([model.state_dict()[f"{block}.attn.{n}.{kind}"] for n in "qkv"])
        elif ".attn.proj." in key:
            old[key.replace(".attn.proj.", ".proj.")] = value
        elif ".attn." not in key:
            old[key] = value
    assert any(".qkv." in key for key in old) and not any(".attn." in key for key in old)
    fresh = build_model("transformer_lm", (8,), 50, kwargs).eval()
    fresh.load_state_dict(old)  # strict: every key maps
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(fresh(ids), model(ids), rtol=0, atol=0)


def test_a_ray_train_fit_with_tensor_groups_on_emulated_gpus_ends_with_one_workers_weights(ray_session, storage,
                                                                                          tmp_path):
    """Through Ray Train, as a user runs it: 2 workers on the shared instance's emulated GPUs (one each, NCCL's
    semantics on gloo), one tensor group of 2 whose workers hold the plan's halves of each layer (recorded by a user's
    optimizer factory, tests/_probe_data.mesh_sgd); ``fit`` returns a plain module with one process's weights."""
    from raytrain_mgpu.models import build_model

    fields = {**LM, "tensor_parallel_size": 2, "num_workers": 2, "use_gpu": True, "epochs": 1}
    probe = {"optimizer": "_probe_data:mesh_sgd", "optimizer_kwargs": {"probe": str(tmp_path), "momentum": 0.9}}
    result = rtm.fit(rtm.TrainConfig(**{**fields, **probe}, storage_path=storage, name="tp-ray"))
    names = [name for name, _ in build_model("transformer_lm", (8,), 24, LM["model_kwargs"]).named_parameters()]
    facts = [json.loads(path.read_text()) for path in tmp_path.glob("mesh-*.json")]
    assert sorted(fact["world_rank"] for fact in facts) == [0, 1], facts
    for fact in facts:
        assert len(fact["params"]) == len(names), fact
        _assert_split(dict(zip(names, fact["params"])),
                      {"1.attn.q.weight": ("S(0)", [8, 16]), "1.attn.proj.weight": ("S(1)", [16, 8])})
    row = result.history[-1]
    assert [r["epoch"] for r in result.history] == [1]
    assert row["backend"] == "nccl" and len(row["gpu_ids_per_rank"]) == 2, row  # NCCL recorded, one GPU a rank
    assert len({tuple(ids) for ids in row["gpu_ids_per_rank"]}) == 2, row  # two distinct GPUs
    model = result.load_model()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    weights, _ = _one_process(fields, epochs=1)
    _assert_close(model.state_dict(), weights)


def test_gradient_clipping_with_tensor_groups_clips_by_the_whole_models_norm(tmp_path):
    """``grad_clip_norm`` sees every parameter's gradient, whether the plan split it (a DTensor on the 2-D mesh) or
    left it whole (``transformer_lm``'s position embedding: FSDP's shard over ``data`` alone): the same clipped steps
    as one process."""
    fields = {**LM, "tensor_parallel_size": 2, "grad_clip_norm": 0.05, "epochs": 1}
    _run(fields, 2, str(tmp_path), "clip")
    model = _result(fields, str(tmp_path), "clip").load_model()
    weights, _ = _one_process(fields)
    unclipped, _ = _one_process({**fields, "grad_clip_norm": None})
    assert any((weights[k] - unclipped[k]).abs().max() > 1e-3 for k in weights)  # the clip bit
    _assert_close(model.state_dict(), weights)
