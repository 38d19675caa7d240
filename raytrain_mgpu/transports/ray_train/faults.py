"""A checkpoint lost to a failure right after it was reported, closed (:func:`wait_until_report_collected`), and
the controller's poll and wait that ``fit`` sets (:func:`controller_poll`). Collective timeouts that name the stuck
rank are every transport's: ``transports/collective_timeouts.py``.

Reports lost to a failure
-------------------------
``ray.train.report`` puts the report into a per-worker queue and returns; Ray Train's
controller takes it from there at its next poll (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``,
2 s by default) and registers the checkpoint once it holds the reports of *all* ranks.
If any rank dies before that poll, its queued report dies with it, the round never
completes, and the checkpoint, although fully uploaded, is never registered: the restart
resumes from the checkpoint before, one more epoch lost (seen in tests/test_faults.py
with a worker killed 0.1 s after its report). :func:`wait_until_report_collected` blocks
each rank after its report until the controller has taken it, so a failure after that
point always finds the checkpoint registered. Cost: up to one poll interval per report,
which is why ``fit`` runs Ray Train's controller with a 0.03 s poll (:func:`controller_poll`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator, Optional

logger = logging.getLogger(__name__)

__all__ = ["wait_until_report_collected", "controller_poll"]

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
FIT_POLL_S = "0.03"
"""The controller poll ``fit`` asks for: each report (one an epoch, or every K steps) waits for a poll.
Measured on a 2-core machine, ``raytrain-mgpu train`` (88 steps, 8 epochs): 2 s (Ray's default) -> 37-38 s
and ~1,350 samples/s from epoch 2 on; 0.2 s -> 21-24 s and 9,000-17,000 samples/s, the same losses,
and the same machine CPU over the run (36 vs 38 CPU-s: a poll is one small task per worker).
0.2 -> 0.05 s (``raytrain-mgpu bench --short-epochs 10 --rounds 2``): a step checkpoint
192 -> 48 ms, what an epoch adds outside its steps 0.24 -> 0.13 s; 60 epochs of the same 2-worker
fit trained at 22,700-24,800 samples/s against 23,000 with 0.2 s (the polls cost the steps nothing
measurable). 0.05 -> 0.03 s (with step checkpoints reported first: ``checkpointing/contents.py``):
10-epoch 2-worker fits with a save every 10 steps: 0.05 s 46.7-59.3 ms a save, 0.02 s 29.4-32.3 ms; but in
40-epoch fits (2 runs each) the epochs' time in steps was 0.131-0.139 s at 0.02 against 0.120-0.125 s at
0.05 (~8 % slower: on 2 cores the polls take CPU from the workers), so 0.03 in between: the bench
gave 38.6 ms a save at 0.03 (33.1 ms at 0.02), and the same samples/s within its noise (0.78x vs 0.81x the
hand-written loop's). A poll that takes longer than the interval is only a missed poll: Ray Train declares a
worker dead after ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S`` (10 min), not after one interval."""

WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for its preemption watcher, read from the driver's environment when ``fit()``
starts the controller, as the poll is; fit sets it where no notice can come (``checkpointing/preemption.py``)."""

def wait_until_report_collected(timeout_s: float = 300.0) -> None:
    """Call right after ``ray.train.report`` on every rank: returns once Ray Train's
    controller has taken this rank's report (or after ``timeout_s``, with a warning)."""
    try:
        # late: Ray Train (0.96 s of import), only on its workers: the in-process runner imports this module through
        # transports/preemption.py; a Ray Train whose internals moved is answered below; tests replace the function
        from ray.train.v2._internal.execution.context import get_train_context

        pending = get_train_context().get_result_queue()
    except Exception as exc:  # not Ray Train V2, or its internals moved: nothing to wait for
        logger.debug("not waiting for report collection: %s", exc)
        return
    deadline = time.monotonic() + timeout_s
    # The controller calls task_done() when it takes a report, so unfinished_tasks drops
    # to 0 exactly when every report this rank made has been collected; task_done() notifies
    # all_tasks_done, so this wakes at once (Queue.join with a deadline). A 20 ms sleep loop here
    # added 10 ms on average to every step checkpoint (~50 ms a save).
    with pending.all_tasks_done:
        while pending.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("Ray Train's controller has not collected this worker's report after %.0f s; "
                               "continuing without waiting", timeout_s)
                return
            pending.all_tasks_done.wait(left)


START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
"""How long each of Ray Train's waits for a worker group's resources lasts (60 s by default, then it tries again,
for ever): ``fit`` lowers it to a shorter ``TrainConfig.placement_timeout_s``, and its retry policy ends the tries
once ``placement_timeout_s`` has passed in all (``transports/ray_train/policy.py``)."""


@contextlib.contextmanager
def controller_poll(start_timeout_s: Optional[float] = None) -> Iterator[None]:
    """Around ``TorchTrainer.fit()``: Ray Train's controller polls its workers every
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` and reads it from the driver's environment when ``fit()``
    starts the controller (it passes it on to the workers), so it is set here for that call,
    to :data:`FIT_POLL_S`, and removed after; ``start_timeout_s``: :data:`START_TIMEOUT_ENV` the same way.
    A value the user set is kept."""
    values = {POLL_ENV: FIT_POLL_S}
    if start_timeout_s is not None:
        values[START_TIMEOUT_ENV] = f"{start_timeout_s:g}"
    ours = [name for name in values if name not in os.environ]
    os.environ.update({name: values[name] for name in ours})
    try:
        yield
    finally:
        for name in ours:
            os.environ.pop(name, None)
