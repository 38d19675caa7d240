"""Hyperparameter search with Ray Tune: each trial is one ``fit`` with the trial's values.

    tuner = tune.Tuner(raytrain_mgpu.tune.trainable(cfg), param_space={"lr": tune.loguniform(1e-4, 1e-1)},
                       tune_config=tune.TuneConfig(metric="val_accuracy", mode="max", num_samples=8,
                                                   scheduler=ASHAScheduler(max_t=cfg.epochs),
                                                   max_concurrent_trials=max_concurrent_trials(cfg)))

- A trial's values are ``TrainConfig`` fields (any of them, checked like ``replace``); its run is
  ``{storage_path}/{name}-{trial id}``, a run folder like any other: a restored trial resumes from
  its last checkpoint, as ``fit`` always does, and ``raytrain-mgpu plot`` draws it.
- Every epoch's row (its numbers) goes to ``ray.tune.report``, so a scheduler (ASHA, PBT's
  ``training_iteration`` is the epoch count) stops or compares trials by ``val_*``/``test_*``/``train_*``.
  A stopped trial's process ends, and its Ray Train workers with it.
- A run of one worker that needs nothing only Ray provides (``runner="auto"``, the in-process runner's
  rules: ``transports/local.py``) trains inside its trial's own process, which holds the worker's resources
  (its CPUs and GPU): no Ray Train worker group per trial. Otherwise the trial's process only drives
  ``fit`` (:data:`TRIAL_RESOURCES`: no CPU) and the training bundles are the run's, requested by ``fit``.
  Trials beyond what the cluster holds at once would wait for their bundles (a pipeline's for at most its
  placement timeout, then fail): :func:`max_concurrent_trials` is how many runs of ``cfg`` fit the
  cluster together, for ``TuneConfig(max_concurrent_trials=...)``, so the others queue in Tune instead.

``raytrain-mgpu tune`` (:func:`search`) is the same from the command line.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Dict, List, Optional, Sequence

import ray
from ray import tune

from raytrain_mgpu.api import fit
from raytrain_mgpu.config import yaml_values as _yaml
from raytrain_mgpu.config.code import better_mode, monitor_keys
from raytrain_mgpu.config.factories import is_factory
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.driver import cluster  # by module: tests replace cluster.connect
from raytrain_mgpu.driver.callbacks import Callback
from raytrain_mgpu.planning.auto_devices import resolve_auto_devices
from raytrain_mgpu.strategies.plan import build_plan
from raytrain_mgpu.transports.base import local_refusal

__all__ = ["trainable", "max_concurrent_trials", "parse_param", "search", "default_metric", "TRIAL_RESOURCES"]

TRIAL_RESOURCES = {"CPU": 0, "memory": 1}
"""A trial's process only waits on its ``fit``: it holds no CPU (one byte of memory: Tune refuses a request of
nothing). With 0.01 CPU, a run whose workers take every CPU (2 workers on a 2-core machine: ``tune``'s defaults)
never got its bundles beside the trial: its placement waited out placement_timeout_s."""


class _ReportEpochs(Callback):
    """Every epoch's numbers to Ray Tune, from the trial's process (where ``fit``'s events arrive), once the
    epoch's checkpoint is published: Tune may stop a trial at any report (ASHA at a rung), and the epoch it
    was told of is then in the run folder, not lost with the trial's process.

    The last epoch (``epochs``) is reported once ``fit`` has returned: at that report ASHA stops the trial
    (``max_t``), killing its process, and a kill before Ray Train has shut its workers down leaves their
    placement group held. Ray Train's cleaner is to remove it, but it asks the state API, which fails where
    two Ray instances run on the machine ("Found multiple active Ray instances", a CI run): the next trial
    then waited for the CPUs for ever (tests/test_tune.py)."""

    def __init__(self, epochs: int):
        self.epochs = epochs
        self._pending: Optional[dict] = None

    def on_epoch_end(self, epoch: int, metrics: dict) -> None:
        self._pending = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def on_checkpoint(self, path: str) -> None:
        if self._pending is not None and self._pending.get("epoch", 0) < self.epochs:
            self._report()

    def on_train_end(self, result) -> None:
        self._report()  # the last epoch, or one no checkpoint followed

    def _report(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            tune.report(pending)


def in_trial(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s trials train inside their own process (one worker, nothing only Ray provides)."""
    return cfg.runner != "ray" and cfg.strategy != "auto" and local_refusal(cfg.replace(runner="local"),
                                                                           build_plan(cfg)) is None


def trainable(cfg: TrainConfig) -> Callable:
    """A Ray Tune trainable whose trials run ``fit(cfg.replace(**trial values))``, one run folder each; in the
    trial's own process, with the worker's resources, where the run can (:func:`in_trial`)."""
    cfg, _ = resolve_auto_devices(cfg)  # read once here: every trial trains the same layout
    inside = in_trial(cfg)

    def run_trial(values: dict) -> None:
        trial = tune.get_context().get_trial_id()
        trial_cfg = cfg.replace(**values, name=f"{cfg.name}-{trial}", **({"runner": "local"} if inside else {}))
        fit(trial_cfg.replace(callbacks=[*cfg.callbacks, _ReportEpochs(trial_cfg.epochs)]))

    run_trial.__name__ = f"raytrain_mgpu-{cfg.name}"  # Tune names the experiment's trials after it
    return tune.with_resources(run_trial, dict(build_plan(cfg).worker_resources) if inside else dict(TRIAL_RESOURCES))


def max_concurrent_trials(cfg: TrainConfig, resources: Optional[Dict[str, float]] = None) -> int:
    """How many runs of ``cfg`` the cluster (``ray.cluster_resources()``, or ``resources``) holds at once;
    1 for ``strategy="auto"``, whose layout each trial's ``fit`` chooses from the whole cluster."""
    if cfg.strategy == "auto":
        return 1
    cfg, _ = resolve_auto_devices(cfg)  # use_gpu/num_workers "auto": the layout the trials will have

    if resources is None:
        resources = ray.cluster_resources()
    needed: Dict[str, float] = {}
    for bundle in build_plan(cfg).bundles:
        for key, amount in bundle.items():
            needed[key] = needed.get(key, 0.0) + amount
    fits = [math.floor(resources.get(key, 0.0) / amount) for key, amount in needed.items() if amount > 0]
    return max(1, min(fits, default=1))


_PARAM = re.compile(r"^(?P<name>\w+)=(?P<kind>grid|choice|uniform|loguniform|randint):(?P<values>.+)$")


def parse_param(text: str):
    """``name=kind:values`` (``lr=loguniform:1e-4:1e-1``, ``batch_size=grid:32,64``, ``optimizer=choice:sgd,adamw``,
    ``uniform:lo:hi``, ``randint:lo:hi``) as ``(name, Tune search space)``; errors name the fix."""
    match = _PARAM.match(text.strip())
    fix = ("Write NAME=KIND:VALUES with KIND one of grid, choice (comma-separated values), uniform, loguniform, "
           "randint (LOW:HIGH), e.g. lr=loguniform:1e-4:1e-1.")
    if match is None:
        raise ValueError(f"--param {text!r}: not of the form NAME=KIND:VALUES. {fix}")
    name, kind, values = match["name"], match["kind"], match["values"]
    if name not in TrainConfig.field_names():
        raise ValueError(f"--param {text!r}: {name!r} is not a TrainConfig field. {fix}")
    if kind in ("grid", "choice"):
        options = [_yaml.load(v) for v in values.split(",")]  # grid:1e-3,5e-4 as numbers
        return name, tune.grid_search(options) if kind == "grid" else tune.choice(options)
    bounds = values.split(":")
    try:
        low, high = (float(b) for b in bounds) if len(bounds) == 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or not low < high or (kind == "loguniform" and low <= 0):
        raise ValueError(f"--param {text!r}: {kind} needs LOW:HIGH numbers with LOW < HIGH"
                         f"{' and LOW > 0' if kind == 'loguniform' else ''}. {fix}")
    if kind == "randint":
        return name, tune.randint(int(low), int(high))
    return name, (tune.loguniform if kind == "loguniform" else tune.uniform)(low, high)


def default_metric(cfg: TrainConfig) -> str:
    """The key trials are ranked by when none is named: ``cfg.monitor``, else the evaluated split's accuracy where
    the run records it (a registry dataset's classes, or ``accuracy`` in ``metrics``), else its loss. The validation
    split where ``val_fraction`` holds one out (trials must not be chosen by the test split), else the test split:
    a key every run of ``cfg`` has."""
    if cfg.monitor is not None:
        return cfg.monitor
    split = "val" if cfg.val_fraction is not None or (isinstance(cfg.dataset, dict) and "val" in cfg.dataset) else "test"
    accuracy = "accuracy" in cfg.metrics if cfg.metrics is not None else (
        isinstance(cfg.dataset, str) and not is_factory(cfg.dataset))
    return f"{split}_{'accuracy' if accuracy else 'loss'}"


def search(cfg: TrainConfig, params: Sequence[str], trials: int = 8, metric: Optional[str] = None,
           mode: Optional[str] = None, scheduler: str = "asha", stream=None):
    """``raytrain-mgpu tune``: ``trials`` trials of ``cfg`` over ``params`` (:func:`parse_param` texts), ASHA
    stopping trials early on ``metric`` per epoch (``scheduler="none"``: every trial trains every epoch);
    prints the trials table and the best values. Returns Ray Tune's ``ResultGrid``.

    ``metric`` None: :func:`default_metric`. ``mode`` None: ``cfg.mode``, which by default follows the metric
    (accuracy maximised, a loss minimised: ``config_code.better_mode``)."""
    space = dict(parse_param(p) for p in params)  # bad input fails before Ray
    metric = metric or default_metric(cfg)
    if metric not in monitor_keys(cfg):
        raise ValueError(f"--metric {metric!r}: not a history key of this run ({', '.join(monitor_keys(cfg))}). "
                         f"Pick one of them, or leave --metric out for {default_metric(cfg)}.")
    mode = better_mode(metric, cfg.metrics, mode or cfg.mode)
    if not trials >= 1:
        raise ValueError(f"--trials {trials}: at least 1 trial. Set --trials 8, say.")
    cfg, devices_line = resolve_auto_devices(cfg)  # use_gpu/num_workers "auto": the GPUs found, the layout on them
    if devices_line and stream is not None:
        stream.write(f"devices: {devices_line}\n")
    # a local Ray for the CLI, as fit starts one
    cluster.connect(cfg.address, cfg.verbose, local_has_gpu_check=cfg.use_gpu)
    asha = tune.schedulers.ASHAScheduler(max_t=cfg.epochs, grace_period=1) if scheduler == "asha" else None
    tuner = tune.Tuner(trainable(cfg), param_space=space,
                       tune_config=tune.TuneConfig(metric=metric, mode=mode, num_samples=trials, scheduler=asha,
                                                   max_concurrent_trials=max_concurrent_trials(cfg)),
                       run_config=tune.RunConfig(storage_path=cfg.storage_path, name=f"{cfg.name}-tune", verbose=0))
    results = tuner.fit()
    if stream is not None:
        stream.write(trials_table(results, list(space), metric) + "\n")
        best = results.get_best_result()
        stream.write(f"best ({'highest' if mode == 'max' else 'lowest'} {metric}): {best.config} "
                     f"{metric}={best.metrics.get(metric)}\n")
    return results


def trials_table(results, names: List[str], metric: str) -> str:
    """One line per trial: its values, the epochs it trained, its last ``metric``, and an error if it failed."""
    lines = [" | ".join(["trial", *names, "epochs", metric])]
    for result in results:
        values = [str(result.config.get(n)) for n in names]
        epochs = str(result.metrics.get("epoch", "-")) if result.metrics else "-"
        score = result.metrics.get(metric) if result.metrics else None
        status = f"{score:.4f}" if isinstance(score, float) else str(score)
        trial = (result.metrics or {}).get("trial_id", "?")
        lines.append(" | ".join([str(trial), *values, epochs, status + (f" (error: {result.error})" if result.error
                                                                          else "")]))
    return "\n".join(lines)
