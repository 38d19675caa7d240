"""fsdp never holds the full model on a rank other than 0, and starts from the 1-worker weights.

Two local processes (gloo, ``torch.multiprocessing``, no Ray) build the model as the loop
does (the engine's ``build_model``: the seed, then ``meta`` where the strategy asks for it) and
shard it (``FSDPStrategy.setup_model``). On CPU the compute device is the process's own
memory, so the peak resident set size growth over build + setup is the device peak: rank
1 must stay well below the unsharded model, while rank 0 (which builds the full model on
the CPU and sends it) shows the full size, so the measure can tell the two apart.
"""

from __future__ import annotations

import json
import os
import resource
import threading

import pytest
import torch

import _forkserver
from raytrain_mgpu.config.train import TrainConfig
from _reference import build_rank_model as _build_model
from raytrain_mgpu.planning.memory import device_memory, profile_model
from raytrain_mgpu.models import build_model
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.strategies import WorkerContext, get_strategy

# 32 blocks of 1024x1024 (4 MiB each, 128 MiB in all): the largest tensor, which crosses in full at
# start-up, is small next to a shard.
INPUT_SHAPE, NUM_CLASSES = (1, 32, 32), 10
CFG = dict(model="mlp", dataset="synthetic", strategy="fsdp", num_workers=2, batch_size=8, seed=3,
           model_kwargs={"widths": [1024] * 32})


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _PeakGrowth:
    """The highest resident set size above the start, sampled every millisecond in a thread.

    ``ru_maxrss`` is the process's high-water mark since it started: a spike before the
    measurement (seen once on CI: the import of torch's CUDA build) hides any growth.
    """

    def __enter__(self):
        self.start, self.peak, self._stop = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss() - self.start)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss() - self.start)


def _worker(rank: int, world: int, out_dir: str) -> None:
    cfg = TrainConfig(**CFG)
    ctx = WorkerContext(rank, world, rank, world, 0, (torch.device("cpu"),))
    strategy = build_worker(get_strategy("fsdp"), cfg.parallel, ctx)
    # Warm-up on a tiny model: torch's first fully_shard imports and initialises ~100 MB of its
    # own (the framework's memory, which memory.py leaves out too); the big model is measured after.
    strategy.setup_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with _PeakGrowth() as measured:
        model = strategy.setup_model(_build_model(cfg, strategy, INPUT_SHAPE, NUM_CLASSES))
    growth = measured.peak
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full = strategy.replication.state_dict(strategy.unwrap(model))  # collective; the full state on rank 0
    if rank == 0:
        torch.save(full, os.path.join(out_dir, "fsdp_initial.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rss_growth": growth, "local_param_bytes": local, "built_on_meta": strategy.build_on_meta()}, f)


@pytest.fixture(scope="module")
def fsdp_start(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp_memory")
    _forkserver.start_gloo_ranks(_worker, (str(out_dir),))
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, torch.load(out_dir / "fsdp_initial.pt", weights_only=True)


def _full_model():
    torch.manual_seed(CFG["seed"])
    return build_model("mlp", INPUT_SHAPE, NUM_CLASSES, CFG["model_kwargs"])


def test_rank1_peak_stays_below_the_unsharded_model(fsdp_start):
    ranks, _ = fsdp_start
    full_bytes = sum(p.numel() * p.element_size() for p in _full_model().parameters())
    assert full_bytes > 120 * 2**20
    assert [r["built_on_meta"] for r in ranks] == [False, True]
    for r in ranks:  # each rank keeps half of the parameters (plus padding of uneven splits)
        assert r["local_param_bytes"] <= full_bytes / 2 + 4096
    # rank 1: its shards (1/2) and one 4 MiB tensor in flight, never the whole model
    assert ranks[1]["rss_growth"] < 0.75 * full_bytes, (ranks[1]["rss_growth"], full_bytes)
    # rank 0 built the whole model on the CPU: the same measure sees it
    assert ranks[0]["rss_growth"] > full_bytes, (ranks[0]["rss_growth"], full_bytes)


def test_initial_weights_are_the_one_worker_weights(fsdp_start):
    _, got = fsdp_start
    want = _full_model().state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_estimate_counts_shards_not_the_full_model():
    """``memory.device_memory``: fsdp's per-device state is a share of the model's, at any world size."""
    cfg = TrainConfig(**CFG)
    with torch.device("meta"):
        profile = profile_model(_full_model(), INPUT_SHAPE, cfg.optimizer, cfg.momentum)
    ddp = device_memory("ddp", cfg, profile)[0].fixed
    for workers in (2, 4):
        fsdp = device_memory("fsdp", cfg.replace(num_workers=workers), profile)
        assert len(fsdp) == workers and fsdp[0].fixed < ddp
        assert fsdp[0].fixed >= profile.state_bytes() / workers + max(profile.block_param_bytes)


def test_with_cpu_offload_the_estimate_is_two_blocks_whatever_the_workers():
    """``cpu_offload``: shards, gradients and optimizer state live on the host, so a device holds one block
    gathered whole with its gradients (the estimate ``auto`` and the memory check use)."""
    cfg = TrainConfig(**CFG)
    with torch.device("meta"):
        profile = profile_model(_full_model(), INPUT_SHAPE, cfg.optimizer, cfg.momentum)
    for workers in (2, 4):
        sharded = device_memory("fsdp", cfg.replace(num_workers=workers), profile)[0].fixed
        offloaded = device_memory("fsdp", cfg.replace(num_workers=workers, cpu_offload=True), profile)[0].fixed
        assert offloaded == 2 * max(profile.block_param_bytes) < sharded
