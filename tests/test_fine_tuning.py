"""Your own training step, parameter groups, and fine-tuning in and out.

- a custom step (an auxiliary loss on an intermediate output and a logged extra scalar) on ``ddp`` over 2 ranks
  ends with the weights of the same step in one process on the whole batch, and its extra is in the history;
- a frozen backbone: only the head changes, ``save="trainable"`` checkpoints hold the trainable part, and a
  resume from one ends exactly like the uninterrupted run;
- ``init_from`` an exported ``.safetensors`` into a model with a new head (``init_strict=False``) reports the keys
  and trains; strict, it is refused naming the keys and the fix;
- export of a 2-rank ``fsdp`` run (sharded checkpoint) equals ``load_model()``'s state bit for bit.

The 2-rank runs are the engine in two local processes (gloo, tests/_forkserver.py), as two Ray Train workers run it.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import _forkserver
import raytrain_mgpu as rtm


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
              train_step=aux_step, seed=2)


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
              save="trainable", num_workers=1, param_groups="no_decay_norm_bias")


def test_a_frozen_backbone_trains_the_head_only_and_its_trainable_checkpoint_resumes_exactly(tmp_path):
    from raytrain_mgpu.runtime.checkpoint import load_model_state, load_train_state

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
    source = rtm.fit(rtm.TrainConfig(model="lenet", dataset="digits", num_workers=1, epochs=1,
                                     storage_path=str(tmp_path), name="source"), stream=io.StringIO())
    written = source.export()
    weights = next(p for p in written if p.endswith("model.safetensors"))
    lines = io.StringIO()
    new_head = dict(model="lenet", dataset="synthetic", input_shape=[1, 8, 8], num_classes=5, num_samples=256,
                    num_workers=1, epochs=1, storage_path=str(tmp_path), name="tuned", init_from=weights)
    with pytest.raises(ValueError, match=r"init_strict=False"):
        rtm.fit(rtm.TrainConfig(**new_head), stream=io.StringIO())
    tuned = rtm.fit(rtm.TrainConfig(**new_head, init_strict=False, lr=1e-12), stream=lines)
    assert "init_from" in lines.getvalue() and "2 of another shape left as built (11.bias" in lines.getvalue()
    exported = source.load_model().state_dict()
    for key, value in tuned.load_model().state_dict().items():  # lr ~0: every matching weight is the export's
        if exported[key].shape == value.shape:
            torch.testing.assert_close(value, exported[key], rtol=0, atol=1e-6, msg=key)


def _fsdp_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    engine = make_engine(dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64,
                              epochs=1, strategy="fsdp", storage_path=out, name="sharded"), rank=rank, world=world,
                         setup=False)
    engine.run()


def test_export_of_a_two_rank_fsdp_run_equals_load_model_bit_for_bit(tmp_path):
    from raytrain_mgpu.runtime.checkpoint import is_sharded
    from raytrain_mgpu.runtime.run_folder import RunFolder
    from safetensors.torch import load_file

    _forkserver.start_gloo_ranks(_fsdp_rank, (str(tmp_path),))
    folder = RunFolder(str(tmp_path / "sharded"))
    checkpoint = folder.newest_checkpoint()
    assert is_sharded(checkpoint.path)
    result = rtm.TrainResult(rtm.TrainConfig(model="mlp", model_kwargs={"widths": [32]}, strategy="fsdp",
                                             storage_path=str(tmp_path), name="sharded"),
                             folder.state().history, checkpoint.uri, folder.uri)
    exported = load_file(next(p for p in result.export() if p.endswith("model.safetensors")))
    loaded = result.load_model().state_dict()
    assert exported.keys() == loaded.keys()
    for key, value in loaded.items():
        assert torch.equal(exported[key], value), key
