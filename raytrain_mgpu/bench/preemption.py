"""What the preemption check costs a step: the loop's check and ``ray.train.get_preemption_info()``
timed against a plain step.

    raytrain-mgpu bench-preemption [--num-workers 2] [--calls 200] [--rounds 3]

The loop checks for a preemption notice every ``CHECK_EVERY_N_STEPS`` optimizer steps
(``checkpointing/preemption.py``): each rank reads the notice on its own worker and the ranks agree with
an all-reduce of one number; ``get_preemption_info()`` (a barrier over every rank through Ray
Train's synchronization actor) only once one has it. Here ``--num-workers`` Ray Train workers (gloo,
1 CPU each) run, side by side in one run:

- ``step``: a small DDP step (an MLP 784-256-10 on a random batch of 64), the baseline;
- ``check``: the loop's check (no notice: the all-reduce);
- ``get_preemption_info``: one call, what every check cost before (and what Ray's docs show).

Each check after a ``torch.distributed`` barrier so that every rank enters it together (the loop's
ranks are in step after the gradient all-reduce).

Each measured ``--calls`` times per round; rank 0's medians are printed, and the share of a step
that one check every N steps costs.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Dict, List

from raytrain_mgpu._cli_options import renamed


def _train_fn(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    from raytrain_mgpu.checkpointing.preemption import AnyRank
    from raytrain_mgpu.transports.preemption import ray_local_notice as _ray_local_notice

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    times: Dict[str, List[float]] = {"step": [], "check": [], "get_preemption_info": []}
    any_rank = AnyRank()
    for _ in range(config["rounds"]):
        for _ in range(config["calls"]):
            start = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times["step"].append(time.perf_counter() - start)
        for _ in range(config["calls"]):
            dist.barrier()
            start = time.perf_counter()
            any_rank(_ray_local_notice() is not None)
            times["check"].append(time.perf_counter() - start)
        for _ in range(config["calls"]):
            dist.barrier()
            start = time.perf_counter()
            ray.train.get_preemption_info()
            times["get_preemption_info"].append(time.perf_counter() - start)
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(times, f)


def run(args) -> Dict[str, List[float]]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-preempt-") as scratch:
            out = os.path.join(scratch, "times.json")
            TorchTrainer(_train_fn, train_loop_config={"calls": args.calls, "rounds": args.rounds, "out": out},
                         scaling_config=ScalingConfig(num_workers=args.num_workers),
                         run_config=RunConfig(storage_path=os.path.join(scratch, "storage"),
                                              name="bench-preemption")).fit()
            with open(out) as f:
                return json.load(f)
    finally:
        ray.shutdown()


def report(times: Dict[str, List[float]], every: int) -> str:
    step = statistics.median(times["step"])
    lines = [f"step (DDP, mlp 784-256-10, batch 64): {step * 1e3:.2f} ms (median)"]
    for label, key in (("the loop's check (no notice)", "check"), ("get_preemption_info", "get_preemption_info")):
        check, mean = statistics.median(times[key]), statistics.mean(times[key])
        per_step = check / every  # one check every `every` steps
        lines.append(f"{label}: {check * 1e3:.3f} ms (median; mean {mean * 1e3:.3f} ms); one every {every} steps: "
                     f"{per_step * 1e3:.4f} ms a step, {100 * per_step / step:.2f}% of this step; "
                     f"under 1% for steps over {100 * per_step * 1e3:.1f} ms")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    workers = parser.add_argument("--num-workers", type=int, default=2, help="Ray Train workers (1 CPU each)")
    renamed(parser, workers, "--workers")
    parser.add_argument("--calls", type=int, default=200, help="timed steps and timed checks per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of steps then checks")


def run_and_print(args) -> int:
    from raytrain_mgpu.checkpointing.preemption import CHECK_EVERY_N_STEPS

    print(f"preemption check: {args.num_workers} Ray Train worker(s), gloo, {args.calls} calls x {args.rounds} "
          f"round(s), {os.cpu_count()} CPU cores")
    print(report(run(args), CHECK_EVERY_N_STEPS))
    return 0
