"""The pipeline benchmark's baseline: the same model, partition and schedule under ``torchrun``
with ``torch.distributed.pipelining`` (``PipelineStage`` + torch's ``Schedule*`` classes).

:class:`TorchrunPipeline` (in the benchmark's process) starts ``torchrun`` with this module
as every rank's program; ranks wait between timed rounds for a control file from the
driver (no CPU used while waiting), so they can be interleaved with the other variants.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.engine.optim import build_optimizer

POLL_S = 0.01
START_TIMEOUT_S = 600.0


def _write_atomically(path: Path, text: str) -> None:
    """The reader polls for ``path``: it must never see it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def seeded_loader(cfg: TrainConfig, data) -> DataLoader:
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True)
    return DataLoader(data.train, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)


class TorchrunPipeline:
    """The same model and partition under torchrun + torch.distributed.pipelining.

    Ranks wait between rounds for a file from the driver (no CPU used while waiting).
    """

    def __init__(self, cfg: TrainConfig, counts: List[int], warmup: int, control: Path):
        from raytrain_mgpu.transports.actor_group.stage import free_address

        self.control = control
        control.mkdir(parents=True)
        spec = json.dumps({"cfg": cfg.to_dict(), "counts": counts, "warmup": warmup, "control": str(control)})
        self.log = control / "output.txt"  # a file, not a pipe: a full pipe would stall the ranks
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.num_stages}",
                 f"--master_port={free_address()[1]}", "-m", "raytrain_mgpu.bench._torchrun_pipeline",
                 "--torchrun-worker", spec],
                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group: close() can end the ranks too
        self.round = 0

    def _wait_for(self, name: str) -> str:
        path = self.control / name
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"torchrun baseline exited ({self.process.returncode}):\n"
                                   f"{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun baseline: no {name} after {START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        return path.read_text()

    def ready(self) -> None:
        self._wait_for("ready")

    def run(self, steps: int) -> float:
        _write_atomically(self.control / f"go-{self.round}", str(steps))
        result = float(self._wait_for(f"done-{self.round}"))
        self.round += 1
        return result

    def close(self) -> None:
        for index in (self.round, self.round + 1):  # whichever round the ranks wait for: 0 steps, exit
            _write_atomically(self.control / f"go-{index}", "0")
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


def _torchrun_worker(spec: dict) -> None:
    """One torchrun rank: the stage of ``counts`` it owns, run by torch's own schedule."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from raytrain_mgpu.models.partition import blocks_of, build_stage_modules, plan_partition
    from raytrain_mgpu.pipeline.schedule import num_virtual_stages

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, control = TrainConfig(**spec["cfg"]), Path(spec["control"])
    data = build_datasets(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    num_stages = num_virtual_stages(cfg.schedule, world)  # chunk s lives on rank s % world, as in ours
    parts = build_stage_modules(model, plan_partition(blocks_of(model), num_stages, spec["counts"], log=False))
    mine = list(range(rank, num_stages, world))
    stages = [PipelineStage(parts[s], s, num_stages, torch.device("cpu")) for s in mine]
    if cfg.schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, cfg.num_microbatches, loss_fn=F.cross_entropy)
    else:
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
        schedule = schedule_class(stages[0], cfg.num_microbatches, loss_fn=F.cross_entropy)
    optimizer = build_optimizer([p for s in mine for p in parts[s].parameters()], cfg.optim)
    batches = iter(seeded_loader(cfg, data))

    def step():
        x, y = next(batches)  # every rank reads, as in torch's examples
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(spec["warmup"]):
            step()
        if rank == 0:
            _write_atomically(control / "ready", "1")
        for round_index in range(10**6):
            steps = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                go, deadline = control / f"go-{round_index}", time.monotonic() + START_TIMEOUT_S
                while not go.exists() and time.monotonic() < deadline:  # an orphan gives up
                    time.sleep(5 * POLL_S)  # not timed: polls only need to be cheap
                steps[0] = int(go.read_text() or 0) if go.exists() else 0
            dist.broadcast(steps, src=0)  # also the start line: every rank begins together
            if steps.item() == 0:
                break
            start = time.perf_counter()
            for _ in range(steps.item()):
                step()
            dist.barrier()
            if rank == 0:
                _write_atomically(control / f"done-{round_index}", str((time.perf_counter() - start) / steps.item()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # a torchrun rank
    _parser = argparse.ArgumentParser()
    _parser.add_argument("--torchrun-worker", required=True)
    _torchrun_worker(json.loads(_parser.parse_args().torchrun_worker))
