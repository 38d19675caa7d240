"""Training curves from run histories: ``raytrain-mgpu plot RUN [RUN ...]``.

Like d2l's animator, but from the run folders after the fact (or while a run trains,
with ``--live``): loss and accuracy, or another history column, against epoch and
against optimizer step, one line per run and split, in one PNG::

    plot_runs(["/tmp/runs/demo", "file:///tmp/runs/demo_dpb"])   # -> /tmp/runs/demo/curves.png

Histories are read through :class:`~raytrain_mgpu.checkpointing.run_folder.RunFolder`, so a run
may be a local folder or any URI pyarrow opens. matplotlib loads on first use (Agg backend).
"""

from __future__ import annotations

import logging
import time
import uuid
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from raytrain_mgpu.checkpointing.files import filesystem
from raytrain_mgpu.checkpointing.run_folder import RunFolder

logger = logging.getLogger(__name__)

__all__ = ["plot_runs", "draw_runs", "watch_runs", "read_runs", "CURVES_FILE", "FIGSIZE", "DPI"]

CURVES_FILE = "curves.png"
FIGSIZE = (12.0, 7.5)
DPI = 100
"""The PNG is ``FIGSIZE * DPI`` pixels: 1200 x 750."""

LOSS_COLUMNS = ("train_loss", "test_loss")
ACCURACY_COLUMNS = ("train_accuracy", "test_accuracy")
_X_AXES = (("epoch", "epoch"), ("step", "optimizer step"))
_STYLE = {"train": dict(ls="-", marker="o"), "val": dict(ls=":", marker="^"), "test": dict(ls="--", marker="s")}


# ----------------------------------------------------------------------------- reading


def _name(folder: RunFolder) -> str:
    return folder.display.rstrip("/").rsplit("/", 1)[-1] or folder.display


def _last_step(rows: List[dict]) -> float:
    return max((row["step"] for row in rows if _is_number(row.get("step"))), default=-1)


def _history(folder: RunFolder) -> Optional[List[dict]]:
    """The rows that reach furthest: ``history.parquet`` (written when fit returns) or the
    newest checkpoint's history (written every checkpoint: a run that is training, was
    killed, or is being resumed past its old end)."""
    final = folder.read_history()
    running = folder.state().history
    if final is None or _last_step(running) > _last_step(final):
        return running or final
    return final


def read_runs(run_paths: Sequence[str], allow_empty: bool = False) -> Dict[str, List[dict]]:
    """``{run name: history rows}`` in the order given; a run's name is its folder's name.

    A run with no history yet (neither ``history.parquet`` nor a checkpoint) is a
    ``ValueError``, unless ``allow_empty`` (a live plot of a run in its first epoch).
    """
    runs: Dict[str, List[dict]] = {}
    for path in run_paths:
        folder = RunFolder(path)
        rows = _history(folder)
        if not rows and not allow_empty:
            raise ValueError(f"run {folder.display!r} has no history yet (no history.parquet, no checkpoint): is it "
                             f"a run folder ({{storage_path}}/{{name}}) of a run that finished an epoch?")
        name = _name(folder)
        runs[name if name not in runs else folder.display] = rows or []
    return runs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_columns(runs: Dict[str, List[dict]]) -> List[str]:
    return sorted({key for rows in runs.values() for row in rows for key, value in row.items() if _is_number(value)})


def _metric_columns(runs: Dict[str, List[dict]], metric: Optional[str]) -> Tuple[str, ...]:
    """The columns of the lower panels: train/test accuracy, or ``metric`` (``accuracy`` is
    ``train_accuracy`` and ``test_accuracy``); an unknown metric raises, naming those there are."""
    if metric is None:
        return _with_val(runs, ACCURACY_COLUMNS)
    there = _numeric_columns(runs)
    if metric in there or not there:  # no history anywhere yet (a live plot's first redraws): no verdict
        return (metric,)
    split = tuple(c for c in (f"train_{metric}", f"val_{metric}", f"test_{metric}") if c in there)
    if split:
        return split
    raise ValueError(f"metric {metric!r} is in no run's history ({', '.join(runs)}); the numeric columns there "
                     f"are: {', '.join(there) or 'none'}. Pass one of them as --metric, or leave it out for "
                     f"train/test accuracy.")


def _with_val(runs: Dict[str, List[dict]], columns: Tuple[str, ...]) -> Tuple[str, ...]:
    """``columns`` with ``val_<name>`` before each ``test_<name>`` where some run has it (``val_fraction``)."""
    there = _numeric_columns(runs)
    return tuple(c for column in columns for c in ((f"val_{column[5:]}", column) if column.startswith("test_")
                                                   and f"val_{column[5:]}" in there else (column,)))


def _series(rows: List[dict], x: str, column: str) -> Tuple[list, list]:
    """(x, y) for the rows where both are numbers (``test_*`` are None on epochs without evaluation)."""
    points = [(row[x], row[column]) for row in rows if _is_number(row.get(x)) and _is_number(row.get(column))]
    return [p[0] for p in points], [p[1] for p in points]


# ----------------------------------------------------------------------------- drawing


def draw_runs(runs: Dict[str, List[dict]], metric: Optional[str] = None, _logged: Optional[set] = None):
    """A matplotlib Figure of 2 x 2 panels: (loss, metric) x (per epoch, per step).

    One line per run and split, labelled ``"<run> <column>"``; a run's colour is the same in
    every panel, train is solid, test dashed. A column a run lacks (or holds no number in)
    is skipped with one log line (once per ``_logged`` set: a live plot's redraws share one).
    """
    # late: picks matplotlib's Agg backend, which must come before pyplot, when a chart is drawn (not on import: a
    # notebook that imports this module keeps its own backend until then); matplotlib takes 0.5 s to import
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # late: see above
    from matplotlib.ticker import MaxNLocator  # late: see above

    metric_columns = _metric_columns(runs, metric)
    logged = set() if _logged is None else _logged
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row_axes, columns, ylabel in ((axes[0], _with_val(runs, LOSS_COLUMNS), "loss"),
                                      (axes[1], metric_columns, metric or "accuracy")):
        for run_index, (name, rows) in enumerate(runs.items()):
            for column in columns:
                if not _series(rows, "epoch", column)[0]:
                    if (name, column) not in logged:
                        logged.add((name, column))
                        logger.warning("run %s: no %s in its history, not drawn", name, column)
                    continue
                split = column.split("_", 1)[0]
                style = _STYLE.get(split, _STYLE["train"])
                # Runs that agree (the same seed and batch under two strategies) draw the same
                # line: earlier runs are wider and paler underneath, so every one stays visible.
                under = (len(runs) - 1 - run_index) / max(len(runs) - 1, 1)
                for ax, (x, _) in zip(row_axes, _X_AXES):
                    xs, ys = _series(rows, x, column)
                    ax.plot(xs, ys, color=colors[run_index % len(colors)], label=f"{name} {column}",
                            lw=1.5 + 3.5 * under, ms=4 + 5 * under, alpha=1 - 0.45 * under, **style)
        for ax, (x, xlabel) in zip(row_axes, _X_AXES):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} per {xlabel}", fontsize=10)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.spines[["top", "right"]].set_visible(False)
            if ax.lines:
                ax.legend(fontsize=8, frameon=False)
    fig.suptitle(f"Training curves: {', '.join(runs)}", fontsize=11)
    fig.tight_layout()
    return fig


def _write_png(fig, out: str) -> None:
    """``out`` (a path or URI): temporary name, then rename, so a reader never sees half a PNG."""
    import io

    from matplotlib import pyplot as plt  # late: after draw_runs chose the backend

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    fs, path = filesystem(out)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{path.rsplit('/', 1)[-1]}.tmp-{uuid.uuid4().hex[:12]}" if parent else f".{path}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(buffer.getvalue())
    fs.move(tmp, path)


def _default_out(first_run: str) -> str:
    folder = RunFolder(first_run)
    return folder.uri_of(folder.join(CURVES_FILE))


def plot_runs(run_paths: Sequence[str], out: Optional[str] = None, metric: Optional[str] = None,
              allow_empty: bool = False, _logged: Optional[set] = None) -> str:
    """Draw the runs' curves (:func:`draw_runs`) to a PNG; returns where it went.

    ``out``: a path or URI; default ``<first run>/curves.png`` (a URI for a URI run).
    """
    if not run_paths:
        raise ValueError("plot needs at least one run folder ({storage_path}/{name})")
    runs = read_runs(run_paths, allow_empty=allow_empty)
    target = out or _default_out(run_paths[0])
    _write_png(draw_runs(runs, metric, _logged), target)
    logger.info("curves of %s: %s", ", ".join(runs), target)
    return target


# ----------------------------------------------------------------------------- live


def _finished(path: str) -> bool:
    """The run's state (its newest checkpoint) has reached the epochs or max_steps it was started with."""
    state = RunFolder(path).state()
    config = state.meta.get("config") or {}
    if "epochs" not in config:
        return False  # no checkpoint yet
    # the stored config's own stopping rule, early stopping included (a run stopped early is finished)
    return state.finished(SimpleNamespace(epochs=config["epochs"], max_steps=config.get("max_steps"),
                                          monitor=config.get("monitor"), mode=config.get("mode", "min"),
                                          metrics=config.get("metrics"),
                                          early_stopping_patience=config.get("early_stopping_patience")))


def watch_runs(run_paths: Sequence[str], out: Optional[str] = None, metric: Optional[str] = None,
               every_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> str:
    """Redraw :func:`plot_runs` every ``every_s`` seconds until every run is finished, or Ctrl-C.

    A run that stops without finishing (failed, killed) keeps the loop going: Ctrl-C ends it,
    and the last PNG stays.
    """
    if every_s <= 0:
        raise ValueError(f"every_s={every_s!r}: the seconds between redraws must be > 0; e.g. --every 5")
    target = out or _default_out(run_paths[0])
    logged: set = set()
    try:
        while True:
            done = all(_finished(path) for path in run_paths)  # before reading: the last redraw sees all
            plot_runs(run_paths, out=target, metric=metric, allow_empty=True, _logged=logged)
            if done:
                logger.info("every run finished: %s", target)
                return target
            sleep(every_s)
    except KeyboardInterrupt:
        logger.info("stopped; the last curves: %s", target)
        return target
