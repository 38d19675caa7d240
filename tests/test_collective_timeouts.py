"""A collective that times out names the rank that never joined it (``transports/collective_timeouts.py``), on any
transport's ranks: two local gloo ranks (no Ray), rank 1 stuck outside any collective, rank 0 waiting in an
all-reduce with a 2 s group timeout. (The same through Ray Train: ``tests/test_faults.py``; the pipeline stage's and
the Ray Train worker's entry points carry the decorator: ``tests/test_wiring.py``.)"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import _forkserver
from raytrain_mgpu.transports.placement import free_address

TIMEOUT_S = 2.0


def _rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_mgpu.transports.collective_timeouts import name_stuck_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))

    @name_stuck_ranks(lambda: TIMEOUT_S)
    def entry():
        if rank == 1:
            time.sleep(10.0)  # stuck: past rank 0's timeout and its grace for check-ins (5 s)
            return
        dist.all_reduce(torch.ones(1))

    try:
        entry()
    except RuntimeError as exc:
        with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def test_a_collective_timeout_names_the_rank_that_never_joined_it(tmp_path):
    _forkserver.start_processes(_rank, (free_address()[1], str(tmp_path)), nprocs=2)
    error = (tmp_path / "error-0.txt").read_text()
    assert error.startswith("CollectiveTimeoutError: a collective timed out after 2 s"), error
    assert "because rank 1 (node 127.0.0.1, pid " in error and "never joined it" in error, error
    assert not (tmp_path / "error-1.txt").exists()
