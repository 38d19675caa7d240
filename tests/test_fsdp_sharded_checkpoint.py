"""fsdp's sharded checkpoints: no rank holds the full state while saving; a resume on 4 workers is exact,
on 2 it reshards to the same full state; the driver consolidates the model.

Four local processes (gloo ranks forked by ``tests/_forkserver.py``, no Ray) shard an MLP with AdamW as the
loop does (``DataParallelSteps.setup_model``), take a step, and save with ``FSDPReplication.save_sharded``, each
rank into its own folder, as each Ray Train worker does; the folders are then merged, as Ray Train's upload of
every rank's folder into one checkpoint does (through Ray: ``tests/test_strategies.py``'s fsdp fit). The peak
resident set size growth during the save is measured as ``tests/test_fsdp_memory.py`` measures start-up; the
old way (the full state gathered to rank 0) is measured too, so the measure is shown to see it.

DCP's asynchronous save returns before its files are written: measured with each rank's storage writer slowed on
purpose, directly and through the engine's save where ``RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE`` asks for it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time

import pytest
import torch
import torch.distributed as dist

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.parallel import build_worker
from raytrain_mgpu.checkpointing import files as ckpt_format
from _reference import build_rank_model as _build_model
from raytrain_mgpu.strategies import WorkerContext, get_strategy

import _forkserver
from test_fsdp_memory import _PeakGrowth

pytestmark = pytest.mark.slow  # 6 ranks, each an FSDP model of 48 MiB

# 12 blocks of 1024x1024 (4 MiB each): 48 MiB of parameters, 144 MiB with AdamW's two moments; a rank's
# share on 4 workers is a quarter of that.
INPUT_SHAPE, NUM_CLASSES = (1, 32, 32), 10
CFG = dict(model="mlp", dataset="synthetic", strategy="fsdp", batch_size=8, seed=3, optimizer="adamw", lr=1e-3,
           model_kwargs={"widths": [1024] * 12})


def _setup(rank: int, world: int):
    cfg = TrainConfig(**CFG, num_workers=world)
    ctx = WorkerContext(rank, world, rank, world, 0, (torch.device("cpu"),))
    strategy = build_worker(get_strategy("fsdp"), cfg.parallel, ctx)
    model = strategy.setup_model(_build_model(cfg, strategy, INPUT_SHAPE, NUM_CLASSES))
    return strategy, model, build_optimizer(model.parameters(), cfg.optim)


def _step(strategy, model, optimizer, seed: int) -> None:
    """One AdamW step on this rank's slice of a global batch fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, *INPUT_SHAPE, generator=generator), torch.randint(0, NUM_CLASSES, (8,), generator=generator)
    rank, world = strategy.ctx.world_rank, strategy.ctx.world_size
    per = 8 // world
    mine = slice(rank * per, (rank + 1) * per)
    loss, _ = strategy.placement.compute_loss(strategy, model, x[mine], y[mine])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_bytes(model, optimizer) -> int:
    """This rank's share: its parameter shards and their optimizer state."""
    params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    moments = sum(v.to_local().numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    return params + moments


def _locals(model, optimizer) -> list:
    return ([p.to_local().clone() for p in model.parameters()] +
            [v.to_local().clone() for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0])


def _mmap_every_tensor() -> None:
    """glibc serves a large allocation from its own mapping, returned on free, only below a threshold it
    raises after each free (up to 32 MiB): freed tensors then stay resident and hide later growth. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` sets at a process's start) keeps
    every tensor over 64 KiB in a mapping of its own, so the resident set is the tensors alive."""
    import ctypes

    m_mmap_threshold = -3  # glibc's malloc.h
    assert ctypes.CDLL(None).mallopt(m_mmap_threshold, 65536) == 1


SLOW_WRITE_S = 2.0
"""How long each rank's storage writer waits before it writes a checkpoint's files, where a test slows it: an
asynchronous save returns before that, a synchronous one after it."""


def _slowed_writes():
    """DCP's file writer, slowed by ``SLOW_WRITE_S`` in this rank's process; returns what puts it back."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def slowed(self, plan, planner):
        time.sleep(SLOW_WRITE_S)
        return write(self, plan, planner)

    FileSystemWriter.write_data = slowed
    return lambda: setattr(FileSystemWriter, "write_data", write)


def _save_on_four(rank: int, world: int, out: str) -> None:
    _mmap_every_tensor()
    strategy, model, optimizer = _setup(rank, world)
    _step(strategy, model, optimizer, seed=0)
    own = os.path.join(out, f"rank{rank}")  # each Ray Train worker's own local folder
    with _PeakGrowth() as sharded:
        strategy.replication.save_sharded(model, optimizer, os.path.join(own, ckpt_format.SHARDED_DIR))
    with _PeakGrowth() as gathered:  # the old checkpoint: the full model and optimizer state on rank 0
        replication = strategy.replication
        full = replication.state_dict(model), replication.optimizer_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": full[0]}, os.path.join(out, "full_after_step0.pt"))
    del full
    # DCP's asynchronous save, as every save but a run's last: back once the shards are in host memory, its
    # writes (slowed here) in a thread of their own.
    restore = _slowed_writes()
    began = time.perf_counter()
    writing = strategy.replication.save_sharded(model, optimizer,
                                                os.path.join(out, f"async{rank}", ckpt_format.SHARDED_DIR),
                                                asynchronous=True)
    returned, written_at_return = time.perf_counter() - began, writing.done()
    writing.result()
    written = time.perf_counter() - began
    restore()
    dist.barrier()
    if rank == 0:  # what Ray Train's upload of every rank's folder into one checkpoint folder makes
        for r in range(world):
            shutil.copytree(os.path.join(out, f"rank{r}"), os.path.join(out, "merged"), dirs_exist_ok=True)
            shutil.copytree(os.path.join(out, f"async{r}"), os.path.join(out, "merged-async"), dirs_exist_ok=True)
    dist.barrier()
    saved = _locals(model, optimizer)
    _step(strategy, model, optimizer, seed=1)
    # A restart on 4 workers: fresh shards and optimizer, loaded from the merged folder.
    restarted, restarted_model, restarted_optimizer = _setup(rank, world)
    restarted.replication.load_sharded(restarted_model, restarted_optimizer,
                                       os.path.join(out, "merged", ckpt_format.SHARDED_DIR))
    same_shards = all(torch.equal(a, b) for a, b in zip(saved, _locals(restarted_model, restarted_optimizer)))
    _step(restarted, restarted_model, restarted_optimizer, seed=1)
    same_next_step = all(torch.equal(a.to_local(), b.to_local())
                         for a, b in zip(model.parameters(), restarted_model.parameters()))
    # A second asynchronous save, after that step: its host copy goes into the first one's buffers.
    staged = _staged(strategy)
    strategy.replication.save_sharded(model, optimizer, os.path.join(out, f"async2-{rank}", ckpt_format.SHARDED_DIR),
                                      asynchronous=True).result()
    reused = bool(staged) and staged == _staged(strategy)
    strategy.replication.save_sharded(model, optimizer, os.path.join(out, f"sync2-{rank}", ckpt_format.SHARDED_DIR))
    dist.barrier()
    if rank == 0:
        for r in range(world):
            for kind in ("async2", "sync2"):
                shutil.copytree(os.path.join(out, f"{kind}-{r}"), os.path.join(out, f"merged-{kind}"),
                                dirs_exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"staging_reused": reused, "save_growth": sharded.peak, "gather_growth": gathered.peak,
                   "share": _local_bytes(model, optimizer), "same_shards": same_shards,
                   "same_next_step": same_next_step, "async_returned_s": returned, "async_written_s": written,
                   "async_written_at_return": written_at_return,
                   "files": sorted(os.listdir(os.path.join(own, ckpt_format.SHARDED_DIR)))}, f)


def _staged(strategy) -> list:
    """Where the asynchronous saves' stager keeps its host copies (torch's cache of staged storages)."""
    stager = strategy.replication._staging
    return sorted(s.data_ptr() for s in stager._state_dict_stager._cached_storage_mapping.values())


def _resume_on_two(rank: int, world: int, out: str) -> None:
    strategy, model, optimizer = _setup(rank, world)
    strategy.replication.load_sharded(model, optimizer, os.path.join(out, "merged", ckpt_format.SHARDED_DIR))
    full = strategy.replication.state_dict(model)  # collective: gathered to rank 0
    steps = {s["step"].item() for s in optimizer.state.values()}
    if rank == 0:
        torch.save({"model": full, "adam_steps": sorted(steps)}, os.path.join(out, "resumed_on_two.pt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_sharded")
    # Forked, not spawned: a spawned rank finalizes its interpreter at exit while FSDP2's gloo threads still
    # run (tests/_forkserver.py), which aborted 3 in 50 spawned runs of the resume on two.
    _forkserver.start_gloo_ranks(_save_on_four, (str(out),), nprocs=4)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return out, ranks


def test_every_rank_writes_only_its_own_shards_and_rank_0_the_metadata(saved):
    _, ranks = saved
    assert [r["files"] for r in ranks] == [[".metadata", "__0_0.distcp"], ["__1_0.distcp"], ["__2_0.distcp"],
                                           ["__3_0.distcp"]]


def test_no_rank_holds_the_full_state_while_saving(saved):
    """Issue 26: peak memory a rank adds during its checkpoint <= a quarter of its share of the state, where
    the gathered checkpoint adds the whole state (4 shares) on rank 0: the measure sees that one."""
    _, ranks = saved
    full_state = sum(r["share"] for r in ranks)
    assert full_state > 140 * 2**20
    for rank, r in enumerate(ranks):
        assert r["save_growth"] <= 0.25 * r["share"], (rank, r["save_growth"], r["share"])
    assert ranks[0]["gather_growth"] >= 0.9 * full_state, (ranks[0]["gather_growth"], full_state)


def test_a_restart_on_four_workers_resumes_exactly(saved):
    _, ranks = saved
    assert all(r["same_shards"] for r in ranks)  # every parameter shard and AdamW moment, bit for bit
    assert all(r["same_next_step"] for r in ranks)  # and the step after (AdamW's step count came back too)


def test_a_restart_on_two_workers_reshards_to_the_same_state(saved):
    out, _ = saved
    _forkserver.start_gloo_ranks(_resume_on_two, (str(out),), nprocs=2)
    resumed = torch.load(out / "resumed_on_two.pt", weights_only=True)
    want = torch.load(out / "full_after_step0.pt", weights_only=True)["model"]
    assert resumed["model"].keys() == want.keys()
    assert all(torch.equal(resumed["model"][k], want[k]) for k in want)
    assert resumed["adam_steps"] == [1.0]


def test_the_driver_consolidates_the_model_from_every_ranks_files(saved):
    out, _ = saved
    got = ckpt_format.load_model_state(str(out / "merged"))
    want = torch.load(out / "full_after_step0.pt", weights_only=True)["model"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(k.startswith("optimizer") for k in got)


def test_the_asynchronous_save_writes_the_same_checkpoint(saved):
    """Every save but a run's last is DCP's async_save (its writing thread coordinates over a gloo group of
    its own); what it writes consolidates to the synchronous save's model, once the Future is done."""
    out, ranks = saved
    got = ckpt_format.load_model_state(str(out / "merged-async"))
    want = ckpt_format.load_model_state(str(out / "merged"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    print("async save, per rank: returned after", [round(r["async_returned_s"], 3) for r in ranks],
          "s, written after", [round(r["async_written_s"], 3) for r in ranks], "s")
    # The writer took SLOW_WRITE_S before it wrote: the save came back before that, its Future not done yet.
    for r in ranks:
        assert r["async_returned_s"] < SLOW_WRITE_S <= r["async_written_s"] and not r["async_written_at_return"], r


class _WritingLeftOpen:
    """A run folder store (tests/_engine.py's transport's) that lets a sharded save go on writing after the save
    returns, as Ray Train's does for every save but a run's last; it keeps the save's Future (``writing``) and
    publishes nothing."""

    def __init__(self, store):
        self.store, self.writing = store, None

    def __getattr__(self, name):
        return getattr(self.store, name)

    def asynchronous(self, step: bool, final: bool) -> bool:
        return True

    def commit(self, commit) -> None:
        self.writing = commit.writing


def _engine_saves(rank: int, world: int, out: str) -> None:
    """The engine's save of a 2-rank fsdp run with the switch on, then unset; each rank's storage writer slowed."""
    from _engine import make_engine

    from raytrain_mgpu.checkpointing.contents import ASYNC_SHARDED_ENV

    engine = make_engine(dict(model="mlp", model_kwargs={"widths": [32]}, dataset="digits", batch_size=64,
                              epochs=2, strategy="fsdp", storage_path=out), rank=rank, world=world, setup=False)
    store = _WritingLeftOpen(engine.transport.checkpoint_store())
    engine.transport.checkpoint_store = lambda: store
    engine.setup()
    _slowed_writes()
    saves = {}
    for switch in ("on", "off"):  # read by every save (the driver's value reaches each worker)
        if switch == "on":
            os.environ[ASYNC_SHARDED_ENV] = "1"
        else:
            os.environ.pop(ASYNC_SHARDED_ENV, None)
        store.writing = None
        began = time.perf_counter()
        engine.checkpoints.saver.save({"epoch": 1})  # in the training thread, as after an epoch
        returned = time.perf_counter() - began
        writing = store.writing
        saves[switch] = {"returned_s": returned, "future": writing is not None,
                         "written_at_return": writing is None or writing.done()}
        if writing is not None:
            writing.result()
        saves[switch]["written_s"] = time.perf_counter() - began
    with open(os.path.join(out, f"engine{rank}.json"), "w") as f:
        json.dump(saves, f)


def test_the_engines_sharded_save_returns_before_its_write_where_the_switch_asks_for_it(tmp_path):
    """``RAYTRAIN_MGPU_ASYNC_SHARDED_SAVE=1`` and a store that allows it: the engine's save returns to the training
    thread before its (slowed) write is done; unset, it returns once the write is done."""
    _forkserver.start_gloo_ranks(_engine_saves, (str(tmp_path),))
    for rank in range(2):
        saves = json.loads((tmp_path / f"engine{rank}.json").read_text())
        on, off = saves["on"], saves["off"]
        assert on["future"] and not on["written_at_return"], (rank, on)
        assert on["returned_s"] < SLOW_WRITE_S <= on["written_s"], (rank, on)
        assert not off["future"] and off["returned_s"] >= SLOW_WRITE_S, (rank, off)


def test_a_later_asynchronous_save_reuses_the_host_buffers_and_writes_the_new_state(saved):
    """The second asynchronous save (after a step) copies into the buffers the first one made, and what it writes
    is the synchronous save's checkpoint of the same state, not the first save's."""
    out, ranks = saved
    assert all(r["staging_reused"] for r in ranks)
    later, now = (ckpt_format.load_model_state(str(out / f"merged-{kind}")) for kind in ("async2", "sync2"))
    first = ckpt_format.load_model_state(str(out / "merged-async"))
    assert later.keys() == now.keys() and all(torch.equal(later[k], now[k]) for k in now)
    assert not all(torch.equal(first[k], now[k]) for k in now)


def test_the_kept_stager_pins_and_copies_without_blocking_only_for_shards_on_a_gpu(monkeypatch):
    """The GPU choice of ``FSDPReplication._stager`` (CI has no CUDA to pin with): DCP's options as built."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint import staging

    from raytrain_mgpu.parallel.replication import FSDPReplication

    built = []
    monkeypatch.setattr(staging, "DefaultStager",
                        lambda options: built.append(options) or SimpleNamespace(close=lambda: None))
    for device in ("cuda", "cpu"):
        model = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device(device))])
        replication = FSDPReplication()
        assert replication._stager(model) is replication._stager(model)  # one stager a worker, built once
    assert [(o.use_pinned_memory, o.use_non_blocking_copy, o.use_shared_memory, o.use_async_staging)
            for o in built] == [(True, True, False, False), (False, False, False, False)]


def _run_with(folder, tmp_path):
    """A run folder holding ``folder`` as its one checkpoint (sharded, as Ray Train's upload leaves it)."""
    from raytrain_mgpu.checkpointing.run_folder import RunFolder

    run = tmp_path / "run"
    shutil.copytree(folder, run / "checkpoint_2026-11-26_00-00-00.000000")
    (run / "checkpoint_2026-11-26_00-00-00.000000" / ckpt_format.META_FILE).write_text(
        json.dumps({"epoch": 1, "step": 1, ckpt_format.SHARDED_KEY: True}))
    return RunFolder(str(run)), run / "checkpoint_2026-11-26_00-00-00.000000" / ckpt_format.SHARDED_DIR


def test_a_sharded_checkpoint_is_complete_only_with_every_file_its_metadata_names(saved, tmp_path):
    out, _ = saved
    folder, shards = _run_with(out / "merged", tmp_path)
    assert [c.meta["step"] for c in folder.checkpoints()] == [1]
    (shards / "__3_0.distcp").unlink()  # a rank whose upload has not landed yet
    assert folder.checkpoints() == []
    (shards / ".metadata").unlink()  # rank 0's meta.json landed before its .metadata
    assert folder.checkpoints() == []


def test_a_missing_rank_file_is_named_not_loaded(saved, tmp_path):
    out, _ = saved
    partial = tmp_path / "partial"
    shutil.copytree(out / "merged", partial)
    (partial / ckpt_format.SHARDED_DIR / "__2_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"cannot be read .* it may be incomplete"):
        ckpt_format.load_model_state(str(partial))


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def test_a_planted_metadata_file_is_refused_without_running_it(saved, tmp_path):
    out, _ = saved
    planted = tmp_path / "planted"
    shutil.copytree(out / "merged", planted)
    (planted / ckpt_format.SHARDED_DIR / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with pytest.raises(ValueError, match=r"\.metadata' holds objects other than .*posix.system.* refused without "
                                         r"running it"):
        ckpt_format.load_model_state(str(planted))
