"""Step checkpoints (``checkpoint_every_n_steps``) and the mid-epoch resume (``checkpointing/step_checkpoints.py``).

The resume logic in this process: a one-worker run (the in-process runner) fails inside epoch 2, its
restart resumes from the last step checkpoint and ends bit for bit with the undisturbed run. Through Ray,
a rank SIGKILLed in the middle of epoch 2 resumes from the last step checkpoint, inside the epoch, and the
run ends with the weights and epoch rows of an undisturbed run, the restarted worker having trained exactly
the rest of the epoch: tests/test_async_upload.py, whose one Ray run has that fault after a kill mid-upload.
"""

from __future__ import annotations

import math

import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.metrics import EpochMeter
from raytrain_mgpu.checkpointing.step_checkpoints import ResumableSampler, step_checkpoint_due

# As in test_faults: no BatchNorm or dropout, so runs that see the same batches agree exactly.
MLP = dict(model="mlp", model_kwargs={"widths": [32]}, batch_size=64, optimizer="sgd", lr=0.1, seed=3,
           num_workers=2, use_gpu=False, epochs=2)
STEPS_PER_EPOCH = 1438 // 64   # 22: digits' train split, global batch 64
EVERY = 5                      # step checkpoints at global steps 5, 10, ..., 40 (not 22 and 44: epoch ends)
RESUMED_AT = 30                # the last step checkpoint before it: 8 steps into epoch 2


def test_the_sampler_leaves_out_the_trained_positions_of_the_resumed_epoch_only():
    data = list(range(100))
    plain = ResumableSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True)
    resumed = ResumableSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True)
    resumed.resume_at(epoch=3, skip=12)
    for epoch in (2, 3, 4):
        plain.set_epoch(epoch)
        resumed.set_epoch(epoch)
        assert list(resumed) == (list(plain)[12:] if epoch == 3 else list(plain)), epoch
    resumed.set_epoch(3)
    assert list(resumed) == list(resumed)  # prefetch reads the order too: iterating twice gives the same


@pytest.mark.parametrize("step,step_in_epoch,max_steps,due", [
    (30, 8, None, True), (31, 9, None, False), (20, 22, None, False),  # the epoch checkpoint comes anyway
    (30, 8, 30, False), (30, 8, 40, True)])
def test_a_step_checkpoint_is_due_every_k_steps_but_not_where_an_epoch_one_follows(step, step_in_epoch, max_steps,
                                                                                  due):
    cfg = rtm.TrainConfig(checkpoint_every_n_steps=10, max_steps=max_steps)
    assert step_checkpoint_due(cfg, step, step_in_epoch, 22) is due
    assert not step_checkpoint_due(rtm.TrainConfig(), step, step_in_epoch, 22)


def test_an_epochs_sums_continue_from_a_partial():
    objective = Objective()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 10, generator=generator), torch.randint(0, 10, (n,), generator=generator))
               for n in (4, 6, 5)]
    whole, first, rest = (EpochMeter(torch.device("cpu"), objective) for _ in range(3))
    for i, (outputs, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(outputs, y)
        whole.add(loss, outputs, y)
        (first if i == 0 else rest).add(loss, outputs, y)
    first.data_wait_s = 0.25
    rest.resume([first.partial()])
    torch.testing.assert_close(rest.totals, whole.totals)
    assert rest.data_wait_s == 0.25 and rest.elapsed() >= first.elapsed()


def test_step_checkpoints_are_taken_with_a_parquet_stream_and_refused_at_zero():  # tests/test_stream_resume.py
    rtm.TrainConfig(dataset="parquet", data_root="/nonexistent", ingest="ray_data", checkpoint_every_n_steps=5)
    with pytest.raises(ValueError, match="checkpoint_every_n_steps=0: must be a positive integer or None"):
        rtm.TrainConfig(checkpoint_every_n_steps=0)


def mlp_with_dropout(input_shape, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(32, num_classes))


def test_an_in_process_run_failing_mid_epoch_resumes_at_its_last_step_checkpoint_and_ends_like_an_undisturbed_run():
    """The engine's resume without Ray: one worker trains in this process and fails after global step 35
    (a probe on the engine's step hook); ``max_failures`` restarts it from the step-30 checkpoint, 8 steps into
    epoch 2: the same weights, optimizer state, RNG and epoch rows as the run that never failed (dropout draws
    from the RNG every step, so its restore counts in the weights)."""
    from _failing_models import fault_once_after_step
    from _reference import train_one_worker

    common = dict(MLP, model=mlp_with_dropout, model_kwargs={}, dataset="digits", num_workers=1, momentum=0.9,
                  checkpoint_every_n_steps=EVERY)
    want, want_optimizer, want_rng, undisturbed_history = train_one_worker(common)
    with fault_once_after_step(35) as steps:
        got, got_optimizer, got_rng, history = train_one_worker({**common, "max_failures": 1})
    assert steps == list(range(1, 36)) + list(range(RESUMED_AT + 1, 2 * STEPS_PER_EPOCH + 1))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert torch.equal(got_rng, want_rng)
    for index, state in want_optimizer["state"].items():  # SGD's momentum buffers, restored from the checkpoint
        assert torch.equal(got_optimizer["state"][index]["momentum_buffer"], state["momentum_buffer"]), index
    assert [(h["epoch"], h["step"], h["attempt"]) for h in history] == [
        (1, STEPS_PER_EPOCH, 0), (2, 2 * STEPS_PER_EPOCH, 1)]
    for got_row, want_row in zip(history, undisturbed_history):  # the resumed epoch's sums continued
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert math.isclose(got_row[key], want_row[key], rel_tol=1e-9), key
