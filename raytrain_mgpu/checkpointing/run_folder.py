"""The run folder ``{storage_path}/{name}``: one helper for both runners.

Everything that lives there goes through :class:`RunFolder`, on any filesystem pyarrow
opens (a local or mounted folder, ``file://``, ``s3://``, ``gs://``, ...)::

    {run}/run.json                      the run's identity (driver/preflight.py)
    {run}/history.parquet               one row per epoch (written by fit, atomically)
    {run}/.raytrain-mgpu.lock           the driver's lock (driver/runlock.py)
    {run}/checkpoint*/meta.json         one per checkpoint, written last: marks it complete (a sharded
                                        one's: with DCP's .metadata and every file it names)
    {run}/checkpoint_manager_snapshot.json   Ray Train's own record of its checkpoints
    {run}/best_checkpoint/              the best epoch's model, for a Ray Train run with keep_best

Every runner names its checkpoints ``checkpoint_epoch<E>`` (``_step<S>`` inside an epoch:
``checkpointing/contents.py``); earlier Ray Train runs' ``checkpoint_<time>`` folders still resume.
:meth:`RunFolder.checkpoints` is the one scanner of all of them.

``keep_best``: the best checkpoint is kept besides the last ``num_checkpoints_to_keep``: a new best's
model is copied into ``best_checkpoint/`` (:meth:`RunFolder.save_best`) by the checkpoint store
(``checkpointing/store.py``: Ray Train's rank 0 before its report, or the run folder's publisher). Ray Train's own
``num_to_keep`` prunes by age (with ``checkpoint_score_attribute`` it would keep the N *best*, and a
folder deleted behind its back fails its resume); :meth:`RunFolder.prune` does the same for the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.checkpointing.files import HISTORY_FILE as CHECKPOINT_HISTORY_FILE
from raytrain_mgpu.checkpointing.files import (META_FILE, SHARDED_DIR, SHARDED_KEY, filesystem, model_part_files,
                                               sharded_files, write_files)
from raytrain_mgpu.engine.run_state import RunState

logger = logging.getLogger(__name__)

__all__ = ["RunFolder", "CheckpointInfo", "HISTORY_FILE", "RAY_TRAIN_SNAPSHOT", "BEST_CHECKPOINT"]

HISTORY_FILE = "history.parquet"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train's record of its checkpoints; its ``latest_checkpoint_result`` is what it resumes from. Read here, by the
folder's reader, not by Ray Train's store (which asks ``ray.train.get_checkpoint``): the readers outside a run (the
driver's checks, export, ``init_from`` of another run) sit below the transports and must not take a folder Ray Train
never registered either."""
BEST_CHECKPOINT = "best_checkpoint"
"""The copy of the best epoch's model (not named ``checkpoint*``: it is never resumed from)."""


class CheckpointInfo(NamedTuple):
    name: str       # the folder's name, e.g. checkpoint_epoch000003
    path: str       # its path in the run folder's filesystem
    uri: str        # a local path, or a URI for a storage URI (what TrainResult.checkpoint_path holds)
    meta: dict


def run_uri(storage_path: str, name: str) -> str:
    """``{storage_path}/{name}``, also for a storage URI."""
    return f"{storage_path.rstrip('/')}/{name}"


class RunFolder:
    """``RunFolder.of(cfg)`` or ``RunFolder(run_uri)``; the filesystem is opened on first use.

    ``filesystem``: ``(pyarrow FileSystem, path in it)`` to use instead of opening ``uri``.
    """

    def __init__(self, uri: str, filesystem: Optional[tuple] = None):
        self.uri = uri
        self.display = redact(uri)  # for logs and errors: no URI credentials
        self._fs, self._path = filesystem if filesystem is not None else (None, None)

    @classmethod
    def of(cls, cfg) -> "RunFolder":
        return cls(run_uri(cfg.storage_path, cfg.name))

    def __repr__(self) -> str:
        return f"RunFolder({self.display!r})"

    # ------------------------------------------------------------------ where

    @property
    def fs(self):
        """The pyarrow filesystem (``engine.checkpoint_files.filesystem``)."""
        if self._fs is None:
            self._fs, self._path = filesystem(self.uri)
        return self._fs

    @property
    def path(self) -> str:
        """The run folder's path inside :attr:`fs`."""
        self.fs  # noqa: B018 (opens it)
        return self._path.rstrip("/") or "/"

    @property
    def is_local(self) -> bool:
        """A folder of this machine's filesystem (also for ``file://``): paths work as they are."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def join(self, *names: str) -> str:
        return "/".join([self.path, *names])

    @property
    def scheme(self) -> Optional[str]:
        """The storage URI's scheme (``s3``, ``gs``, ...), None for a local path."""
        return self.uri.split("://", 1)[0] if "://" in self.uri else None

    def uri_of(self, path: str) -> str:
        """The path or URI a user (and ``TrainResult.load_model``) opens for ``path`` of :attr:`fs`."""
        return f"{self.scheme}://{path}" if self.scheme else path

    def _exists(self, path: str, directory: bool = False) -> bool:
        kind = self.fs.get_file_info(path).type
        return kind == (pafs.FileType.Directory if directory else pafs.FileType.File)

    # ------------------------------------------------------------------ checkpoints

    def _folders(self, prefix: str) -> list:
        entries = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted((e for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith(prefix)),
                      key=lambda e: e.base_name)

    def checkpoints(self) -> List[CheckpointInfo]:
        """Every complete checkpoint (``checkpoint*/meta.json`` readable, and every file a sharded one
        lists there present: each rank uploads its own), oldest first by (step, epoch, name)."""
        found = []
        for entry in self._folders("checkpoint"):
            meta = self.read_json(f"{entry.path}/{META_FILE}")
            if meta is not None and (not meta.get(SHARDED_KEY) or self._shards_there(entry.path)):
                found.append(CheckpointInfo(entry.base_name, entry.path, self.uri_of(entry.path), meta))
        return sorted(found, key=_order)

    def _shards_there(self, path: str) -> bool:
        """Whether a sharded checkpoint's ``.metadata`` and every file it names are in ``path``."""
        folder = f"{path}/{SHARDED_DIR}"
        try:
            with self.fs.open_input_stream(f"{folder}/.metadata") as stream:
                files = sharded_files(stream.read())
        except (FileNotFoundError, OSError):
            return False
        if files is None:
            return False
        infos = self.fs.get_file_info([f"{folder}/{name}" for name in sorted(files)])
        return all(info.type == pafs.FileType.File for info in infos)

    def newest_checkpoint(self, registered: Union[str, None, type(...)] = ...) -> Optional[CheckpointInfo]:
        """The checkpoint a resume starts from, the one choice every store and the driver make: the furthest of the
        one a store's own system registered last (Ray Train's latest: a folder uploaded by a save that was killed
        before Ray Train took it is not one) and the checkpoints published in the folder by the run folder's store
        (``published`` in ``meta.json``: renamed into place once complete). ``registered``: that checkpoint as a rank
        has it (its path or URI; None: none, the run folder's store, ``CheckpointStore.newest``); left out (a reader
        outside a run: the driver, export, ``init_from``), the one Ray Train's snapshot in the folder records, and
        without either kind the furthest complete checkpoint."""
        found = self.checkpoints()
        if registered is ...:
            snapshot = self.read_json(self.join(RAY_TRAIN_SNAPSHOT)) or {}
            latest = (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
        else:
            latest = registered.rstrip("/").rsplit("/", 1)[-1] if registered else None
        candidates = [c for c in found if c.name == latest or c.meta.get(PUBLISHED_KEY)]
        if candidates:
            return candidates[-1]
        return found[-1] if found and registered is ... else None

    def state(self) -> RunState:
        """Where the run stands: a fresh :class:`RunState`, or the one after the newest checkpoint."""
        newest = self.newest_checkpoint()
        if newest is None:
            return RunState()
        history = self.read_json(f"{newest.path}/{CHECKPOINT_HISTORY_FILE}", kind=list) or []
        return RunState.resumed(newest.meta, history, newest.uri)

    def checkpoint_history(self, path: str) -> list:
        """The history a checkpoint carries (its ``history.json``), read without downloading the checkpoint."""
        return self.read_json(f"{path.rstrip('/')}/{CHECKPOINT_HISTORY_FILE}", kind=list) or []

    @contextlib.contextmanager
    def readable(self, path: str) -> Iterator[str]:
        """A local folder with the contents of ``path`` (downloaded for a remote storage)."""
        if self.is_local:
            yield path
            return
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-read-") as local:
            pafs.copy_files(path, local, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())
            yield local

    @contextlib.contextmanager
    def writable(self, path: str) -> Iterator[str]:
        """A local folder whose files end up in ``path`` (uploaded on exit for a remote storage)."""
        if self.is_local:
            self.fs.create_dir(path, recursive=True)
            yield path
            return
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-write-") as local:
            yield local
            pafs.copy_files(local, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)

    def temporary(self, name: str) -> str:
        """A new uniquely named hidden folder for a checkpoint being written (see :meth:`publish`)."""
        path = self.join(f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}")
        self.fs.create_dir(path, recursive=True)
        return path

    def publish(self, tmp: str, name: str) -> CheckpointInfo:
        """Give the finished ``tmp`` folder its checkpoint ``name``.

        A filesystem renames the folder: a resume sees all of it or nothing. An object
        store has no folders to rename, so the files are copied with ``meta.json`` last
        (the scanners need it), then the temporary ones deleted.
        """
        final = self.join(name)
        if self._exists(final, directory=True):
            self.fs.delete_dir(final)
        try:
            self.fs.move(tmp, final)
        except (NotImplementedError, OSError) as exc:  # S3/GCS: "moving directories is not supported"
            logger.debug("%s: copying %s file by file (%s)", self.display, name, exc)
            self._copy_meta_last(tmp, final)
            self.fs.delete_dir(tmp)
        meta = self.read_json(f"{final}/{META_FILE}") or {}
        return CheckpointInfo(name, final, self.uri_of(final), meta)

    def _copy_meta_last(self, source: str, dest: str) -> None:
        files = [e.path for e in self.fs.get_file_info(pafs.FileSelector(source, recursive=True))
                 if e.type == pafs.FileType.File]
        for path in sorted(files, key=lambda p: p.endswith(f"/{META_FILE}")):
            target = dest + path[len(source):]
            self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            self.fs.copy_file(path, target)

    def prune(self, prefix: str, keep: int) -> None:
        """Delete all but the newest ``keep`` folders named ``{prefix}*`` (names sort by age)."""
        for old in self._folders(prefix)[:-keep]:
            self.fs.delete_dir(old.path)

    def save_best(self, directory: str, model_state: Optional[dict] = None) -> CheckpointInfo:
        """The best copy, the one way every transport makes it: the model parts, ``meta.json`` and ``history.json``
        of the local checkpoint ``directory`` into :data:`BEST_CHECKPOINT` (no train state: it is loaded, not
        resumed); ``model_state``: a sharded checkpoint's model, gathered, written as ``model.pt`` instead."""
        tmp = self.temporary(BEST_CHECKPOINT)
        with self.writable(tmp) as target:
            if model_state is not None:
                write_files(target, {"model.pt": model_state})
            parts = model_part_files(directory) if model_state is None else []
            for source in [*parts, Path(directory) / CHECKPOINT_HISTORY_FILE,
                           Path(directory) / META_FILE]:  # meta.json last: it marks the copy complete
                shutil.copyfile(source, Path(target) / source.name)
        return self.publish(tmp, BEST_CHECKPOINT)

    def best_checkpoint(self) -> Optional[CheckpointInfo]:
        """The checkpoint of the best epoch the newest checkpoint's ``meta.json`` names (see
        ``run_state.best_record``): a kept checkpoint of that epoch, else :data:`BEST_CHECKPOINT`
        if it holds that epoch (its own record says the same epoch and value: a copy written
        just before a kill is of an epoch the resumed run trained again); None without one."""
        newest = self.newest_checkpoint()
        best = newest.meta.get("best") if newest is not None else None
        if not best:
            return None
        copy = self.read_json(self.join(BEST_CHECKPOINT, META_FILE))
        copies = [CheckpointInfo(BEST_CHECKPOINT, self.join(BEST_CHECKPOINT), self.uri_of(self.join(BEST_CHECKPOINT)),
                                 copy)] if copy is not None else []
        return next((c for c in [*self.checkpoints(), *copies]
                     if c.meta.get("epoch") == best["epoch"] and c.meta.get("best") == best), None)

    def remove_temporaries(self) -> List[str]:
        """Remove the temporary checkpoint folders a killed driver (or attempt) left; returns their names.

        Their names are unique, so nobody would ever reuse or remove them otherwise. Call it under this run's lock
        (``driver/runlock.remove_stale_temporaries``): another live driver's save may be in flight."""
        stale = self._folders(f"{TMP_PREFIX}checkpoint") + self._folders(f"{TMP_PREFIX}{BEST_CHECKPOINT}")
        for entry in stale:
            self.fs.delete_dir(entry.path)
        if stale:
            logger.info("run folder %s: removed %d temporary checkpoint folder(s) left by a stopped driver: %s",
                        self.display, len(stale), ", ".join(e.base_name for e in stale))
        return [e.base_name for e in stale]

    # ------------------------------------------------------------------ files

    def read_history(self) -> Optional[list]:
        """``history.parquet`` as a list of rows, or None when there is none."""
        path = self.join(HISTORY_FILE)
        if not self._exists(path):
            return None
        return pq.read_table(path, filesystem=self.fs).to_pylist()

    def write_history(self, rows: list) -> None:
        """``history.parquet``: temporary name, then rename, so a crash leaves the previous one, never half."""
        if not rows:
            return
        self.fs.create_dir(self.path, recursive=True)
        tmp = self.join(f".{HISTORY_FILE}.tmp-{uuid.uuid4().hex[:12]}")
        keys = list(dict.fromkeys(key for row in rows for key in row))  # every row's keys, not only the first's
        pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows]), tmp,
                       filesystem=self.fs)
        self.fs.move(tmp, self.join(HISTORY_FILE))

    def read_json(self, path: str, kind: type = dict):
        """A JSON file of ``kind``, or None if it is missing, cut short by a kill, or another kind."""
        try:
            with self.fs.open_input_stream(path) as f:
                value = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, kind) else None

    def write_json(self, name: str, value) -> None:
        """``{run}/{name}``, atomically: a kill leaves the old file or the new one, never half."""
        self.write_text(name, json.dumps(value, indent=1, default=str))

    def read_text(self, name: str) -> Optional[str]:
        """The text of the small file ``{run}/{name}``, or None if there is none."""
        try:
            with self.fs.open_input_stream(self.join(name)) as f:
                return f.read().decode()
        except (FileNotFoundError, OSError):
            return None

    def write_text(self, name: str, text: str) -> None:
        """``{run}/{name}`` (a small file: a logger's CSV, an id), atomically as :meth:`write_json`."""
        self.fs.create_dir(self.path, recursive=True)
        path = self.join(name)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(text.encode())
        self.fs.move(tmp, path)


TMP_PREFIX = ".tmp-"
"""Temporary checkpoint folders: ``.tmp-{name}-{unique}`` (never matched as a checkpoint)."""


PUBLISHED_KEY = "published"
"""``meta.json``'s mark of a checkpoint published in the run folder by rank 0 of the pipeline's actor group or
of the in-process runner (``checkpointing/store.FolderStore``): complete, and a resume point of its own."""


def _order(checkpoint: CheckpointInfo) -> tuple:
    """How far a checkpoint got: (step, epoch, name)."""
    return _number(checkpoint.meta.get("step")), _number(checkpoint.meta.get("epoch")), checkpoint.name


def _number(value) -> float:
    return value if isinstance(value, (int, float)) else -1
