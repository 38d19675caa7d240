"""Local ranks forked from one server that has torch imported: the suite's process groups without Ray.

A spawned rank imports torch again (3.6 CPU-s on the 2-core VM) and, through DDP's constructor,
``torch._dynamo`` (3.4 s more). The quick tier starts some two dozen such ranks. Here each pytest
process starts one :mod:`multiprocessing` forkserver, which imports :data:`PRELOAD` once; every
rank after that is a fork of it, with those modules already in memory.

Not a plain ``fork`` of the pytest process: that one may hold threads (Ray's, a progress poller)
and a Ray connection, which a fork copies half-way. The server is a fresh interpreter that has only
imported modules.

What a fork does not carry over: the environment. A forked rank has the server's, from when it
started, not this process's now (a test's ``monkeypatch.setenv``), so :func:`process` and
:func:`start_processes` hand each rank this process's environment as it is when the rank starts.
Settings the C library reads at a process's start (``MALLOC_*``) are set in the rank instead
(glibc's ``mallopt``: ``tests/test_fsdp_sharded_checkpoint.py``).

A forked rank ends with ``os._exit``, as every fork does, and never finalizes its interpreter. A
spawned one does, and a gloo group that FSDP2 has used keeps its threads past
``destroy_process_group`` (``fully_shard`` and one backward leave both ``pt_gloo_runloop`` threads
running). One still freeing the last collective's tensors then takes the GIL of a finalizing
interpreter, which ends that thread inside a destructor in ``std::terminate``: SIGABRT, "terminate
called without an active exception". Another reason to start local ranks here.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Sequence

# What the ranks import anyway: torch, its process groups, DDP's torch._dynamo, FSDP, the pipeline.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.nn.parallel", "raytrain_mgpu.engine.loop", "raytrain_mgpu.parallel.steps", "raytrain_mgpu.transports.actor_group.stage"]


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading :data:`PRELOAD` (started on first use)."""
    # Read when the server starts; the server runs until this process ends.
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def _call(environ: dict, target: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def process(target: Callable, args: Sequence = (), **kwargs) -> multiprocessing.process.BaseProcess:
    """``context().Process(target=target, args=args)``, run in this process's environment."""
    return context().Process(target=_call, args=(dict(os.environ), target, tuple(args)), **kwargs)


def _call_rank(rank: int, environ: dict, target: Callable, args: tuple) -> None:
    _call(environ, target, (rank, *args))


def start_processes(fn: Callable, args: Sequence = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (``fn(rank, *args)``, joined, a rank's
    exception raised here) with the ranks forked from the server."""
    import torch.multiprocessing as torch_mp

    context()  # the preload list, before torch's start_processes starts the server
    torch_mp.start_processes(_call_rank, args=(dict(os.environ), fn, tuple(args)), nprocs=nprocs,
                             start_method="forkserver")


def _in_gloo_group(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def start_gloo_ranks(fn: Callable, args: Sequence = (), nprocs: int = 2) -> None:
    """:func:`start_processes` of ``fn(rank, world, *args)``, each rank inside a gloo process group of all
    ``nprocs`` (over loopback, one torch thread a rank): the suite's process groups without Ray."""
    from raytrain_mgpu.transports.placement import free_address

    start_processes(_in_gloo_group, (nprocs, free_address()[1], fn, tuple(args)), nprocs=nprocs)
