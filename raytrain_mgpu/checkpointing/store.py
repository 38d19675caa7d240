"""The checkpoint store: on every rank, the one owner of a checkpoint's life once the engine has its files.

- **write**: :meth:`CheckpointStore.begin` gives this rank a folder for its part (the engine's ``Saver`` writes the
  files, ``checkpointing/contents.py``); :meth:`~CheckpointStore.abort` drops it when the write fails;
- **seal**: rank 0 writes ``meta.json`` last (:func:`seal`): a folder without it is no checkpoint;
- **publish**: :meth:`~CheckpointStore.commit` puts the checkpoint where a resume finds it: renamed into the run folder
  (:class:`FolderStore`), or reported to Ray Train, which uploads and registers it
  (``transports/ray_train/store.RayTrainStore``);
- **the best copy** (``keep_best``): a new best's model copied into ``best_checkpoint/``
  (:meth:`~CheckpointStore.keep_best`);
- **pruning**: all but the newest ``num_checkpoints_to_keep`` deleted (the run folder's here; Ray Train prunes the ones
  it registered by age, told the same number in its ``RunConfig``);
- **newest**: :meth:`~CheckpointStore.newest`, the checkpoint a run resumes from (``RunFolder.newest_checkpoint``: the
  furthest of those published in the folder and the one the store's own system registered, :meth:`registered`).

A transport hands its store what only it knows (``Transport.checkpoint_store``): for the run folder this rank, a token
of the attempt (every rank names the same temporary folder) and a barrier over the ranks; for Ray Train its reports and
uploads. The engine's ``CheckpointManager`` decides when a checkpoint is due and what it holds; the store does the rest.

One rank's side, like the engine: no Ray, no transport (``tests/test_imports.py``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Callable, ContextManager, NamedTuple, Optional

from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.checkpointing import files as ckpt_format
from raytrain_mgpu.checkpointing.contents import CHECKPOINT_PREFIX
from raytrain_mgpu.checkpointing.run_folder import PUBLISHED_KEY, TMP_PREFIX, RunFolder

logger = logging.getLogger(__name__)

__all__ = ["CheckpointStore", "FolderStore", "CheckpointSource", "seal"]


class CheckpointSource(NamedTuple):
    """A checkpoint to resume from: its path or URI (``RunState.checkpoint``) and a local copy to read."""

    path: str
    open: Callable[[], ContextManager[str]]


def seal(directory: str, meta: dict, published: bool = False) -> None:
    """A checkpoint's last write, every store's: ``meta.json``, which marks it complete (``published``: put in place in
    the run folder by this package, not registered by Ray Train: ``RunFolder.newest_checkpoint``)."""
    ckpt_format.write_checkpoint(directory, meta={**meta, PUBLISHED_KEY: True} if published else meta, history=None)


class CheckpointStore:
    """One rank's checkpoints, from ``begin`` to ``commit`` (see the module docstring); ``reporter``: rank 0's events
    (``None`` elsewhere)."""

    def __init__(self, cfg, rank: int, reporter=None):
        self.folder = RunFolder.of(cfg)
        self.keep = cfg.num_checkpoints_to_keep
        self.rank, self.reporter = rank, reporter

    def asynchronous(self, step: bool, final: bool) -> bool:
        """Whether a sharded save may go on writing after the save returns (its upload waits for it)."""
        return False

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> Optional[str]:
        """The folder this rank writes its part of checkpoint ``name`` into (None: this rank writes none)."""
        raise NotImplementedError

    def commit(self, commit) -> None:
        """This rank's part is written (a ``contents.Commit``): seal, publish, copy a new best, prune."""
        raise NotImplementedError

    def abort(self, exc: Optional[BaseException]) -> None:
        """A save failed between ``begin`` and ``commit`` on this rank: nothing of it is published."""

    def registered(self) -> Optional[CheckpointSource]:
        """The checkpoint the store's own system registered last (Ray Train's), read through that system's storage
        access; None where the run folder alone holds them."""
        return None

    def newest(self) -> Optional[CheckpointSource]:
        """The checkpoint this run resumes from (None: a new run): the run folder's newest complete one, or the one
        :meth:`registered` names where that is the newest."""
        registered = self.registered()
        point = self.folder.newest_checkpoint(registered=registered.path if registered is not None else None)
        if point is None:
            return None
        if registered is not None and point.name == registered.path.rstrip("/").rsplit("/", 1)[-1]:
            return registered
        folder = self.folder
        return CheckpointSource(point.uri, lambda: folder.readable(point.path))

    def keep_best(self, directory: str, model_state: Optional[dict] = None) -> None:
        """A new best (``keep_best``): its model, from the local checkpoint ``directory`` (or ``model_state``, a sharded
        run's gathered model), copied into ``best_checkpoint/`` (``RunFolder.save_best``): one more model write per
        improvement, so that pruning by age never deletes the best."""
        self.folder.save_best(directory, model_state)


class FolderStore(CheckpointStore):
    """Checkpoints published in the run folder by its ranks: the pipeline's stage actors and the in-process runner.

    Every rank writes its part into one temporary folder of the run folder (``attempt``: a token every rank of this
    attempt shares; a remote folder gets the rank's files at commit); once all are in (``barrier``: waits for every
    rank, a no-op with one), rank 0 writes ``meta.json`` (last: it marks the checkpoint complete), renames the folder
    to its name, copies a new best aside and deletes all but the newest ``num_checkpoints_to_keep``."""

    def __init__(self, cfg, rank: int, attempt: str, reporter=None, barrier: Callable[[], object] = lambda: None):
        super().__init__(cfg, rank, reporter)
        self.attempt, self.barrier = attempt, barrier
        self._staging: Optional[str] = None

    def _temporary(self, name: str) -> str:
        return self.folder.join(f"{TMP_PREFIX}{name}-{self.attempt}")

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> str:
        if self.folder.is_local:  # written in place; a remote folder gets the files on commit
            path = self._temporary(name)
            self.folder.fs.create_dir(path, recursive=True)
            return path
        self._staging = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")
        return self._staging

    def commit(self, commit) -> None:
        tmp = self._temporary(commit.name)
        if self._staging is not None:  # this rank's files up to the run folder's temporary folder
            with self.folder.writable(tmp) as target:
                shutil.copytree(self._staging, target, dirs_exist_ok=True)
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self.barrier()  # every rank's part is there
        if self.rank != 0:
            return
        with self.folder.writable(tmp) as directory:
            seal(directory, commit.meta, published=True)  # last: marks it complete
        published = self.folder.publish(tmp, commit.name)
        if commit.is_best:
            with self.folder.readable(published.path) as directory:
                self.keep_best(directory)
        self.folder.prune(CHECKPOINT_PREFIX, self.keep)
        logger.info("checkpoint %s", redact(published.uri))
        if self.reporter is not None:
            self.reporter.checkpoint(published.uri)

    def abort(self, exc: Optional[BaseException]) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
