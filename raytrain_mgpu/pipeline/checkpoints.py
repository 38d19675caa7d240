"""The pipeline runner's checkpoints: per epoch and every ``checkpoint_every_n_steps``, written in the background.

A save stalls the stages only for taking their state: each stage of replica 0 copies its weights,
optimizer and LR-schedule states, generator and (for a step checkpoint) its partial epoch sums to
CPU (:func:`snapshot`) and hands them to its :class:`BackgroundWriter`, which writes
``model-stage{p}.pt`` and ``train_state-stage{p}.pt`` into a temporary folder of the run folder
while the stages train on. On the driver, :class:`CheckpointSaver`'s own writer thread waits for
every stage's part (``wait_upload``, an actor method in its own concurrency group, so it answers
while the stage trains), then writes ``meta.json`` (last: it marks the checkpoint complete) and
``history.json`` and publishes the folder under its name. One upload at a time: the next save
first waits for the previous one; a failed upload is raised at the driver's next look (after the
next steps call), at the next save, or at the end, which also waits for the last upload. A stage
killed mid-upload leaves a temporary folder without ``meta.json``: never a resume point (the next
attempt removes it, ``RunFolder.remove_temporaries``).

Names: ``checkpoint_epoch{E:06d}`` after epoch E, ``checkpoint_epoch{E:06d}_step{S:09d}`` for a step
checkpoint after global step S of the epoch after E: names sort by age, so ``num_checkpoints_to_keep``
keeps the newest N of both kinds (as the Ray Train runner does, ``runtime/step_checkpoints.py``).
A step checkpoint's ``meta.json`` holds ``step_in_epoch``, ``epoch_elapsed_s`` (the driver's clock of
the unfinished epoch) and ``epoch_partial_per_rank``: every rank's sums of it (:func:`epoch_partial`,
a few numbers: every replica's, as each replica's last stage measures its own share of the loss).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from raytrain_mgpu._redact import redact
from raytrain_mgpu.runtime import checkpoint as ckpt_format
from raytrain_mgpu.runtime.run_folder import RunFolder
from raytrain_mgpu.runtime.run_state import RunState, best_row, checkpoint_meta
from raytrain_mgpu.runtime.step_checkpoints import STEP_IN_EPOCH

logger = logging.getLogger(__name__)

__all__ = ["BackgroundWriter", "CheckpointSaver", "snapshot", "epoch_partial", "resume_sums", "checkpoint_name",
           "CHECKPOINT_PREFIX", "SYNC_UPLOAD_ENV", "EPOCH_ELAPSED", "EPOCH_PARTIALS"]

CHECKPOINT_PREFIX = "checkpoint_epoch"
EPOCH_ELAPSED = "epoch_elapsed_s"
"""A step checkpoint's ``meta.json`` key: the unfinished epoch's wall time so far (its row's throughput)."""
EPOCH_PARTIALS = "epoch_partial_per_rank"
"""A step checkpoint's ``meta.json`` key: every rank's :func:`epoch_partial`, in rank order."""
SYNC_UPLOAD_ENV = "RAYTRAIN_MGPU_PIPELINE_SYNC_UPLOAD"
"""Set to 1 to wait for every upload before training on (to measure what the background write saves)."""
_TOTALS_KEYS = ("steps", "busy_s", "schedule_s", "step_s", "data_wait_s", "bytes_sent")


def checkpoint_name(epochs_done: int, step: Optional[int] = None) -> str:
    """``checkpoint_epoch{E}`` after epoch E, or a step checkpoint's inside the next epoch."""
    name = f"{CHECKPOINT_PREFIX}{epochs_done:06d}"
    return name if step is None else f"{name}_step{step:09d}"


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor copied to CPU (a copy also of a CPU tensor: training goes on in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(v) for v in value)
    return value


def snapshot(model_state: dict, optimizer, scheduler) -> tuple:
    """``(model state, train state)`` of a stage, copied to CPU (the stall a save costs the stage)."""
    train_state = {"optimizer": cpu_copy(optimizer.state_dict()), "scheduler": cpu_copy(scheduler.state_dict()),
                   "torch_rng": torch.get_rng_state()}
    return cpu_copy(model_state), train_state


def epoch_partial(totals, meter=None) -> dict:
    """A rank's sums of the unfinished epoch, as JSON (floats round-trip exactly): its :class:`StageTotals`
    counters and, on a last stage, its meter's loss and metric sums (one device read)."""
    part = meter.partial() if meter is not None else None
    return {"totals": {k: getattr(totals, k) for k in _TOTALS_KEYS},
            "meter": None if part is None else {**part, "totals": part["totals"].tolist()}}


def resume_sums(partial: dict, totals, meter) -> None:
    """Continue an epoch's sums from a rank's :func:`epoch_partial`."""
    for key in _TOTALS_KEYS:
        setattr(totals, key, partial["totals"][key])
    if partial["meter"] is not None:
        meter.resume([{**partial["meter"], "totals": torch.tensor(partial["meter"]["totals"], dtype=torch.float64)}])


class BackgroundWriter:
    """Runs one job at a time in a thread: :meth:`submit` first waits for the previous job and raises its
    failure; :meth:`wait` waits for the current one and returns its result (or raises its failure). Safe
    from several threads (a stage's ``wait_upload`` runs beside its ``save``): one of them takes the outcome."""

    def __init__(self, what: str):
        self.what = what
        self._thread: Optional[threading.Thread] = None
        self._outcome: tuple = (None, None)
        self._lock = threading.RLock()

    def submit(self, job: Callable, *args) -> None:
        with self._lock:
            self.wait()
            self._start(job, args)

    def _start(self, job: Callable, args: tuple) -> None:
        def run():
            try:
                self._outcome = (job(*args), None)
            except BaseException as exc:  # raised on the caller's thread at its next wait
                self._outcome = (None, exc)

        self._thread = threading.Thread(target=run, name=f"raytrain-mgpu {self.what}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The last job's result (once; None after), or its failure raised; ``TimeoutError`` if still running."""
        with self._lock:
            if self._thread is None:
                return None
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.what} still running after {timeout} s")
            self._thread = None
            (result, error), self._outcome = self._outcome, (None, None)
        if error is not None:  # as it was raised (a dead stage's RayActorError stays retryable: runner.py)
            error.add_note(f"raised by the {self.what}, in the background")
            raise error
        return result


class CheckpointSaver:
    """The driver's side of the pipeline's checkpoints for one attempt (``driver.train_attempt``)."""

    def __init__(self, cfg, group, partition, shape_info: dict):
        self.cfg, self.group, self.partition, self.shape_info = cfg, group, partition, shape_info
        self.folder = RunFolder.of(cfg)
        self.uploads = BackgroundWriter("checkpoint upload")
        self.sync = os.environ.get(SYNC_UPLOAD_ENV) == "1"

    def save(self, state: RunState, reporter, epoch_elapsed_s: Optional[float] = None,
             row: Optional[dict] = None) -> str:
        """Checkpoint ``state`` (a step checkpoint when ``epoch_elapsed_s`` is given); its URI once published.
        ``row``: the epoch's history row, whose ``checkpoint_s`` gains what the stages waited for this one
        (before its history is handed to the writer; a synchronous upload's wait after that is not in it)."""
        started = time.perf_counter()
        self._report(reporter, self.uploads.wait())  # one upload at a time; a failed one is raised here
        waited = time.perf_counter() - started
        step = epoch_elapsed_s is not None
        name = checkpoint_name(state.epoch, state.step if step else None)
        tmp = self.folder.temporary(name)
        partials = self.group.call("save", tmp, step)  # each stage snapshots its state, writes it in the background
        extra = {STEP_IN_EPOCH: state.step_in_epoch, EPOCH_ELAPSED: epoch_elapsed_s, EPOCH_PARTIALS: partials} \
            if step else {}
        meta = checkpoint_meta(self.cfg, state, self.shape_info, partition=list(self.partition.counts),
                               num_stages=self.cfg.num_stages, schedule=self.cfg.schedule, **extra)
        if row is not None:
            row["checkpoint_s"] = row.get("checkpoint_s", 0.0) + time.perf_counter() - started
        self.uploads.submit(self._publish, tmp, name, meta, list(state.history))
        if self.sync:
            self._report(reporter, self.uploads.wait())
        stall = time.perf_counter() - started  # what the stages waited: logged, for measuring it
        logger.info("checkpoint %s: the stages paused %.3f s (%.3f s waiting for the previous upload)%s",
                    name, stall, waited, " (synchronous upload)" if self.sync else "",
                    extra={"checkpoint_stall_s": stall})
        return self.folder.uri_of(self.folder.join(name))

    def poll(self, reporter) -> None:
        """Between steps calls: report a finished upload (or raise its failure)."""
        if self.uploads.done():
            self._report(reporter, self.uploads.wait())

    def finish(self, reporter) -> None:
        """The run's end waits for the last upload."""
        self._report(reporter, self.uploads.wait())

    def abandon(self, timeout: float) -> None:
        """After a failure: let an upload in flight finish if it can (bounded); its failure is only logged."""
        try:
            self.uploads.wait(timeout)
        except Exception as exc:  # the attempt's own failure is what the caller raises
            logger.warning("the checkpoint upload in flight was not completed: %s", exc)

    def _publish(self, tmp: str, name: str, meta: dict, history: list) -> str:
        """On the writer thread: every stage's parts, then ``meta.json`` last, then the checkpoint's name."""
        started = time.perf_counter()
        self.group.wait_uploads()
        with self.folder.writable(tmp) as directory:
            ckpt_format.write_checkpoint(directory, meta=meta, history=history)  # last: marks it complete
        published = self.folder.publish(tmp, name)
        best = best_row(history, self.cfg.monitor, self.cfg.mode) if self.cfg.keep_best else None
        self.folder.prune(CHECKPOINT_PREFIX, self.cfg.num_checkpoints_to_keep,  # keep_best: the best besides
                          spare=None if best is None else checkpoint_name(best["epoch"]))  # the last N
        logger.info("checkpoint %s (uploaded in %.3f s)", redact(published.uri), time.perf_counter() - started)
        return published.uri

    @staticmethod
    def _report(reporter, uri: Optional[str]) -> None:
        if uri is not None and hasattr(reporter, "checkpoint"):  # RunEvents (fit's); a caller's may not listen
            reporter.checkpoint(uri)
