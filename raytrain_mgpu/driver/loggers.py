"""The built-in loggers of ``TrainConfig.loggers``: callbacks that write the run's scalars.

Each is a :class:`~raytrain_mgpu.driver.callbacks.Callback` that ``fit`` adds before the
user's own. Per-step scalars keep their names (``train/loss``, ``stage0/bubble``, ...) at the
global optimizer step; an epoch's numeric history values go under ``epoch/<key>`` at the
step the epoch ended (lists, strings and ``None`` are left out); where the run's time went
(``TrainResult.goodput``) goes under ``goodput/<kind>_s`` at its last step when it ends.

- ``tensorboard``: event files under ``<run>/tensorboard`` (``torch.utils.tensorboard``,
  which needs the ``tensorboard`` package: ``pip install raytrain-mgpu[tensorboard]``).
- ``mlflow``: one MLflow run per training run, in experiment ``raytrain-mgpu``, named after
  the run; params = the config, metrics per step and per epoch. Its id is kept in
  ``<run>/mlflow_run.json`` so that a resume logs to the same MLflow run.
- ``csv``: ``<run>/metrics.csv``, one row per scalar: ``step,epoch,name,value``.
- ``wandb``: one Weights & Biases run per training run, in project ``$WANDB_PROJECT`` (default
  ``raytrain-mgpu``), named after the run; config = the config, history = the scalars per step and
  per epoch, summary = the final metrics. Its id is kept in ``<run>/wandb_run.json`` so that a
  resume continues the same W&B run. W&B's own variables apply (``WANDB_MODE=offline``,
  ``WANDB_DIR``, ``WANDB_ENTITY``, ...).

A resume (or a restart after a failure, which redoes the steps after the last checkpoint)
does not duplicate steps in TensorBoard and the CSV: TensorBoard's ``purge_step`` hides the
events at and after the first redone step, and the CSV drops its rows from there. MLflow
keeps every value it was sent (its metric history is append-only): redone steps appear twice.
W&B's history is append-only too, and a W&B server drops a step below the run's last one: the
W&B logger sends each step once, and skips the steps a run (or the fit it resumes) already sent.

Remote storage (``s3://``, ``gs://``, ...): TensorBoard and the CSV are written to a local
temporary folder and uploaded through pyarrow after every epoch and at the end. MLflow's
default file store (``file:<run>/mlruns``) needs local storage; set ``mlflow_tracking_uri``
otherwise.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import pyarrow.fs as pafs

from raytrain_mgpu.driver.callbacks import Callback, RunInfo
from raytrain_mgpu.driver.goodput import KINDS
from raytrain_mgpu.checkpointing.run_folder import RunFolder

logger = logging.getLogger(__name__)

__all__ = ["build_loggers", "TensorBoardLogger", "MlflowLogger", "CsvLogger", "WandbLogger", "epoch_scalars",
           "goodput_scalars",
           "TENSORBOARD_DIR", "CSV_FILE", "MLFLOW_RUN_FILE", "MLFLOW_EXPERIMENT", "WANDB_RUN_FILE", "WANDB_PROJECT"]

TENSORBOARD_DIR = "tensorboard"
CSV_FILE = "metrics.csv"
MLFLOW_RUN_FILE = "mlflow_run.json"
MLFLOW_EXPERIMENT = "raytrain-mgpu"
WANDB_RUN_FILE = "wandb_run.json"
WANDB_PROJECT = "raytrain-mgpu"  # where $WANDB_PROJECT is unset: the name of MLflow's experiment


def epoch_scalars(row: dict) -> Dict[str, float]:
    """A history row's numeric values as ``epoch/<key>`` scalars."""
    return {f"epoch/{key}": float(value) for key, value in row.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def goodput_scalars(result) -> Dict[str, float]:
    """Where the run's time went (``TrainResult.goodput``: ``driver/goodput.py``) as ``goodput/<kind>_s`` scalars,
    logged at the run's last step when it ends."""
    ledger = getattr(result, "goodput", None) or {}
    return {f"goodput/{kind}_s": float(ledger[kind]) for kind in (*KINDS, "wall") if ledger.get(kind) is not None}


def _needs(module: str, logger_name: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"TrainConfig.loggers={logger_name!r} needs the {module} package, which is not "
                         f"installed. Install it with: pip install 'raytrain-mgpu[{extra}]'.")


class _Redone:
    """Tells a restart's redone steps: a step before the last one, or the last one again with a
    name it already had (two events may share a step: the pipeline's ``train/*`` and ``stage*/*``)."""

    def __init__(self, step: int):
        self.step, self.names = step, set()

    def check(self, step: int, scalars: dict) -> bool:
        redone = step < self.step or (step == self.step and not self.names.isdisjoint(scalars))
        if step != self.step or redone:
            self.step, self.names = step, set()
        self.names.update(scalars)
        return redone


class _LocalCopy:
    """A local folder for a logger's files: the run folder itself where it is local, else a
    temporary folder whose files :meth:`upload` copies into ``<run>/<name>``."""

    def __init__(self, folder: RunFolder, name: str):
        self.folder, self.name = folder, name
        self._tmp = None if folder.is_local else tempfile.TemporaryDirectory(prefix=f"raytrain-mgpu-{name}-")
        self.path = folder.join(name) if self._tmp is None else self._tmp.name
        os.makedirs(self.path, exist_ok=True)

    def upload(self) -> None:
        if self._tmp is None:
            return
        self.folder.fs.create_dir(self.folder.join(self.name), recursive=True)
        pafs.copy_files(self.path, self.folder.join(self.name), source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=self.folder.fs)

    def close(self) -> None:
        self.upload()
        if self._tmp is not None:
            self._tmp.cleanup()


class TensorBoardLogger(Callback):
    """Event files under ``<run>/tensorboard``; a resume continues them (``purge_step``)."""

    def __init__(self, folder: RunFolder):
        _needs("tensorboard", "tensorboard", "tensorboard")
        self.folder, self._writer, self._copy, self._redone = folder, None, None, _Redone(0)

    def _open(self, purge_step=None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # late: needs tensorboard, an optional dependency

        if self._writer is not None:
            self._writer.close()
        self._writer = SummaryWriter(self._copy.path, purge_step=purge_step)

    def on_train_start(self, run: RunInfo) -> None:
        self._copy = _LocalCopy(self.folder, TENSORBOARD_DIR)
        self._redone = _Redone(run.start_step)
        # A resume redoes nothing before its checkpoint; what a killed run logged after it is hidden.
        self._open(purge_step=run.start_step + 1 if run.resumed else None)

    def on_step(self, step: int, scalars: dict) -> None:
        if self._redone.check(step, scalars):
            self._open(purge_step=step)  # a restart redoes steps: hide the first attempt's from here on
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        for name, value in epoch_scalars(metrics).items():
            self._writer.add_scalar(name, value, global_step=metrics["step"])
        self._writer.flush()
        self._copy.upload()

    def on_train_end(self, result) -> None:
        for name, value in goodput_scalars(result).items():
            self._writer.add_scalar(name, value, global_step=result.metrics.get("step", 0))
        self._writer.flush()
        self._copy.upload()

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._copy.close()
            self._writer = None


class CsvLogger(Callback):
    """``<run>/metrics.csv``: ``step,epoch,name,value`` per scalar; appended on a resume."""

    HEADER = ["step", "epoch", "name", "value"]

    def __init__(self, folder: RunFolder):
        self.folder, self._tmp, self._epoch, self._redone = folder, None, 1, _Redone(0)

    def on_train_start(self, run: RunInfo) -> None:
        if self.folder.is_local:
            self._path = self.folder.join(CSV_FILE)
            self.folder.fs.create_dir(self.folder.path, recursive=True)
        else:  # a local copy, uploaded whole after each epoch
            self._tmp = tempfile.TemporaryDirectory(prefix="raytrain-mgpu-csv-")
            self._path = os.path.join(self._tmp.name, CSV_FILE)
            text = self.folder.read_text(CSV_FILE)
            if text is not None:
                with open(self._path, "w") as f:
                    f.write(text)
        self._epoch, self._redone = run.start_epoch + 1, _Redone(run.start_step)
        self._drop_from(run.start_step + 1)

    def _drop_from(self, step: int) -> None:
        """Rows at ``step`` and after go: they are trained again."""
        if not os.path.exists(self._path):
            with open(self._path, "w", newline="") as f:
                csv.writer(f).writerow(self.HEADER)
            return
        with open(self._path, newline="") as f:
            rows = list(csv.reader(f))
        kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) < step]
        if len(kept) != len(rows):
            with open(self._path, "w", newline="") as f:
                csv.writer(f).writerows(kept)

    def _append(self, step: int, epoch: int, values: dict) -> None:
        with open(self._path, "a", newline="") as f:
            csv.writer(f).writerows([step, epoch, name, repr(float(value))] for name, value in values.items())

    def on_step(self, step: int, scalars: dict) -> None:
        if self._redone.check(step, scalars):
            self._drop_from(step)  # a restart redoes steps
        self._append(step, self._epoch, scalars)

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        self._append(metrics["step"], epoch, epoch_scalars(metrics))
        self._epoch = epoch + 1
        self._upload()

    def on_train_end(self, result) -> None:
        self._append(result.metrics.get("step", 0), self._epoch - 1, goodput_scalars(result))
        self._upload()

    def _upload(self) -> None:
        if self._tmp is not None:
            with open(self._path) as f:
                self.folder.write_text(CSV_FILE, f.read())

    def close(self, failed: bool = False) -> None:
        if self._tmp is not None:
            self._upload()
            self._tmp.cleanup()
            self._tmp = None


class MlflowLogger(Callback):
    """One MLflow run per training run (its id in ``<run>/mlflow_run.json``); a resume logs to it again."""

    def __init__(self, folder: RunFolder, tracking_uri):
        _needs("mlflow", "mlflow", "mlflow")
        if tracking_uri is None:
            if not folder.is_local:
                raise ValueError(f"TrainConfig.loggers=['mlflow'] with storage_path on {folder.display}: the "
                                 f"default MLflow store (file:<run>/mlruns) needs local storage. Set "
                                 f"mlflow_tracking_uri to your MLflow server, e.g. http://mlflow:5000.")
            tracking_uri = "file:" + folder.join("mlruns")
        if tracking_uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked for it; it is what works offline.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.folder, self.tracking_uri, self._client, self.run_id = folder, tracking_uri, None, None

    def on_train_start(self, run: RunInfo) -> None:
        # late: optional dependency (mlflow-skinny), here and in _log
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = self._client = MlflowClient(self.tracking_uri)
        kept = self.folder.read_json(self.folder.join(MLFLOW_RUN_FILE)) or {}
        if kept.get("tracking_uri") == self.tracking_uri and self._exists(kept.get("run_id")):
            self.run_id = kept["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(MLFLOW_EXPERIMENT))
            self.run_id = client.create_run(experiment_id, run_name=run.config.get("name")).info.run_id
            self.folder.write_json(MLFLOW_RUN_FILE, {"run_id": self.run_id, "tracking_uri": self.tracking_uri})
        # A param cannot change in MLflow: a resume adds the ones the run does not have yet.
        logged = client.get_run(self.run_id).data.params
        params = [Param(key, str(value)[:6000]) for key, value in sorted(run.config.items()) if key not in logged]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(self.run_id, params=params[start:start + 100])

    def _exists(self, run_id) -> bool:
        if not run_id:
            return False
        try:
            return self._client.get_run(run_id).info.lifecycle_stage == "active"
        except Exception:  # deleted, or another store: a new run
            return False

    def _log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric  # late: optional dependency

        now = int(time.time() * 1000)
        metrics = [Metric(name, float(value), now, step) for name, value in values.items()]
        for start in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def on_step(self, step: int, scalars: dict) -> None:
        self._log(step, scalars)

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        self._log(metrics["step"], epoch_scalars(metrics))

    def on_train_end(self, result) -> None:
        self._log(result.metrics.get("step", 0), goodput_scalars(result))

    def close(self, failed: bool = False) -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
            self._client = None


class WandbLogger(Callback):
    """One W&B run per training run (its id and last step in ``<run>/wandb_run.json``); a resume
    continues it (``resume="allow"``) and never sends a step twice."""

    def __init__(self, folder: RunFolder):
        _needs("wandb", "wandb", "wandb")
        self.folder, self._run, self._sent = folder, None, (0, set())

    def on_train_start(self, run: RunInfo) -> None:
        import wandb  # late: optional dependency

        kept = self.folder.read_json(self.folder.join(WANDB_RUN_FILE)) or {}
        self._sent = (int(kept.get("step", 0)), set(kept.get("names", [])))
        # create_new: a run of our own, whatever run the user's code has open (wandb.run is left alone)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT, name=run.config.get("name"),
                               id=kept.get("run_id"), resume="allow", config=run.config, reinit="create_new")
        if not kept.get("run_id"):
            self._keep()

    def _keep(self) -> None:
        step, names = self._sent
        self.folder.write_json(WANDB_RUN_FILE, {"run_id": self._run.id, "step": step, "names": sorted(names)})

    def _log(self, step: int, values: dict) -> None:
        """Sends what was not sent: a later step, or new names at the last step sent (the pipeline's
        stage figures, an epoch's scalars); a restart's redone steps were sent by the first attempt."""
        last, names = self._sent
        if step < last or (step == last and not names.isdisjoint(values)):
            return
        self._sent = (step, names | set(values) if step == last else set(values))
        self._run.log({name: float(value) for name, value in values.items()}, step=step)

    def on_step(self, step: int, scalars: dict) -> None:
        self._log(step, scalars)

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        self._log(metrics["step"], epoch_scalars(metrics))
        self._keep()  # a resume after a crash skips the steps sent before it

    def on_train_end(self, result) -> None:
        # the runs table's columns: the last epoch's row under its own names (train_loss, test_accuracy, ...)
        self._run.summary.update({key.split("/", 1)[1]: value for key, value in epoch_scalars(result.metrics).items()})
        self._log(result.metrics.get("step", 0), goodput_scalars(result))

    def close(self, failed: bool = False) -> None:
        if self._run is not None:
            self._keep()
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


_BUILDERS: Dict[str, Callable] = {
    "tensorboard": lambda folder, cfg: TensorBoardLogger(folder),
    "mlflow": lambda folder, cfg: MlflowLogger(folder, cfg.mlflow_tracking_uri),
    "csv": lambda folder, cfg: CsvLogger(folder),
    "wandb": lambda folder, cfg: WandbLogger(folder),
}


def build_loggers(cfg) -> List[Tuple[str, Callback]]:
    """``(label, logger)`` for each of ``cfg.loggers``; a missing package fails here, before Ray."""
    folder = RunFolder.of(cfg)
    return [(f"loggers entry {name!r}", _BUILDERS[name](folder, cfg)) for name in cfg.loggers]
