"""A pipeline stage that dies in the middle of a step fails the run at once.

``tests/test_pipeline_ray.py`` kills the last stage on the first forward of a step, after the
checkpoint before it is complete (``_pipe_probe:mlp_whose_last_stage_dies``). Here the last
stage SIGKILLs itself inside a micro-batch's forward (``_probe_data:mlp_that_dies``): the
first stage has sent activations and blocks in a receive for that stage's gradient, which
would only end with the collective timeout (set to 300 s here) if the driver did not notice
the death and tear the group down.
"""

from __future__ import annotations

import time

import pytest
import ray

import raytrain_mgpu as rtm

pytestmark = pytest.mark.ray

NUM_MICROBATCHES = 4
# Forward number 15 of the last stage: the third micro-batch of step 4 (1F1B), mid-step.
AFTER_FORWARDS = 3 * NUM_MICROBATCHES + 3
# From the kill to fit raising: measured 0.1 s on a loaded 2-core machine (the whole test
# 10-17 s); 5 s leaves room for load and is far below the 300 s collective timeout.
FAILS_WITHIN_S = 5


@pytest.mark.quick  # the quick tier's pipeline run through Ray: one actor group, a stage lost, the run's failure
@pytest.mark.timeout(300)
def test_a_stage_killed_mid_step_fails_the_run_within_seconds(ray_session, storage, tmp_path):
    cfg = rtm.TrainConfig(model="_probe_data:mlp_that_dies", dataset="digits", strategy="pipeline",
                          num_stages=2, num_microbatches=NUM_MICROBATCHES, schedule="1f1b", batch_size=64,
                          optimizer="sgd", lr=0.1, epochs=1, max_failures=0, collective_timeout_s=300, use_gpu=False,
                          model_kwargs={"probe": str(tmp_path), "after_forwards": AFTER_FORWARDS},
                          name="dies-mid-step", storage_path=storage)
    # Whichever the driver sees first: the dead stage's own task, or stage 0 losing its peer
    # while it waits for a gradient (its step x stage grid marks the action it was running).
    with pytest.raises(ray.exceptions.RayError, match=r"The actor died unexpectedly|"
                                                      r"pipeline rank 0 failed running 0[FB]\d") as failure:
        rtm.fit(cfg)
    raised = time.time()
    died = float((tmp_path / "died").read_text())  # written by the stage just before its SIGKILL
    print(f"failed {raised - died:.2f} s after the stage died")
    assert raised - died < FAILS_WITHIN_S, f"failed {raised - died:.1f} s after the stage died: {failure.value}"
