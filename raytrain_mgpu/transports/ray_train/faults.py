"""Two failure modes of Ray Train workers, made visible or closed.

1. Collective timeouts that say which rank is stuck (:func:`name_stuck_ranks`).
2. A checkpoint lost to a failure right after it was reported
   (:func:`wait_until_report_collected`).

Collective timeouts
-------------------

When one worker stalls (a hung data read, a rank-dependent branch that skips a
collective), the others block in their next collective until the process group's timeout
(``TrainConfig.collective_timeout_s``) and gloo then reports, on the ranks that *waited*:

    RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms
    for recv operation to complete

naming neither the stuck rank nor where it runs, and Ray Train shows that error under
the waiting rank's number. :func:`name_stuck_ranks` wraps the worker function: each rank
registers its node and PID in the process group's store at start (one store write), and
a rank whose collective times out checks in and waits a short grace period for the
others to do the same. Ranks that never check in are the stuck ones; the error names
them with node and PID, so ``py-spy dump --pid`` on that node shows where they hang.

The store is the c10d TCPStore the process group was created with. Its server runs in a
background thread of rank 0, so it answers even when rank 0's Python code is the one
that is stuck. NCCL is different: its watchdog aborts the process on a timeout before
Python sees an error, so this wrapper only helps for gloo (CPU) groups; for NCCL use
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` (the flight recorder names the stuck collective).

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
import functools
import logging
import os
import socket
import time
from typing import Callable, Iterator, List, Optional

logger = logging.getLogger(__name__)

__all__ = ["CollectiveTimeoutError", "name_stuck_ranks", "wait_until_report_collected", "controller_poll"]

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
FIT_POLL_S = "0.03"
"""The controller poll ``fit`` asks for: each report (one an epoch, or every K steps) waits for a poll.
Measured on a 2-core machine, ``raytrain-mgpu train`` (88 steps, 8 epochs): 2 s (Ray's default) -> 37-38 s
and ~1,350 samples/s from epoch 2 on; 0.2 s -> 21-24 s and 9,000-17,000 samples/s, the same losses,
and the same machine CPU over the run (36 vs 38 CPU-s: a poll is one small task per worker).
0.2 -> 0.05 s (``raytrain-mgpu bench --short-epochs 10 --rounds 2``): a step checkpoint
192 -> 48 ms, what an epoch adds outside its steps 0.24 -> 0.13 s; 60 epochs of the same 2-worker
fit trained at 22,700-24,800 samples/s against 23,000 with 0.2 s (the polls cost the steps nothing
measurable). 0.05 -> 0.03 s (with step checkpoints reported first: ``engine/checkpoints.py``):
10-epoch 2-worker fits with a save every 10 steps: 0.05 s 46.7-59.3 ms a save, 0.02 s 29.4-32.3 ms; but in
40-epoch fits (2 runs each) the epochs' time in steps was 0.131-0.139 s at 0.02 against 0.120-0.125 s at
0.05 (~8 % slower: on 2 cores the polls take CPU from the workers), so 0.03 in between: the bench
gave 38.6 ms a save at 0.03 (33.1 ms at 0.02), and the same samples/s within its noise (0.78x vs 0.81x the
hand-written loop's). A poll that takes longer than the interval is only a missed poll: Ray Train declares a
worker dead after ``RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S`` (10 min), not after one interval."""

WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for its preemption watcher, read from the driver's environment when ``fit()``
starts the controller, as the poll is; fit sets it where no notice can come (``engine/preemption.py``)."""

_WHERE_KEY = "raytrain_mgpu/where/{rank}"
_CHECKIN_KEY = "raytrain_mgpu/timed_out/{rank}"


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out because the ranks in ``stuck_ranks`` never joined it."""

    def __init__(self, message: str, stuck_ranks: Optional[List[int]] = None):
        super().__init__(message)
        self.stuck_ranks = stuck_ranks

    def __reduce__(self):  # Ray pickles it from the worker to the driver (notes and fields in its __dict__)
        return type(self), (str(self), self.stuck_ranks), self.__dict__


def name_stuck_ranks(train_fn: Callable) -> Callable:
    """Decorate a Ray Train worker function ``f(payload)``; ``payload["config"]`` is the
    ``TrainConfig`` (for ``collective_timeout_s``)."""

    @functools.wraps(train_fn)
    def wrapper(payload: dict):
        store, rank, world_size = _register()
        try:
            return train_fn(payload)
        except RuntimeError as exc:
            if store is None or world_size < 2 or isinstance(exc, CollectiveTimeoutError) or not _is_timeout(exc):
                raise
            timeout_s = float(getattr(payload.get("config"), "collective_timeout_s", 60.0))
            raise _stuck_rank_error(exc, store, rank, world_size, timeout_s) from exc

    return wrapper


def _register():
    """Record this rank's node and PID in the store; (store, rank, world size) or Nones."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        store = dist.distributed_c10d._get_default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        store.set(_WHERE_KEY.format(rank=rank), f"node {_node_ip()}, pid {os.getpid()}")
        return store, rank, world_size
    except Exception as exc:  # a diagnostic aid must never stop training
        logger.debug("stuck-rank detection disabled: %s", exc)
        return None, 0, 1


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostname()


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _grace_s(timeout_s: float) -> float:
    # Healthy ranks block in the same or the next collective, so they time out within
    # about one timeout of each other; cap the wait for long timeouts.
    return min(max(5.0, 0.25 * timeout_s), 60.0)


def _stuck_rank_error(exc: RuntimeError, store, rank: int, world_size: int,
                      timeout_s: float) -> RuntimeError:
    grace = _grace_s(timeout_s)
    try:
        store.set(_CHECKIN_KEY.format(rank=rank), "1")
        deadline = time.monotonic() + grace
        while True:
            missing = [r for r in range(world_size) if not store.check([_CHECKIN_KEY.format(rank=r)])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        where = {r: _where(store, r) for r in missing}
    except Exception as probe_exc:  # the store is gone too (its host, rank 0, died)
        return CollectiveTimeoutError(
            f"a collective on rank {rank} timed out after {timeout_s:g} s (collective_timeout_s) and the "
            f"stuck rank could not be determined ({type(probe_exc).__name__}: {probe_exc}). Original error: "
            f"{exc}", None)
    if not missing:
        return CollectiveTimeoutError(
            f"a collective on rank {rank} timed out after {timeout_s:g} s (collective_timeout_s), but every rank "
            f"reported the same timeout: the ranks waited on each other (mismatched collectives: a rank-dependent "
            f"branch?) or on a slow network. Original error: {exc}", [])
    stuck = ", ".join(f"rank {r} ({where[r]})" for r in missing)
    return CollectiveTimeoutError(
        f"a collective timed out after {timeout_s:g} s (collective_timeout_s) because {stuck} never joined it: "
        f"that worker is stuck (a hung data read, a deadlock, a rank-dependent branch that skips a collective) "
        f"or too slow. `py-spy dump --pid PID` on its node shows where it waits; raise collective_timeout_s "
        f"if it is only slow. Seen on rank {rank}: {exc}", missing)


def _where(store, rank: int) -> str:
    key = _WHERE_KEY.format(rank=rank)
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:
        pass
    return "location unknown"


# ----------------------------------------------------------------------------- reports


def wait_until_report_collected(timeout_s: float = 300.0) -> None:
    """Call right after ``ray.train.report`` on every rank: returns once Ray Train's
    controller has taken this rank's report (or after ``timeout_s``, with a warning)."""
    try:
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
