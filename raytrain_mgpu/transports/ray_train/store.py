"""The Ray Train checkpoint store: a Ray Train worker's checkpoints, reported to Ray Train (``checkpointing/store.py``
describes a store's job).

- **write**: rank 0 (every rank of a sharded run: its own shards) writes into a local folder of its own, which Ray
  Train deletes after the upload; the other ranks write none and report their metrics at once (Ray Train's report
  is a barrier);
- **seal**: rank 0's ``meta.json`` last, so that Ray Train uploads a complete folder;
- **publish**: ``ray.train.report``, uploaded in the background while training goes on, or synchronously for the
  run's last save (``uploads.py``: reported before the write, one upload in flight at most); Ray Train registers
  it once every rank's report is in, and its controller tells the driver (``policy.CheckpointAnnouncer``);
- **the best copy**: a new best's model copied into the run folder's ``best_checkpoint/`` before the report;
- **pruning**: Ray Train's own, by age (``num_to_keep`` in its ``RunConfig``; its score order would keep the N best);
- **newest**: Ray Train's latest registered checkpoint (``ray.train.get_checkpoint``), read through its storage, unless
  the run folder holds a checkpoint published past it (a run that went on in the driver's process).
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import Future
from typing import Optional

import ray.train
from ray.train import CheckpointUploadMode

from raytrain_mgpu.checkpointing.store import CheckpointSource, CheckpointStore, seal
from raytrain_mgpu.transports.ray_train.faults import wait_until_report_collected
from raytrain_mgpu.transports.ray_train.uploads import clean, report, wait_for_previous

__all__ = ["RayTrainStore"]


class RayTrainStore(CheckpointStore):
    """One Ray Train worker's checkpoints (see the module docstring). ``sync_uploads``: every save uploads inside its
    report (``bench-checkpoint`` measures what that costs)."""

    def __init__(self, cfg, rank: int, reporter=None, sync_uploads: bool = False):
        super().__init__(cfg, rank, reporter)
        self.sync_uploads = sync_uploads
        self.last: Optional[str] = None  # the checkpoint this rank reported last (uploads.wait_for_previous)
        self._save: Optional[dict] = None  # the save between begin and commit

    def registered(self) -> Optional[CheckpointSource]:
        latest = ray.train.get_checkpoint()  # read through Ray Train's storage where the run resumes from it
        return None if latest is None else CheckpointSource(latest.path, latest.as_directory)

    def asynchronous(self, step: bool, final: bool) -> bool:
        return not (final or self.sync_uploads)  # the run's last save uploads synchronously: nothing is left to overlap

    def begin(self, name: str, metrics: dict, step: bool, final: bool, sharded: bool) -> Optional[str]:
        upload = CheckpointUploadMode.ASYNC if self.asynchronous(step, final) else CheckpointUploadMode.SYNC
        save = self._save = {"upload": upload, "files": self.rank == 0 or sharded, "directory": None, "writing": None}
        if not save["files"]:  # reported now, without a checkpoint: Ray Train's report is a barrier (uploads.py)
            ray.train.report(clean(metrics), checkpoint=None)
            return None
        wait_for_previous(self.last)  # one upload in flight at most; a failure resumes from it
        self.last = name
        save["directory"] = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")  # Ray Train deletes it after upload
        if upload == CheckpointUploadMode.ASYNC:  # reported before the write, its upload waiting for commit
            save["writing"] = Future()
            try:
                report(metrics, save["directory"], name, upload, save["writing"])
            except BaseException:
                self.abort(None)
                raise
        return save["directory"]

    def commit(self, commit) -> None:
        save, self._save = self._save, None
        if save["files"]:
            try:
                if self.rank == 0:
                    seal(save["directory"], commit.meta)  # meta.json last: Ray Train uploads a complete folder
                    if commit.is_best:
                        self.keep_best(save["directory"], commit.best_model)
                    if self.reporter is not None:  # the epoch's row in the driver's mailbox before the announcement
                        self.reporter.flush()
                if save["writing"] is not None:
                    save["writing"].set_result(commit.writing)  # Ray Train's upload thread copies it from here
                    return
                report(commit.metrics, save["directory"], commit.name, save["upload"], commit.writing)
            except BaseException as exc:
                self._save = save
                self.abort(exc)
                raise
        # Held until the controller took the report: a failure after it keeps the checkpoint (faults.py).
        wait_until_report_collected()

    def abort(self, exc: Optional[BaseException]) -> None:
        save, self._save = self._save, None
        if not save:
            return
        if save["writing"] is not None and not save["writing"].done():
            # reported already: its upload fails with the write, before it reads the folder
            save["writing"].set_exception(exc or RuntimeError("the checkpoint was not written"))
        if save["directory"] is not None:
            shutil.rmtree(save["directory"], ignore_errors=True)
