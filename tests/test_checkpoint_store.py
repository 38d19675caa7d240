"""The checkpoint store (``checkpointing/store.py``): one owner of a checkpoint's life on a rank, whichever transport
carries the run, and the engine's checkpoint parts handed what they save, not the engine. No Ray."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import torch

from _engine import make_engine
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.contents import Commit, checkpoint_name
from raytrain_mgpu.checkpointing.run_folder import PUBLISHED_KEY, RunFolder
from raytrain_mgpu.checkpointing.store import CheckpointSource, CheckpointStore, FolderStore
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.engine.loop import Engine
from raytrain_mgpu.engine.run_state import RunState, checkpoint_meta
from raytrain_mgpu.transports.base import Transport

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_mgpu"
STORES = {"checkpointing/store.py", "transports/ray_train/store.py"}
LIFECYCLE = {"seal", "publish", "save_best", "prune"}


def _calls(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None))
    return names


def test_only_the_stores_seal_publish_copy_the_best_and_prune():
    """A transport or the engine that sealed, published, copied the best or pruned itself would be a second owner
    (``RunFolder.save_best`` publishes its own copy: the one call inside ``run_folder.py``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = str(path.relative_to(PACKAGE))
        if relative in STORES or relative == "checkpointing/run_folder.py" or relative.startswith("bench/"):
            continue
        calls = _calls(path) & LIFECYCLE
        if calls:
            found[relative] = sorted(calls)
    assert not found, found


def test_a_transport_hands_a_store_and_has_no_checkpoint_methods_of_its_own():
    assert not {"begin", "commit", "abort", "registered", "asynchronous"} & set(vars(Transport))
    assert "checkpoint_store" in vars(Transport)


def test_the_checkpoint_parts_hold_what_they_save_not_the_engine(tmp_path):
    engine = make_engine(dict(model="mlp", model_kwargs={"widths": [4]}, dataset="digits", num_samples=64,
                              batch_size=16, epochs=1), storage=str(tmp_path))
    manager = engine.checkpoints
    parts = [manager, manager.saver, manager.triggers, manager.store]
    held = [(type(part).__name__, name) for part in parts for name, value in vars(part).items()
            if isinstance(value, Engine)]
    assert not held, held
    saver = manager.saver
    assert (saver.optimizer, saver.scheduler, saver.scaler, saver.state, saver.steps) == (
        engine.optimizer, engine.scheduler, engine.scaler, engine.state, engine.steps)
    assert isinstance(manager.store, FolderStore)


def _save(store: FolderStore, cfg, epoch: int) -> None:
    history = [{"epoch": e, "step": 10 * e} for e in range(1, epoch + 1)]
    state = RunState(epoch=epoch, step=10 * epoch, history=history)
    name = checkpoint_name(epoch)
    directory = store.begin(name, history[-1], step=False, final=False, sharded=False)
    ckpt_format.write_checkpoint(directory, meta=None, history=history, model_state={"w": torch.full((2,), 1.0)})
    store.commit(Commit(name, directory, history[-1], checkpoint_meta(cfg, state, {}), False, None, None, False, False))


def test_the_run_folders_store_publishes_prunes_and_names_the_newest(tmp_path):
    cfg = TrainConfig(storage_path=str(tmp_path), name="run", num_checkpoints_to_keep=2)
    store = FolderStore(cfg, 0, "attempt0")
    assert store.newest() is None  # a new run
    for epoch in (1, 2, 3):
        _save(store, cfg, epoch)
    folder = RunFolder.of(cfg)
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000002", "checkpoint_epoch000003"]
    newest = store.newest()
    assert isinstance(newest, CheckpointSource) and newest.path == str(tmp_path / "run" / "checkpoint_epoch000003")
    with newest.open() as directory:
        assert json.loads((Path(directory) / "meta.json").read_text())[PUBLISHED_KEY] is True


def test_a_store_resumes_from_what_its_own_system_registered_where_that_is_the_newest(tmp_path):
    """A Ray Train store's registered checkpoint (stood in for here) is read through that system's own access; a
    checkpoint it never registered is no resume point."""
    cfg = TrainConfig(storage_path=str(tmp_path), name="run")
    _save(FolderStore(cfg, 0, "attempt0"), cfg, 1)
    unregistered = tmp_path / "run" / checkpoint_name(2)  # complete, but its system never took it
    ckpt_format.write_checkpoint(str(unregistered), meta=checkpoint_meta(cfg, RunState(epoch=2, step=20), {}),
                                 history=[])

    class Registered(CheckpointStore):
        def __init__(self, path):
            super().__init__(cfg, 0)
            self.source = None if path is None else CheckpointSource(path, lambda: "through its own storage")

        def registered(self):
            return self.source

    assert Registered(None).newest().path == str(tmp_path / "run" / checkpoint_name(1))  # the published one
    registered = Registered(str(unregistered))
    assert registered.newest() is registered.source  # further than the published one: read its own way
