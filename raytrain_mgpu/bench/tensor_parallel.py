"""Tensor parallel against fsdp alone: per-rank parameters, peak memory and step time of a transformer LM.

    raytrain-mgpu bench-tensor-parallel [--layers 4] [--hidden 256] [--vocab 8192] [--seq-len 64] [--batch-size 8]
                                        [--steps 6]

Local gloo ranks on this machine's CPU (no Ray), one torch thread each; each layout builds the model as a Ray Train
worker does (the strategy's ``setup_model``) and takes AdamW steps on the same global batch: ``fsdp`` on 2 and 4
ranks, ``fsdp`` with ``tensor_parallel_size=2`` on 2 ranks (one tensor group) and on 4 (fsdp 2 x tensor 2). Per
rank: the parameter bytes it holds (its shards), its peak resident memory (the process's high-water mark, since it
started: on CPU there is no allocator peak to reset) and the median step time after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

from raytrain_mgpu._cli_options import renamed

LAYOUTS = ((2, 1), (2, 2), (4, 1), (4, 2))  # (ranks, tensor_parallel_size), all with FSDPStrategy


def _rank(rank: int, world: int, port: int, fields: dict, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.checkpointing.contents import build_model
    from raytrain_mgpu.engine.optim import build_optimizer
    from raytrain_mgpu.parallel import build_worker
    from raytrain_mgpu.strategies import WorkerContext, get_strategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = TrainConfig(**fields)
    strategy = build_worker(get_strategy(cfg.strategy), cfg.parallel,
                            WorkerContext(rank, world, rank, world, 0, (torch.device("cpu"),)))

    class _Rank:
        ctx = strategy.ctx
        build_on_meta = staticmethod(strategy.build_on_meta)

    shapes = type("Shapes", (), {"input_shape": tuple(cfg.input_shape), "num_classes": cfg.num_classes})
    model = strategy.setup_model(build_model(cfg, _Rank(), shapes))
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    replica, replicas = strategy.shard
    rows = cfg.batch_size // replicas
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.num_classes, (cfg.batch_size, cfg.input_shape[0] + 1), generator=generator)
    x, y = ids[replica * rows:(replica + 1) * rows, :-1], ids[replica * rows:(replica + 1) * rows, 1:]
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out, f"rank-{rank}.txt"), "w") as f:
        f.write(f"{local} {peak} {statistics.median(times[1:])}")
    dist.destroy_process_group()
    os._exit(0)  # a spawned gloo rank that used FSDP2 can abort while finalizing (tests/_forkserver.py)


def measure(strategy: str, world: int, tensor_parallel: int, fields: dict, steps: int) -> list:
    """``[(parameter bytes, peak RSS bytes, median step s)]`` per rank of one layout."""
    import torch.multiprocessing as mp

    from raytrain_mgpu.transports.placement import free_address

    fields = {**fields, "strategy": strategy, "num_workers": world, "tensor_parallel_size": tensor_parallel}
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, free_address()[1], fields, steps, out), nprocs=world,
                           start_method="spawn")
        rows = [open(os.path.join(out, f"rank-{r}.txt")).read().split() for r in range(world)]
    return [(int(a), int(b), float(c)) for a, b, c in rows]


_OPTIONS = (("--layers", 4, "transformer blocks"), ("--hidden", 256, "hidden size (8 heads)"),
            ("--vocab", 8192, "vocabulary size"), ("--seq-len", 64, "tokens per sample"),
            ("--batch-size", 8, "global batch, samples per step"),
            ("--steps", 6, "timed steps per layout, after one warm-up"))


def add_arguments(parser) -> None:
    added = {flag: parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
             for flag, default, text in _OPTIONS}
    renamed(parser, added["--batch-size"], "--batch")


def run_and_print(args) -> int:
    """One Markdown row per layout of ``LAYOUTS`` (docs/strategies.md's table)."""
    from raytrain_mgpu.strategies.fsdp import FSDPStrategy

    fields = dict(model="transformer_lm", dataset="synthetic_text", input_shape=[args.seq_len],
                  num_classes=args.vocab, batch_size=args.batch_size, optimizer="adamw", lr=1e-3,
                  model_kwargs={"num_layers": args.layers, "hidden": args.hidden, "num_heads": 8})
    print("| layout | ranks | parameters per rank | peak RSS per rank (max) | step (median of ranks) |")
    print("|---|---|---|---|---|")
    strategy = FSDPStrategy.name
    for world, tensor_parallel in LAYOUTS:
        rows = measure(strategy, world, tensor_parallel, fields, args.steps)
        name = strategy if tensor_parallel == 1 else f"{strategy} {world // tensor_parallel} x tensor {tensor_parallel}"
        print(f"| {name} | {world} | {max(r[0] for r in rows) / 2**20:.2f} MiB | "
              f"{max(r[1] for r in rows) / 2**20:.0f} MiB | {statistics.median(r[2] for r in rows) * 1000:.0f} ms |",
              flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_and_print(parser.parse_args(argv))


if __name__ == "__main__":
    main()
