"""The run folder both runners share (``checkpointing/run_folder.py``): paths and URIs, the one
checkpoint scanner, the run state, history, and checkpoints published on a filesystem and on
an object store that cannot rename folders. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.run_folder import RAY_TRAIN_SNAPSHOT, RunFolder
from raytrain_mgpu.engine.run_state import EPOCH_KEYS, META_KEYS, RunState, checkpoint_meta, epoch_row


def _checkpoint(folder: Path, name: str, epoch: int, step: int, history=None) -> Path:
    path = folder / name
    ckpt_format.write_checkpoint(str(path), meta={"model": "mlp", "strategy": "ddp", "epoch": epoch, "step": step},
                                 history=history if history is not None else [{"epoch": e + 1} for e in range(epoch)])
    return path


def test_the_run_path_for_folders_and_uris_and_its_display_has_no_secret(tmp_path):
    local = RunFolder.of(TrainConfig(storage_path=str(tmp_path) + "/", name="r"))
    assert local.uri == f"{tmp_path}/r" and local.is_local and local.path == f"{tmp_path}/r"
    assert local.uri_of(local.join("checkpoint_1")) == f"{tmp_path}/r/checkpoint_1"
    uri = RunFolder.of(TrainConfig(storage_path=f"file://{tmp_path}", name="r"))
    assert uri.is_local and uri.path == f"{tmp_path}/r" and uri.uri_of(uri.join("c")) == f"file://{tmp_path}/r/c"
    secret = RunFolder("s3://AKIA:SECRET@bucket/runs/r")
    assert secret.display == "s3://***@bucket/runs/r" and "SECRET" not in repr(secret)


def test_one_scanner_for_both_runners_checkpoints(tmp_path):
    folder = RunFolder(str(tmp_path))
    assert folder.checkpoints() == [] and folder.newest_checkpoint() is None and folder.state() == RunState()
    _checkpoint(tmp_path, "checkpoint_epoch000001", 1, 22)
    _checkpoint(tmp_path, "checkpoint_epoch000002", 2, 44)
    (tmp_path / "checkpoint_epoch000003").mkdir()  # parts written, no meta.json yet: incomplete
    (tmp_path / ".tmp-checkpoint_epoch000003-0123456789ab").mkdir()
    (tmp_path / "checkpoint_epoch000009").mkdir()
    (tmp_path / "checkpoint_epoch000009" / "meta.json").write_text('{"epoch": 9, "st')  # cut short by a kill
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000001", "checkpoint_epoch000002"]
    state = folder.state()
    assert (state.epoch, state.step, state.attempt, len(state.history)) == (2, 44, 1, 2)
    assert state.checkpoint == str(tmp_path / "checkpoint_epoch000002")
    assert state.finished(TrainConfig(epochs=2)) and not state.finished(TrainConfig(epochs=3))
    assert state.finished(TrainConfig(epochs=3, max_steps=44))


def test_ray_trains_own_record_names_the_checkpoint_it_resumes_from(tmp_path):
    # A save killed after its upload but before Ray Train took the report leaves a complete
    # folder that Ray Train does not know: its snapshot's latest checkpoint is the one.
    _checkpoint(tmp_path, "checkpoint_2026-01-01_00-00-01.000000", 1, 22)
    _checkpoint(tmp_path, "checkpoint_2026-01-01_00-00-02.000000", 2, 44)
    snapshot = {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_2026-01-01_00-00-01.000000"}}
    (tmp_path / RAY_TRAIN_SNAPSHOT).write_text(json.dumps(snapshot))
    assert RunFolder(str(tmp_path)).state().step == 22


def test_a_checkpoint_published_in_the_folder_resumes_past_ray_trains_record(tmp_path):
    """A run trained on Ray Train, then in the driver's process (runner='local'): the in-process runner publishes
    its checkpoints in the folder (``published``), and the furthest of those and Ray Train's record is the resume
    point; a Ray-written folder Ray Train never registered still is not."""
    _checkpoint(tmp_path, "checkpoint_epoch000001", 1, 22)
    _checkpoint(tmp_path, "checkpoint_epoch000002", 2, 44)  # uploaded, never registered
    (tmp_path / RAY_TRAIN_SNAPSHOT).write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_epoch000001"}}))
    folder = RunFolder(str(tmp_path))
    assert folder.state().step == 22 and folder.newest_checkpoint(registered=None) is None  # nothing published
    published = _checkpoint(tmp_path, "checkpoint_epoch000003", 3, 66)
    meta = json.loads((published / "meta.json").read_text())
    (published / "meta.json").write_text(json.dumps({**meta, "published": True}))
    assert folder.state().step == 66
    # a Ray Train worker's choice, with Ray's latest as it has it: the same rule
    assert folder.newest_checkpoint(registered=str(tmp_path / "checkpoint_epoch000001")).name == "checkpoint_epoch000003"
    assert folder.newest_checkpoint(registered=str(published)).name == "checkpoint_epoch000003"  # as far: the same
    assert folder.newest_checkpoint(registered=str(tmp_path / "checkpoint_epoch000002")).name == "checkpoint_epoch000003"


def test_history_is_written_by_rename_with_every_rows_keys(tmp_path):
    folder = RunFolder(str(tmp_path / "r"))
    assert folder.read_history() is None
    rows = [{"epoch": 1, "test_loss": None}, {"epoch": 2, "test_loss": 0.5, "auto_strategy": "ddp"}]
    folder.write_history(rows)
    assert folder.read_history() == [{**rows[0], "auto_strategy": None}, rows[1]]
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["history.parquet"]


def test_both_runners_share_the_meta_and_row_keys():
    cfg = TrainConfig(storage_path="s3://AKIA:SECRET@bucket/runs", name="r")
    state = RunState(epoch=2, step=44, attempt=1)
    meta = checkpoint_meta(cfg, state, {"input_shape": [1, 8, 8], "num_classes": 10}, partition=[3, 2])
    assert set(META_KEYS) <= meta.keys() and meta["partition"] == [3, 2]
    assert "SECRET" not in json.dumps(meta)
    row = epoch_row(epoch=1, state=state, lr=0.1, loss_sum=10.0, correct=5, samples=10, elapsed_s=2.0, steps=4,
                    data_wait_share=0.1, peak_memory_bytes=[1.0, 2], bubble_fraction=0.2,
                    devices={"devices_per_rank": [["cpu"]], "backend": "gloo", "gpu_ids_per_rank": [[]]})
    assert list(row)[:len(EPOCH_KEYS)] == list(EPOCH_KEYS) and row["bubble_fraction"] == 0.2
    assert (row["train_loss"], row["train_accuracy"], row["samples_per_s"], row["step_time_s"]) == (1.0, 0.5, 5.0, 0.5)
    assert row["peak_memory_bytes"] == [1, 2] and row["test_loss"] is None


class _ObjectStore(pafs.FileSystemHandler):
    """A bucket stand-in over a local folder: like S3 and GCS it cannot move a folder."""

    def __init__(self, root: Path):
        self.fs = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
        self.moved_files = []

    def move(self, src, dest):
        if self.fs.get_file_info(src).type == pafs.FileType.Directory:
            raise NotImplementedError("moving directories is not supported")
        self.moved_files.append(dest)
        self.fs.move(src, dest)

    def get_type_name(self):
        return "fake-object-store"

    def equals(self, other):
        return self is other

    def normalize_path(self, path):
        return path

    # FileSystemHandler's abstract methods, delegated explicitly
    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.fs.delete_file(path)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


def test_a_checkpoint_is_published_on_an_object_store_meta_last(tmp_path):
    store = _ObjectStore(tmp_path)
    folder = RunFolder("s3://bucket/runs/r", filesystem=(pafs.PyFileSystem(store), "bucket/runs/r"))
    assert not folder.is_local
    tmp = folder.temporary("checkpoint_epoch000001")
    with folder.writable(tmp) as directory:  # a local folder, uploaded on exit
        assert not directory.startswith(str(tmp_path))
        ckpt_format.write_checkpoint(directory, meta=None, history=None, model_state={}, part="-stage0")
    assert folder.checkpoints() == []  # no meta.json: not a checkpoint yet, wherever it lies
    with folder.writable(tmp) as directory:
        ckpt_format.write_checkpoint(directory, meta={"epoch": 1, "step": 3, "model": "mlp"}, history=[{"epoch": 1}])
    published = folder.publish(tmp, "checkpoint_epoch000001")
    assert published.uri == "s3://bucket/runs/r/checkpoint_epoch000001" and published.meta["step"] == 3
    run = tmp_path / "bucket" / "runs" / "r"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_epoch000001"]  # the temporary folder is gone
    assert sorted(p.name for p in (run / "checkpoint_epoch000001").iterdir()) == [
        "history.json", "meta.json", "model-stage0.pt"]
    assert folder.state().history == [{"epoch": 1}] and folder.state().checkpoint == published.uri
    with folder.readable(published.path) as directory:  # downloaded for the actors that resume from it
        assert ckpt_format.read_meta(directory)["epoch"] == 1 and ckpt_format.load_model_state(directory) == {}
    folder.write_history([{"epoch": 1}])  # history.parquet: a file moves on an object store
    assert folder.read_history() == [{"epoch": 1}] and store.moved_files == ["bucket/runs/r/history.parquet"]


def test_a_filesystem_publishes_by_one_rename_and_prunes_old_checkpoints(tmp_path):
    folder = RunFolder(f"file://{tmp_path}/r")
    for epoch in (1, 2, 3):
        tmp = folder.temporary(f"checkpoint_epoch{epoch:06d}")
        with folder.writable(tmp) as directory:
            assert directory == tmp  # written in place
            ckpt_format.write_checkpoint(directory, meta={"epoch": epoch, "step": epoch}, history=[])
        folder.publish(tmp, f"checkpoint_epoch{epoch:06d}")
        folder.prune("checkpoint_epoch", keep=2)
    assert [c.name for c in folder.checkpoints()] == ["checkpoint_epoch000002", "checkpoint_epoch000003"]
    assert folder.state().checkpoint == f"file://{tmp_path}/r/checkpoint_epoch000003"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["checkpoint_epoch000002", "checkpoint_epoch000003"]
    with pytest.raises(ValueError, match="meta.json is missing"):
        with ckpt_format.local_checkpoint(f"file://{tmp_path}/r/nothing") as directory:
            ckpt_format.read_meta(directory)
