"""What a Ray Train worker saves: checkpoints, the optimizer's state, each rank's RNG.

``save_and_report`` writes a checkpoint (rank 0) and reports it to Ray Train on every rank;
``runtime/worker_restore.py`` reads it back on a restart or resume. Used by the loop
(``runtime/loop.py``) at the end of every epoch and every ``checkpoint_every_n_steps``.

Sharded strategies (``fsdp``: ``WorkerStrategy.sharded_checkpoint``). Every rank writes its own
shards of the model and optimizer (``torch.distributed.checkpoint``) into its own local folder and
reports it under rank 0's checkpoint name: Ray Train uploads every rank's folder into the one
checkpoint folder and registers it once every rank's report is in. The save is DCP's asynchronous
one: training waits while the shards are copied to host memory, a thread writes them, and Ray
Train's upload thread waits for that write before it copies the folder (the run's last save,
synchronous, writes at once). Rank 0 adds ``meta.json`` (``sharded``: true), ``history.json`` and
the small train state (LR schedule, scaler, every rank's RNG). So no rank gathers the full state,
each rank's upload is its own (one in flight per rank, as rank 0's below), and a restart reads the
pieces its shards cover, on any number of workers (``worker_restore.load_train_state``). ``keep_best`` gathers the
model (not the optimizer) to rank 0 for each new best's copy.

Upload. Rank 0 writes the checkpoint to a local folder and reports it with Ray Train's
``CheckpointUploadMode.ASYNC``: Ray copies it to ``storage_path`` in a background thread (one
upload at a time, registered in report order, the local folder deleted after its upload) while
training goes on, so a save stalls training for the write, not the upload. What the synchronous
upload guaranteed still holds:

- a restart resumes from a complete checkpoint: Ray Train registers a checkpoint (and records
  it in ``checkpoint_manager_snapshot.json``) only after its upload finished; a failure of any
  rank during an upload loses that checkpoint (the worker group stops, the upload with it),
  and the restart resumes from the one before (tests/test_async_upload.py);
- at most one upload is in flight: a save whose predecessor is still uploading waits for it
  (:meth:`_Uploads.wait_persisted`) and for the controller to take its report, so a slow storage
  delays training rather than piling up local copies and moving the resume point further
  behind, and a failure during an upload resumes from the checkpoint uploaded before it;
- the driver's ``on_checkpoint`` gets the persisted path, once the upload is done and Ray
  Train's controller has taken the report (:class:`_Uploads`, a thread on rank 0): later than
  the epoch's row, in checkpoint order;
- the other ranks report without a checkpoint synchronously and wait until the controller has
  taken their report (``wait_until_report_collected``), so one of them dying right after
  its report cannot drop rank 0's checkpoint; a failure within one controller poll after the
  upload finished, before the next save, loses it (the restart resumes from the one before),
  as a failure during the upload does;
- the run's last save (``RunState.finished``) uploads synchronously: nothing is left to
  overlap, and the train function returns only once every checkpoint is registered and
  announced (an announcement still pending after 300 s is given up with a warning: the
  checkpoint is registered either way);
- ``keep_best``'s copy (``RunFolder.save_best``) is written before the report, as before.

Step checkpoints report first. Ray Train's report is a barrier across ranks, and the other ranks then
wait for the controller's next poll (up to ``runtime/faults.FIT_POLL_S``) after it: after rank 0's
write, that wait was most of what a step checkpoint stalled training. So for a step checkpoint
(``checkpoint_every_n_steps``, uploaded in the background) every rank reports *before* the gather and
the write: rank 0 reports an empty folder and a future that Ray Train's upload thread waits for, as
for the sharded save above, then gathers and writes while the others wait for the poll. Nothing is
registered before the folder is complete (the upload, and with it the report to the controller, waits
for the write; a failed write fails the upload); the other ranks still return only once the controller
holds their report (rank 0's, queued after its upload, is waited for before its next save). Measured (issue 24, 2 workers, mlp on digits, a save every 10 steps, 3 runs each, a
0.05 s poll): 46.7-51.1 ms a save against 52.0-78.4 ms reported after the write. An epoch's checkpoint keeps the order above: its
row's ``checkpoint_s`` counts the write, and the row is reported with it.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from datetime import datetime
from typing import TYPE_CHECKING, List, Optional

import ray.train
import torch
from ray.train import CheckpointUploadMode

from raytrain_mgpu.config import TrainConfig
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.faults import wait_until_report_collected
from raytrain_mgpu.runtime.progress import WorkerReporter
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.run_state import RunState, best_row, checkpoint_meta
from raytrain_mgpu.runtime.step_checkpoints import STEP_IN_EPOCH
from raytrain_mgpu.runtime.worker_restore import rng_state

if TYPE_CHECKING:  # the strategies sit above the runtime (tests/test_imports.py LAYERS)
    from raytrain_mgpu.parallel import WorkerStrategy
    from raytrain_mgpu.strategies import WorkerContext

logger = logging.getLogger(__name__)


def gather_objects(own) -> list:
    """Every rank's ``own``, in rank order (collective: every rank calls it; small objects only)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [own]
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, own)
    return gathered


def save_and_report(cfg: TrainConfig, strategy: WorkerStrategy, model, optimizer, scheduler, scaler,
                    state: RunState, metrics: dict, ctx: WorkerContext, shape_info: dict,
                    reporter: Optional[WorkerReporter] = None, epoch_partial: Optional[dict] = None,
                    upload: CheckpointUploadMode = CheckpointUploadMode.ASYNC, send_row: bool = False) -> None:
    """Every rank reports once per epoch (Ray Train requires it); rank 0 carries the checkpoint
    and the driver hears where Ray Train persisted it (``on_checkpoint``). ``upload``: rank 0's
    upload mode (``SYNC`` waits for the upload here); the run's last save is always ``SYNC``.

    ``send_row`` (an epoch's end): ``metrics`` is the epoch's row. Rank 0 adds to its ``checkpoint_s``
    the time training stood still for this checkpoint (the collectives, the waits for the previous
    upload and report, the model and optimizer writes), then writes the history with it, sends the
    row to the driver and reports it to Ray Train."""
    started = time.perf_counter()
    if state.finished(cfg):
        upload = CheckpointUploadMode.SYNC
    sharded, writing, directory = strategy.sharded_checkpoint, None, None
    # A step checkpoint uploaded in the background is reported before it is written (module docstring).
    report_first = epoch_partial is not None and not sharded and upload == CheckpointUploadMode.ASYNC
    if sharded:  # every rank its own shards, into its own folder: Ray Train uploads each into the one checkpoint
        directory = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")
        try:  # collective; asynchronous with the upload: training waits for the copy to host memory only
            writing = strategy.save_sharded(model, optimizer, os.path.join(directory, ckpt_format.SHARDED_DIR),
                                            asynchronous=upload == CheckpointUploadMode.ASYNC)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        model_state = optimizer_state = None
    else:
        model_state = strategy.state_dict(model)  # collective for sharded strategies: all ranks call
        optimizer_state = strategy.optimizer_state_dict(model, optimizer)  # collective too (fsdp)
    uploads = _Uploads.current()
    if report_first:
        directory, writing, index = _report_first(metrics, ctx, uploads)
    is_best = (ctx.world_rank == 0 and cfg.keep_best and epoch_partial is None
               and best_row(state.history, cfg.monitor, cfg.mode) is state.history[-1])
    name = _checkpoint_dir_name() if ctx.world_rank == 0 else None
    # One collective for all: each rank keeps its own random stream on resume, a step checkpoint
    # (``epoch_partial``: this rank's sums of the unfinished epoch) keeps every rank's sums, and a
    # sharded one is reported under rank 0's checkpoint name, with rank 0's keep_best verdict.
    try:
        gathered = gather_objects((rng_state(), epoch_partial, name, is_best))
    except BaseException as exc:
        if writing is not None and report_first:  # the folder will never be written: its upload fails
            writing.set_exception(exc)
        raise
    rng_states = [rng for rng, *_ in gathered]
    partials = [partial for _, partial, *_ in gathered] if epoch_partial is not None else None
    name, is_best = gathered[0][2], gathered[0][3]
    best_model = strategy.state_dict(model) if sharded and is_best else None  # collective: the model, to rank 0
    if ctx.world_rank != 0 and not sharded:  # no checkpoint: reported at once, then held until the controller took it
        if not report_first:
            ray.train.report({k: v for k, v in metrics.items() if v is not None}, checkpoint=None)
        wait_until_report_collected()
        return
    if not report_first:
        _wait_for_previous(uploads)
    if ctx.world_rank != 0:  # a sharded checkpoint's other ranks: their shards, under rank 0's name
        try:
            _report(metrics, directory, name, upload, uploads, writing)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        if upload == CheckpointUploadMode.SYNC:
            wait_until_report_collected()
        return
    if directory is None:
        directory = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-")  # Ray Train deletes it after the upload
    try:
        extra = {STEP_IN_EPOCH: state.step_in_epoch} if partials else {}
        if sharded:
            extra[ckpt_format.SHARDED_KEY] = True
        meta = checkpoint_meta(cfg, state, shape_info, **extra)
        train_state = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "rng_per_rank": rng_states}
        if not sharded:
            train_state["optimizer"] = optimizer_state
        if partials:
            train_state["epoch_partial_per_rank"] = partials
        ckpt_format.write_checkpoint(directory, meta=meta, history=None, model_state=model_state,
                                     train_state=train_state)
        if send_row:
            metrics["checkpoint_s"] = metrics.get("checkpoint_s", 0.0) + time.perf_counter() - started
        ckpt_format.write_checkpoint(directory, meta=None, history=state.history)  # with this row's checkpoint_s
        if is_best:
            # Ray Train prunes by age here (its score order would keep the N best, not the last N):
            # a new best's model is copied aside, one more model write per improvement (sharded: the
            # model gathered to rank 0 for it, never the optimizer's state).
            _save_best(cfg, directory, meta, state.history, best_model)
        if send_row and reporter is not None:
            reporter.epoch(metrics)  # the progress line, before the checkpoint's announcement
        if report_first:
            writing.set_result(None)  # complete: Ray Train's upload thread copies it from here
        else:
            index = _report(metrics, directory, name, upload, uploads, writing)
    except BaseException as exc:
        if report_first:  # reported already: its upload fails with the write, before it reads the folder
            writing.set_exception(exc)
        shutil.rmtree(directory, ignore_errors=True)  # not handed to Ray Train (or its upload failed)
        raise
    if upload == CheckpointUploadMode.ASYNC:
        uploads.announce_when_persisted(index, RunFolder.of(cfg), reporter)
        return
    # Synchronous: uploaded when report returns. A rank 0 that died before the controller took
    # the report would drop the checkpoint although it is uploaded: wait up to one poll (2 s).
    wait_until_report_collected()
    uploads.flush()  # the asynchronous ones before it, announced in order
    if reporter is not None:
        persisted = ray.train.get_checkpoint()  # the latest reported: this one, in the storage filesystem
        if persisted is not None:
            reporter.checkpoint(RunFolder.of(cfg).uri_of(persisted.path))


def _wait_for_previous(uploads: "_Uploads") -> None:
    """Rank 0, before it reports: the previous upload, if still running (one in flight at most), and its
    report taken by the controller. A failure from here on resumes from it, at worst."""
    uploads.wait_persisted()
    wait_until_report_collected()


def _report_first(metrics: dict, ctx: WorkerContext, uploads: "_Uploads") -> tuple:
    """A step checkpoint's report before its write, on every rank; rank 0's ``(folder, writing, index)``:
    the empty folder reported, the future Ray Train's upload waits for (set once the folder is written),
    its index in ``uploads``. Every rank reports first or none does: Ray Train's report is a barrier
    across ranks (they agree on the checkpoint's name), so a rank in it and another in the gather that
    follows would wait for each other for ever."""
    if ctx.world_rank != 0:
        ray.train.report({k: v for k, v in metrics.items() if v is not None}, checkpoint=None)
        return None, None, None
    _wait_for_previous(uploads)
    directory, writing = tempfile.mkdtemp(prefix="raytrain-mgpu-ckpt-"), Future()
    try:
        index = _report(metrics, directory, _checkpoint_dir_name(), CheckpointUploadMode.ASYNC, uploads, writing)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, writing, index


def _report(metrics: dict, directory: str, name: str, upload: CheckpointUploadMode, uploads: "_Uploads",
            writing: Optional[Future] = None) -> int:
    """Report ``directory`` as the checkpoint ``name`` (Ray Train copies every rank's folder into it);
    its index in ``uploads``, added before the report: once Ray names it latest, the ones before are persisted.
    ``writing``: DCP's asynchronous save still writing into ``directory``; Ray Train's upload thread
    waits for it before copying (an error there fails training at once, as a failed upload does)."""
    index = uploads.add(name)
    extra = {}
    if writing is not None:
        storage = ray.train.get_context().get_storage()

        def upload_when_written(checkpoint, checkpoint_dir_name):
            writing.result()
            return storage.persist_current_checkpoint(checkpoint, checkpoint_dir_name)

        extra["checkpoint_upload_fn"] = upload_when_written
    ray.train.report({k: v for k, v in metrics.items() if v is not None},
                     checkpoint=ray.train.Checkpoint.from_directory(directory), checkpoint_dir_name=name,
                     checkpoint_upload_mode=upload, delete_local_checkpoint_after_upload=True, **extra)
    return index


def _save_best(cfg: TrainConfig, directory: str, meta: dict, history: list, model_state: Optional[dict]) -> None:
    """The best copy from the checkpoint folder, or for a sharded one from the gathered model."""
    if model_state is None:
        RunFolder.of(cfg).save_best(directory)
        return
    staging = tempfile.mkdtemp(prefix="raytrain-mgpu-best-")
    try:
        ckpt_format.write_checkpoint(staging, meta=meta, history=history, model_state=model_state)
        RunFolder.of(cfg).save_best(staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _checkpoint_dir_name() -> str:
    """Ray Train's own naming (``checkpoint_<time>``), chosen here so that rank 0 knows the folder
    its asynchronous upload writes (Ray Train uses rank 0's name on every rank)."""
    return f"checkpoint_{datetime.today():%Y-%m-%d_%H-%M-%S.%f}"


class _Uploads:
    """Rank 0's asynchronous checkpoint uploads, in report order (Ray Train runs one at a time).

    A checkpoint is persisted once ``ray.train.get_checkpoint()`` (set by Ray Train after the
    upload, just before the report is queued for the controller) names it or a later one of ours.
    ``names`` holds every checkpoint this rank reported, synchronous ones included: the announcer
    may look only after a later (the run's last, synchronous) save has replaced the latest, and
    must still find it later (a CI run hung here when only the asynchronous ones were listed).
    A single thread then waits for the controller to take the report and tells the driver
    (``on_checkpoint``), one checkpoint after the other.
    """

    _current: Optional["_Uploads"] = None
    POLL_S = 0.02

    def __init__(self, owner):
        self.owner = owner
        self.names: List[str] = []
        self._pending: queue.Queue = queue.Queue()  # (index, folder, reporter), announced in order
        self._announcer: Optional[threading.Thread] = None

    @classmethod
    def current(cls) -> "_Uploads":
        """This worker's tracker (a new one for a new Ray Train context: a restarted attempt)."""
        owner = _train_context()
        if cls._current is None or cls._current.owner is not owner:
            cls._current = cls(owner)
        return cls._current

    def add(self, name: str) -> int:
        """A checkpoint about to be reported (either upload mode); its index in ``names``."""
        self.names.append(name)
        return len(self.names) - 1

    def _persisted_index(self) -> int:
        """Index in ``names`` of the newest checkpoint Ray Train has persisted, -1 for none."""
        try:
            latest = ray.train.get_checkpoint()
        except RuntimeError:  # outside a Ray Train worker (a unit test): nothing to wait for
            return len(self.names) - 1
        name = os.path.basename(latest.path.rstrip("/")) if latest is not None else None
        return self.names.index(name) if name in self.names else -1

    def wait_persisted(self, index: int = -1, timeout_s: Optional[float] = None) -> bool:
        """Block until ``names[index]`` (default: the newest) is persisted; False after ``timeout_s``."""
        if not self.names:
            return True
        target = index % len(self.names)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._persisted_index() < target:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(self.POLL_S)  # the upload thread sets it; Ray Train offers no event to wait on
        return True

    def announce_when_persisted(self, index: int, folder: RunFolder, reporter: Optional[WorkerReporter]) -> None:
        """Tell the driver about ``names[index]`` once it is persisted (in a thread, in order)."""
        if reporter is None:  # nobody to tell (a unit test)
            return
        if self._announcer is None:  # a daemon: a worker that exits never waits for it
            self._announcer = threading.Thread(target=self._announce_all, name="raytrain-mgpu-ckpt-announce",
                                               daemon=True)
            self._announcer.start()
        self._pending.put((index, folder, reporter))

    def _announce_all(self) -> None:
        while True:
            index, folder, reporter = self._pending.get()
            try:
                self._announce(index, folder, reporter)
            finally:
                self._pending.task_done()

    def _announce(self, index: int, folder: RunFolder, reporter: Optional[WorkerReporter]) -> None:
        try:
            self.wait_persisted(index)
            wait_until_report_collected()  # as the synchronous path: announced once the controller has it
            latest = ray.train.get_checkpoint()  # this one or a later one: a sibling in the storage filesystem
            if reporter is not None and latest is not None:
                reporter.checkpoint(folder.uri_of(f"{latest.path.rstrip('/').rsplit('/', 1)[0]}/{self.names[index]}"))
        except Exception:  # never fails training: the checkpoint itself is registered by Ray Train
            logger.exception("could not announce checkpoint %s to the driver", self.names[index])

    def flush(self, timeout_s: float = 300.0) -> bool:
        """Wait until every asynchronous checkpoint so far is announced; False (and a warning) after
        ``timeout_s``: the checkpoints are registered by Ray Train either way, only the driver's
        ``on_checkpoint`` would be missing, and the run's end must not wait on it forever."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:
            if time.monotonic() > deadline:
                logger.warning("checkpoint announcements still pending after %.0f s; finishing without them",
                               timeout_s)
                return False
            time.sleep(self.POLL_S)
        return True


def _train_context():
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context()
    except Exception:  # not in a Ray Train worker (unit tests)
        return None
