"""Your own training step, parameter groups, and fine-tuning in and out.

- a custom step (an auxiliary loss on an intermediate output and a logged extra scalar) on ``ddp`` over 2 ranks
  ends with the weights of the same step in one process on the whole batch, and its extra is in the history;
- a frozen backbone: only the head changes, ``save="trainable"`` checkpoints hold the trainable part, and a
  resume from one ends exactly like the uninterrupted run;
- ``init_from`` an exported ``.safetensors`` into a model with a new head (``init_strict=False``) reports the keys
  and trains; strict, it is refused naming the keys and the fix; an export's ``out`` ending in ``.safetensors`` is
  that file (``config.json`` beside it), refused for the ``hf`` format, whose output is a folder;
- export of a 2-rank ``fsdp`` run (sharded checkpoint) equals the weights of 2 ``ddp`` replicas of the same
  seed and data bit for bit;
- a step, parameter groups, ``init_from`` and ``on_nonfinite="skip"`` in one ``fit`` on 2 Ray Train workers: each
  takes effect there as on the in-process worker.

The other 2-rank runs are the engine in two local processes (gloo, tests/_forkserver.py), as two Ray Train workers
run it.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import _forkserver
import raytrain_mgpu as rtm
from raytrain_mgpu.cli import main


class TwoOutputs(nn.Module):
    """Logits and the hidden features (what an auxiliary loss reads)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        features = self.body(x)
        return self.head(features), features


def aux_step(model, batch, ctx):
    """Cross-entropy plus 0.01 x the features' mean square; the latter logged as ``aux``."""
    x, y = batch
    logits, features = model(x)
    aux = features.pow(2).mean()
    return {"loss": ctx.loss(logits, y) + 0.01 * aux, "outputs": logits, "aux": aux}


CUSTOM = dict(model=TwoOutputs, dataset="digits", batch_size=64, epochs=1, optimizer="sgd", lr=0.1, momentum=0.9,
              train_step=aux_step, seed=2, use_gpu=False)


def _custom_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    engine = make_engine({**CUSTOM, "storage_path": f"{out}/runs"}, rank=rank, world=world)
    row = engine.train_epoch(0)
    torch.save({"row": row, "weights": engine.steps.named_model().state_dict()}, f"{out}/rank{rank}.pt")


def _one_process(fields: dict) -> dict:
    """The same step by hand, one process, the whole batch: step s takes positions [sB, (s+1)B) of the epoch's
    seeded permutation, as the ranks' samplers together do."""
    from raytrain_mgpu.data import build_datasets

    cfg = rtm.TrainConfig(**fields)
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = TwoOutputs(data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    sampler.set_epoch(0)
    ctx = type("Ctx", (), {"loss": staticmethod(nn.functional.cross_entropy)})
    for x, y in DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True):
        loss = aux_step(model, (x, y), ctx)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def test_a_custom_step_on_two_ddp_ranks_equals_it_on_the_whole_batch_and_logs_its_extra(tmp_path):
    _forkserver.start_gloo_ranks(_custom_rank, (str(tmp_path),))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    want = _one_process(CUSTOM)
    for key, value in want.items():
        torch.testing.assert_close(ranks[0]["weights"][key], value, rtol=1e-5, atol=1e-6)
    row = ranks[0]["row"]
    assert row["train_aux"] > 0 and row["train_accuracy"] > 0.2  # the extra, and the metrics on its outputs


def test_a_custom_step_through_fit_reports_its_extra_in_the_history_and_evaluates_with_it(tmp_path):
    result = rtm.fit(rtm.TrainConfig(**CUSTOM, num_workers=1, storage_path=str(tmp_path)), stream=io.StringIO())
    row = result.metrics
    assert row["train_aux"] > 0 and row["test_aux"] > 0 and row["test_accuracy"] > 0.2


def test_a_custom_step_is_refused_by_the_pipeline_with_the_reason():
    with pytest.raises(ValueError, match=r"TrainConfig.train_step is not supported by strategy='pipeline': .*"
                                         r"TrainConfig.loss"):
        rtm.TrainConfig(**{**CUSTOM, "model": "mlp", "strategy": "pipeline", "num_stages": 2})


def test_a_step_returning_something_else_is_named():
    with pytest.raises(ValueError, match=r"TrainConfig.train_step returned str: it must return the loss"):
        rtm.fit(rtm.TrainConfig(**{**CUSTOM, "train_step": lambda m, b, c: "loss"}, num_workers=1,
                                storage_path="/tmp/never"), stream=io.StringIO())


# ----------------------------------------------------------------------------- frozen backbone


def frozen_backbone(input_shape, num_classes):
    """The body frozen (a pretrained backbone), a new head trained."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, num_classes))
    for layer in model[:3]:
        layer.requires_grad_(False)
    return model


FROZEN = dict(model=frozen_backbone, dataset="digits", batch_size=64, optimizer="adamw", lr=0.01, weight_decay=0.1,
              save="trainable", num_workers=1, use_gpu=False, param_groups="no_decay_norm_bias")


def test_a_frozen_backbone_trains_the_head_only_and_its_trainable_checkpoint_resumes_exactly(tmp_path):
    from raytrain_mgpu.checkpointing.files import load_model_state, load_train_state

    torch.manual_seed(0)
    initial = frozen_backbone((1, 8, 8), 10).state_dict()
    straight = rtm.fit(rtm.TrainConfig(**FROZEN, epochs=3, storage_path=str(tmp_path / "a")), stream=io.StringIO())
    weights = straight.load_model().state_dict()
    assert torch.equal(weights["1.weight"], initial["1.weight"]) and torch.equal(weights["1.bias"], initial["1.bias"])
    assert not torch.equal(weights["4.weight"], initial["4.weight"])  # the head learned
    saved = load_model_state(straight.checkpoint_path)
    assert set(saved) == {"4.weight", "4.bias", "2.running_mean", "2.running_var", "2.num_batches_tracked"}
    optimizer = load_train_state(straight.checkpoint_path)["optimizer"]
    assert [len(group["params"]) for group in optimizer["param_groups"]] == [1, 1]  # head weight decayed, bias not
    first = rtm.TrainConfig(**FROZEN, epochs=2, storage_path=str(tmp_path / "b"))
    rtm.fit(first, stream=io.StringIO())
    resumed = rtm.fit(first.replace(epochs=3), stream=io.StringIO())
    assert resumed.history[-1]["attempt"] == 1
    for key, value in resumed.load_model().state_dict().items():
        assert torch.equal(value, weights[key]), key


# ----------------------------------------------------------------------------- in and out


def test_init_from_an_export_with_a_new_head_reports_the_keys_and_trains(tmp_path):
    source = rtm.fit(rtm.TrainConfig(model="lenet", dataset="digits", num_workers=1, use_gpu=False, epochs=1,
                                     storage_path=str(tmp_path), name="source"), stream=io.StringIO())
    written = source.export(out=str(tmp_path / "lenet.safetensors"))  # that file, its config.json beside it
    assert written == [str(tmp_path / "config.json"), str(tmp_path / "lenet.safetensors")]
    assert json.loads((tmp_path / "config.json").read_text())["model"] == "lenet"
    weights = written[1]
    assert main(["export", source.path, "--out", str(tmp_path / "cli" / "m.safetensors")]) == 0
    assert sorted(os.listdir(tmp_path / "cli")) == ["config.json", "m.safetensors"]
    lines = io.StringIO()
    new_head = dict(model="lenet", dataset="synthetic", input_shape=[1, 8, 8], num_classes=5, num_samples=256,
                    num_workers=1, use_gpu=False, epochs=1, storage_path=str(tmp_path), name="tuned", init_from=weights)
    with pytest.raises(ValueError, match=r"init_strict=False"):
        rtm.fit(rtm.TrainConfig(**new_head), stream=io.StringIO())
    tuned = rtm.fit(rtm.TrainConfig(**new_head, init_strict=False, lr=1e-12), stream=lines)
    assert "init_from" in lines.getvalue() and "2 of another shape left as built (11.bias" in lines.getvalue()
    exported = source.load_model().state_dict()
    for key, value in tuned.load_model().state_dict().items():  # lr ~0: every matching weight is the export's
        if exported[key].shape == value.shape:
            torch.testing.assert_close(value, exported[key], rtol=0, atol=1e-6, msg=key)


def test_an_export_to_a_safetensors_path_refuses_the_hf_format_and_an_old_folder_of_that_name(tmp_path, capsys):
    from raytrain_mgpu.driver.export import export_run

    run, out = str(tmp_path / "run"), str(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"export out='.*/model.safetensors' names a .safetensors file, but fmt='hf' "
                                         r"writes a folder \(the model's save_pretrained files\). Give a folder, e.g. "
                                         r"out='.*/model' \(CLI: --out .*/model\), or use fmt='safetensors'"):
        export_run(run, out=out, fmt="hf")  # refused first: the run is not even read
    assert main(["export", run, "--format", "hf", "--out", out]) == 2
    assert "fmt='hf' writes a folder" in capsys.readouterr().err
    os.mkdir(out)  # what an export to this path wrote before it named a file
    with pytest.raises(ValueError, match=r"export out='.*/model.safetensors' is a folder \(an earlier export into "
                                         r"it\?\), and a path ending in .safetensors names the file to write"):
        export_run(run, out=out)
    assert os.listdir(tmp_path) == ["model.safetensors"] and not os.listdir(out)


SHARDED = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64, epochs=1, use_gpu=False)


def _fsdp_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    engine = make_engine(dict(SHARDED, strategy="fsdp", storage_path=out, name="sharded"), rank=rank, world=world,
                         setup=False)
    engine.run()


def test_export_of_a_two_rank_fsdp_run_equals_the_same_run_on_two_ddp_replicas_bit_for_bit(tmp_path):
    """The export consolidates the ranks' shards into the weights that 2 ``ddp`` replicas of the same seed and data
    train (emulated in this process: tests/_reference.train_replicas): FSDP2's halved gradients summed over 2 ranks
    are DDP's, bit for bit."""
    from _reference import train_replicas
    from raytrain_mgpu.checkpointing.files import is_sharded
    from raytrain_mgpu.checkpointing.run_folder import RunFolder
    from safetensors.torch import load_file

    _forkserver.start_gloo_ranks(_fsdp_rank, (str(tmp_path),))
    folder = RunFolder(str(tmp_path / "sharded"))
    checkpoint = folder.newest_checkpoint()
    assert is_sharded(checkpoint.path)
    result = rtm.TrainResult(rtm.TrainConfig(**SHARDED, strategy="fsdp", storage_path=str(tmp_path), name="sharded"),
                             folder.state().history, checkpoint.uri, folder.uri)
    exported = load_file(next(p for p in result.export() if p.endswith("model.safetensors")))
    replicas, _ = train_replicas(dict(SHARDED, strategy="ddp", num_workers=2))
    assert exported.keys() == replicas.keys()
    for key, value in replicas.items():
        assert torch.equal(exported[key], value), key


# ----------------------------------------------------------------------------- through Ray Train's workers

NAN_STEP = 5  # optimizer steps already taken when the last rank's loss turns NaN (the 6th step)


class FrozenBody(TwoOutputs):
    """``TwoOutputs`` with its body frozen: the pretrained part that ``init_from`` brings; only the head trains."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.body.requires_grad_(False)


def aux_step_nan_at_step_5(model, batch, ctx):
    """``aux_step``, its loss NaN on the last rank at step NAN_STEP (rank 1 of 2 workers; the only one of 1)."""
    out = aux_step(model, batch, ctx)
    if ctx.step == NAN_STEP and ctx.rank == ctx.world_size - 1:
        out["loss"] = out["loss"] * float("nan")
    return out


def head_bias_fast(model):
    """Parameter groups by name: the head's bias at 5 times the config's lr."""
    return [{"params": ["head.weight"]}, {"params": ["head.bias"], "lr": 0.5}]


def test_a_step_param_groups_init_from_and_skip_take_effect_on_two_ray_train_workers(ray_session, storage, tmp_path):
    """The four in one ``fit`` on 2 Ray Train workers, against the in-process worker (tests/_reference.py) where it
    trains the same: the skipped step, the step's extra scalar, the optimizer's groups, the frozen body from the
    file and the head's weights."""
    from _reference import train_one_worker
    from safetensors.torch import save_file

    from raytrain_mgpu.checkpointing.files import load_train_state, local_checkpoint

    torch.manual_seed(99)  # another seed than the run's: the body below is the file's, not one the run built
    pretrained = TwoOutputs((1, 8, 8), 10).state_dict()
    save_file(pretrained, str(tmp_path / "pretrained.safetensors"))
    fields = dict(model=FrozenBody, dataset="digits", batch_size=64, epochs=1, optimizer="sgd", lr=0.1, momentum=0.9,
                  seed=2, train_step=aux_step_nan_at_step_5, param_groups=head_bias_fast, on_nonfinite="skip",
                  init_from=str(tmp_path / "pretrained.safetensors"), use_gpu=False)
    lines = io.StringIO()
    result = rtm.fit(rtm.TrainConfig(**fields, num_workers=2, runner="ray", name="four", storage_path=storage),
                     stream=lines)
    want, want_optimizer, _, want_history = train_one_worker(fields)
    row, want_row = result.history[-1], want_history[-1]
    assert len(row["node_id_per_rank"]) == 2  # through Ray Train's 2 workers
    # skip: rank 1's NaN at step 6 skipped on both ranks (skipped_steps is their mean), as on the one worker
    assert row["skipped_steps"] == want_row["skipped_steps"] == 1 and row["step"] == 1438 // 64
    # train_step: its extra scalar (the frozen body's features: the same samples, less the skipped ones)
    assert row["train_aux"] == pytest.approx(want_row["train_aux"], rel=0.05) and row["train_aux"] > 0
    # init_from: rank 0 read the file, and the frozen body is the file's, bit for bit
    assert "init_from" in lines.getvalue() and "loaded 4 of the model's 4 tensors" in lines.getvalue()
    weights = result.load_model().state_dict()
    for key in ("body.1.weight", "body.1.bias"):
        assert torch.equal(weights[key], pretrained[key]) and torch.equal(want[key], pretrained[key]), key
    # the head trained as the in-process worker's (the same global batches; DDP's mean over the 2 workers)
    for key in ("head.weight", "head.bias"):
        torch.testing.assert_close(weights[key], want[key], rtol=1e-4, atol=1e-5)
    # param_groups: rank 0's optimizer held the function's two groups, each with its own lr
    with local_checkpoint(result.checkpoint_path) as directory:
        groups = load_train_state(directory)["optimizer"]["param_groups"]
    assert [(len(g["params"]), g["lr"]) for g in groups] == [(1, 0.1), (1, 0.5)]
    assert [g["lr"] for g in groups] == [g["lr"] for g in want_optimizer["param_groups"]]
