"""Collective timeouts that say which rank is stuck: every transport's ranks (Ray Train's workers, the pipeline's
stages) run under :func:`name_stuck_ranks`.

When one rank stalls (a hung data read, a rank-dependent branch that skips a collective), the others block in their
next collective until the process group's timeout (``TrainConfig.collective_timeout_s``) and gloo then reports, on the
ranks that *waited*::

    RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms
    for recv operation to complete

naming neither the stuck rank nor where it runs, and Ray shows that error under the waiting rank's number. Each rank
registers its node and PID in the process group's store at start (one store write), and a rank whose collective times
out checks in and waits a short grace period for the others to do the same. Ranks that never check in are the stuck
ones; the error names them with node and PID, so ``py-spy dump --pid`` on that node shows where they hang.

The store is the c10d TCPStore the process group was created with. Its server runs in a background thread of rank 0,
so it answers even when rank 0's Python code is the one that is stuck. NCCL is different: its watchdog aborts the
process on a timeout before Python sees an error, so this only helps for gloo (CPU) groups; for NCCL use
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` (the flight recorder names the stuck collective). A rank that stops making progress
without any collective timing out is named by the driver's heartbeat judge instead (``engine/liveness.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, List, Optional

import torch.distributed as dist

from raytrain_mgpu.transports.placement import node_ip as _node_ip

logger = logging.getLogger(__name__)

__all__ = ["CollectiveTimeoutError", "name_stuck_ranks"]

_WHERE_KEY = "raytrain_mgpu/where/{rank}"
_CHECKIN_KEY = "raytrain_mgpu/timed_out/{rank}"


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out because the ranks in ``stuck_ranks`` never joined it."""

    def __init__(self, message: str, stuck_ranks: Optional[List[int]] = None):
        super().__init__(message)
        self.stuck_ranks = stuck_ranks

    def __reduce__(self):  # Ray pickles it from the worker to the driver (notes and fields in its __dict__)
        return type(self), (str(self), self.stuck_ranks), self.__dict__


def name_stuck_ranks(timeout_of: Callable[..., float]) -> Callable[[Callable], Callable]:
    """Decorate a rank's entry point (a Ray Train worker function, a pipeline stage's ``run``), whose process group
    is formed when it is called; ``timeout_of(*args)``: the group's ``collective_timeout_s``."""

    def decorate(entry: Callable) -> Callable:
        @functools.wraps(entry)
        def wrapper(*args, **kwargs):
            store, rank, world_size = _register()
            try:
                return entry(*args, **kwargs)
            except RuntimeError as exc:
                if store is None or world_size < 2 or isinstance(exc, CollectiveTimeoutError) or not _is_timeout(exc):
                    raise
                raise _stuck_rank_error(exc, store, rank, world_size, float(timeout_of(*args))) from exc

        return wrapper

    return decorate


def _register():
    """Record this rank's node and PID in the store; (store, rank, world size) or Nones."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        store = dist.distributed_c10d._get_default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        store.set(_WHERE_KEY.format(rank=rank), f"node {_node_ip()}, pid {os.getpid()}")
        return store, rank, world_size
    except Exception as exc:  # a diagnostic aid must never stop training
        logger.debug("stuck-rank detection disabled: %s", exc)
        return None, 0, 1


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
