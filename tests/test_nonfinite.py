"""A run never loses its good weights: a loss that turns NaN stops the run before any checkpoint of such weights
(``on_nonfinite="stop"``), or its steps are skipped on every rank alike (``"skip"``); a checkpoint write that
fails (disk full, at any stage of the write) leaves the previous checkpoint loadable and says where and why.

The engine's checkpoints go through one of two deliveries: the run folder's (the in-process runner and the
pipeline's stage actors: ``transports/base.FolderTransport``), exercised here in-process, and Ray Train's report
(tests/test_wiring.py, tests/test_async_upload.py). The 2-worker skip runs the engine in two local processes
(gloo, tests/_forkserver.py), as two Ray Train workers run it.
"""

from __future__ import annotations

import errno
import io
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import _forkserver
import raytrain_mgpu as rtm
from _reference import steps_trained
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.engine.loop import NonFiniteError
from raytrain_mgpu.checkpointing.run_folder import RunFolder

STEPS_PER_EPOCH = 1438 // 128  # digits, batch 128: 11


class TurnsNaN(nn.Module):
    """lenet-sized MLP whose outputs become NaN from its ``after``-th training forward on (a divergence)."""

    def __init__(self, input_shape, num_classes, after: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.after, self.calls = after, 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.after:
                out = out * float("nan")
        return out


def turns_nan_in_epoch_3(input_shape, num_classes):
    return TurnsNaN(input_shape, num_classes, after=2 * STEPS_PER_EPOCH + 4)  # step 26: the 4th of epoch 3


def _fit(storage, **fields):
    cfg = rtm.TrainConfig(**{**dict(model=turns_nan_in_epoch_3, dataset="digits", num_workers=1, use_gpu=False,
                                    runner="local", epochs=6, storage_path=storage, name="run", optimizer="sgd", lr=0.1), **fields})
    return rtm.fit(cfg, stream=io.StringIO())


def test_a_loss_that_turns_nan_stops_the_run_and_the_last_finite_checkpoint_survives(tmp_path):
    with pytest.raises(NonFiniteError, match=r"the training loss became NaN or infinite at step 26 \(epoch 3\) on "
                                             r"rank\(s\) 0: .* last checkpoint holds the last finite ones\. Try a "
                                             r"lower lr, grad_clip_norm .*bf16-mixed.*on_nonfinite='skip'"):
        _fit(str(tmp_path))
    folder = RunFolder(str(tmp_path / "run"))
    newest = folder.newest_checkpoint()
    assert newest.name == "checkpoint_epoch000002" and newest.meta["epoch"] == 2
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000001", "checkpoint_epoch000002"]
    weights = ckpt_format.load_model_state(newest.path)
    assert all(torch.isfinite(w).all() for w in weights.values())
    model = rtm.TrainResult(rtm.TrainConfig(model=turns_nan_in_epoch_3, storage_path=str(tmp_path), name="run"),
                            folder.state().history, newest.uri, folder.uri).load_model()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_ignore_trains_on_but_never_writes_a_checkpoint_of_nan_weights(tmp_path):
    result = _fit(str(tmp_path), on_nonfinite="ignore", num_checkpoints_to_keep=10)
    assert [row["epoch"] for row in result.history] == list(range(1, 7))
    assert math.isnan(result.history[2]["train_loss"])
    folder = RunFolder(str(tmp_path / "run"))
    assert [c.meta["epoch"] for c in folder.checkpoints()] == [1, 2]  # epochs 3-6 had NaN weights: not written


def test_a_checkpoint_is_never_written_with_nan_weights_whatever_the_loss_check_says(tmp_path, monkeypatch):
    """The weights' own check: here the loss check is blinded, and the save still refuses (stop)."""
    monkeypatch.setattr("raytrain_mgpu.engine.metrics.EpochMeter.loss_not_finite",
                        lambda self: torch.zeros((), dtype=torch.bool))
    with pytest.raises(NonFiniteError, match=r"the weights are not finite at step 33 \(epoch 3\)"):
        _fit(str(tmp_path))
    assert RunFolder(str(tmp_path / "run")).newest_checkpoint().name == "checkpoint_epoch000002"


# ----------------------------------------------------------------------------- skip, on 2 ranks


def nan_on_rank_1_at_step_3(outputs, targets):
    """The config's loss, NaN on rank 1's third training micro-batch only (one bad batch on one worker)."""
    import torch.distributed as dist

    loss = nn.functional.cross_entropy(outputs, targets)
    if torch.is_grad_enabled() and outputs.device.type != "meta":  # a training step (not the FLOP count's meta pass)
        nan_on_rank_1_at_step_3.calls = getattr(nan_on_rank_1_at_step_3, "calls", 0) + 1
        if dist.get_rank() == 1 and nan_on_rank_1_at_step_3.calls == 3:
            loss = loss * float("nan")
    return loss


def _skip_rank(rank: int, world: int, out: str) -> None:
    from _engine import make_engine

    engine = make_engine(dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", batch_size=128,
                              epochs=1, optimizer="sgd", lr=0.1, loss=nan_on_rank_1_at_step_3,
                              on_nonfinite="skip", storage_path=f"{out}/runs"), rank=rank, world=world)
    before = {}

    def watch(step):
        if step in (2, 3):
            before[step] = [p.detach().clone() for p in engine.steps.model.parameters()]

    from raytrain_mgpu.engine import loop as engine_module

    engine_module.STEP_EVENTS.append(watch)
    row = engine.train_epoch(0)
    weights = engine.steps.named_model().state_dict()
    torch.save({"row": row, "weights": weights, "step2": before[2], "step3": before[3]}, f"{out}/rank{rank}.pt")


def test_skip_skips_the_same_step_on_both_ranks_and_trains_on(tmp_path):
    _forkserver.start_gloo_ranks(_skip_rank, (str(tmp_path),))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for result in ranks:
        assert result["row"]["skipped_steps"] == 1 and result["row"]["step"] == STEPS_PER_EPOCH
        assert math.isfinite(result["row"]["train_loss"])  # the skipped micro-batch's loss is left out
        assert all(torch.equal(a, b) for a, b in zip(result["step2"], result["step3"]))  # step 3 changed nothing
        assert all(torch.isfinite(w).all() for w in result["weights"].values())
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key  # both ranks skipped it: still replicas


def test_skip_stops_after_max_skipped_steps_in_a_row(tmp_path):
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row had non-finite gradients "
                                             r"\(max_skipped_steps=3\) at step 28 \(epoch 3\)"):
        _fit(str(tmp_path), on_nonfinite="skip", max_skipped_steps=3)


# ----------------------------------------------------------------------------- a write that fails


def _failing(function, where: str):
    """``function``, raising ENOSPC when it writes into a folder of the checkpoint whose name contains ``where``."""
    def wrapper(*args, **kwargs):
        if any(where in str(arg) for arg in args):
            raise OSError(errno.ENOSPC, "No space left on device")
        return function(*args, **kwargs)

    return wrapper


STAGES = {  # the checkpoint's write, stage by stage
    "model and optimizer": ("raytrain_mgpu.checkpointing.files.write_files", ckpt_format.write_files),
    "history": ("raytrain_mgpu.checkpointing.files.write_checkpoint", ckpt_format.write_checkpoint),
    "publish": ("raytrain_mgpu.checkpointing.run_folder.RunFolder.publish", RunFolder.publish),
}


@pytest.mark.parametrize("kind", ["epoch", "step"])
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_write_that_fails_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, stage, kind):
    """Epoch checkpoints: the second fails; step checkpoints (every 4 steps): the first in epoch 2 fails."""
    target, function = STAGES[stage]
    where = "checkpoint_epoch000002" if kind == "epoch" else "checkpoint_epoch000001_step"
    monkeypatch.setattr(target, _failing(function, where))
    fields = dict(model="mlp", dataset="digits", epochs=3, checkpoint_every_n_steps=4 if kind == "step" else None,
                  num_checkpoints_to_keep=10)
    with pytest.raises(OSError, match=r"No space left on device") as failure:
        _fit(str(tmp_path), **fields)
    if stage != "publish":  # the engine's own writes say which checkpoint and folder
        assert "writing checkpoint checkpoint_epoch00000" in str(failure.value) and str(tmp_path) in str(failure.value)
        assert "the previous checkpoint is intact" in str(failure.value)
    folder = RunFolder(str(tmp_path / "run"))
    newest = folder.newest_checkpoint()
    want = "checkpoint_epoch000001" if kind == "epoch" else "checkpoint_epoch000001"
    assert newest.name == want, [c.name for c in folder.checkpoints()]
    json.loads((Path(newest.path) / "meta.json").read_text())
    assert ckpt_format.load_model_state(newest.path)  # loadable
    monkeypatch.undo()
    with steps_trained() as steps:
        resumed = _fit(str(tmp_path), **fields)  # the disk has room again: the run resumes from it and finishes
    assert [row["epoch"] for row in resumed.history] == [1, 2, 3]
    # from that checkpoint: epoch 1's row is the failed run's, and the new attempt trained epochs 2 and 3 alone
    assert [row["attempt"] for row in resumed.history] == [0, 1, 1]
    per_epoch = resumed.history[0]["step"]
    assert steps == list(range(per_epoch + 1, 3 * per_epoch + 1)) and resumed.history[-1]["step"] == 3 * per_epoch
