"""``raytrain-mgpu goodput RUN``: where a run's time went, and with ``--gpus`` what reclaims at scale would cost it.

Without ``--gpus`` it prints the run's time ledger (seconds by kind, and the measured figures: stall per save,
restart, start-up, step, checkpoint interval). With ``--gpus N --reclaims-per-gpu-hour R [--notice-s S]`` it
projects those figures onto an N-GPU job (``planning/goodput.py``: the model): the mean time between reclaims, the
run's checkpoint interval against Young-Daly's, and the goodput of a whole-group restart and of replica-group
recovery. ``--json`` prints one object instead.
"""

from __future__ import annotations

import json
import math
from typing import Optional

from raytrain_mgpu.checkpointing.run_folder import RunFolder
from raytrain_mgpu.driver.goodput import read_ledger
from raytrain_mgpu.planning.goodput import GPUS_PER_REPLICA_GROUP, project

__all__ = ["add_arguments", "run_and_print", "measured", "history_ledger"]

LEDGER_KINDS = ("productive", "redone", "startup", "checkpoint", "eval", "data_wait", "restart", "wall")


def add_arguments(parser) -> None:
    """``raytrain-mgpu goodput``'s options."""
    parser.add_argument("run", metavar="RUN", help="run folder ({storage_path}/{name}), finished or running: path or "
                                                   "URI")
    parser.add_argument("--gpus", type=int, help="project onto a job of this many GPUs (with "
                                                 "--reclaims-per-gpu-hour)")
    parser.add_argument("--reclaims-per-gpu-hour", type=float, help="reclaims (failures) per GPU per hour, e.g. 0.05")
    parser.add_argument("--notice-s", type=float, help="seconds of notice before a reclaim (AWS spot 120, GCP 30); "
                                                       "one that covers a save loses no work (spot-watch)")
    parser.add_argument("--gpus-per-replica-group", type=int, default=GPUS_PER_REPLICA_GROUP,
                        help="GPUs of one data-parallel replica group, for replica-group recovery")
    parser.add_argument("--restart-s", type=float, help="seconds a whole-group restart takes (default: the run's "
                                                        "measured mean, else its start-up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _history(folder: RunFolder) -> list:
    """The rows that reach furthest: ``history.parquet`` or the newest checkpoint's (a running run)."""
    final, running = folder.read_history() or [], folder.state().history or []
    return running if _last_step(running) > _last_step(final) else final


def _last_step(rows: list) -> int:
    return max((row.get("step") or 0 for row in rows), default=-1)


def history_ledger(rows: list) -> dict:
    """The ledger from the history's epoch rows alone, for a run folder written before the ledger was kept: a step
    checkpoint's stall is counted in its epoch's ``checkpoint_s``, so a save is an epoch's; start-up, restarts and
    redone steps are not in the rows (None)."""
    def total(key):
        return sum(row[key] for row in rows if _number(row.get(key)))

    training = total("training_s")
    data_wait = sum(row["training_s"] * row["data_wait_share"] for row in rows
                    if _number(row.get("training_s")) and _number(row.get("data_wait_share")))
    checkpoint, evaluation = total("checkpoint_s"), total("eval_s")
    steps = [row["step_time_s"] for row in rows if _number(row.get("step_time_s"))]
    saves = len(rows)
    return {"productive": training - data_wait, "redone": None, "startup": None, "checkpoint": checkpoint,
            "eval": evaluation, "data_wait": data_wait, "restart": None,
            "wall": training + checkpoint + evaluation, "checkpoint_s": checkpoint / saves if saves else None,
            "restart_s": None, "startup_s": None, "step_s": sum(steps) / len(steps) if steps else None,
            "interval_s": (training + evaluation) / saves if saves else None, "saves": saves,
            "restarts": len({row.get("attempt") for row in rows}) - 1, "from_history": True}


def measured(run: str) -> dict:
    """The run's ledger and measured figures (``driver/goodput.read_ledger``'s keys); for a run folder written
    before the ledger was kept (no ``goodput.json``), what its history's rows hold (:func:`history_ledger`)."""
    try:
        return read_ledger(run)
    except FileNotFoundError:
        pass
    folder = RunFolder(run)
    rows = _history(folder)
    if not rows:
        raise ValueError(f"run {folder.display!r} has no history yet (no goodput.json, no history.parquet, no "
                         f"checkpoint): pass the folder ({{storage_path}}/{{name}}) of a run that finished an epoch.")
    return history_ledger(rows)


def _check(args) -> None:
    """Bad values, each named with its fix (exit status 2 through the CLI)."""
    if (args.gpus is None) != (args.reclaims_per_gpu_hour is None):
        raise ValueError("goodput: --gpus and --reclaims-per-gpu-hour go together (a projection needs both). Pass "
                         "both, e.g. --gpus 64 --reclaims-per-gpu-hour 0.05, or neither for the run's ledger.")
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"goodput --gpus={args.gpus}: must be a count of GPUs >= 1. Pass e.g. --gpus 64.")
    rate = args.reclaims_per_gpu_hour
    if rate is not None and not (_number(rate) and rate > 0):
        raise ValueError(f"goodput --reclaims-per-gpu-hour={rate}: must be a finite number > 0. Pass e.g. 0.05 "
                         f"(one reclaim per GPU every 20 hours).")
    for name, value in (("--notice-s", args.notice_s), ("--restart-s", args.restart_s)):
        if value is not None and not (_number(value) and value >= 0):
            raise ValueError(f"goodput {name}={value}: must be a finite number of seconds >= 0. Pass e.g. 120.")
    if args.notice_s is not None and args.gpus is None:
        raise ValueError("goodput --notice-s: applies to a projection. Add --gpus N --reclaims-per-gpu-hour R.")
    if args.gpus_per_replica_group < 1:
        raise ValueError(f"goodput --gpus-per-replica-group={args.gpus_per_replica_group}: must be >= 1. Pass e.g. "
                         f"8 (one node).")


def _restart(figures: dict, override: Optional[float]) -> tuple:
    """``(restart_s, where it came from)``: the option, the run's mean restart, else its first start-up."""
    if override is not None:
        return override, "--restart-s"
    if figures.get("restart_s") is not None:
        return figures["restart_s"], f"mean of {figures.get('restarts')} restart(s)"
    if figures.get("startup_s") is not None:
        return figures["startup_s"], "the run never restarted: its first attempt's start-up"
    raise ValueError("goodput: the run records no restart or start-up time (a run folder written before the ledger "
                     "was kept). Pass --restart-s, e.g. the 'first step after' seconds `raytrain-mgpu train` printed.")


def _s(seconds: Optional[float]) -> str:
    """Seconds to read: three figures below 100 s, whole seconds above."""
    return "n/a" if seconds is None else f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def _ledger_text(run: str, figures: dict) -> str:
    wall = figures.get("wall") or 0.0
    lines = [f"run {run}: time by kind" + (" (its history alone: start-up, restarts and redone steps are not in it; "
                                           "wall is the kinds' sum)" if figures.get("from_history") else "")]
    for kind in LEDGER_KINDS:
        value = figures.get(kind)
        share = f"{100 * value / wall:6.1f} %" if value is not None and wall > 0 and kind != "wall" else ""
        lines.append(f"  {kind:<11}{_s(value):>12}{share}")
    lines.append(f"  per save {_s(figures.get('checkpoint_s'))} ({figures.get('saves')} saves), restart "
                 f"{_s(figures.get('restart_s'))} ({figures.get('restarts')} restarts), start-up "
                 f"{_s(figures.get('startup_s'))}, step {_s(figures.get('step_s'))}, checkpoint interval "
                 f"{_s(figures.get('interval_s'))}")
    return "\n".join(lines)


def _projection_text(p: dict, restart_from: str) -> str:
    notice = ("" if p["notice_s"] is None else f", notice {p['notice_s']:g} s "
              + ("(covers a save: a reclaim loses no work)" if p["notice_covers_save"]
                 else f"(shorter than a save of {_s(p['checkpoint_s'])}: no help)"))
    groups = (f"{p['replica_groups']} groups of {p['gpus_per_replica_group']} GPUs" if p["replica_groups"] >= 2 else
              f"one replica group of {p['gpus_per_replica_group']} GPUs or fewer: no peer to recover from, the "
              f"whole group restarts")
    return "\n".join([
        f"{p['gpus']} GPUs at {p['reclaims_per_gpu_hour']:g} reclaims per GPU-hour{notice}",
        f"  mean time between reclaims  {_s(p['mtbf_s'])}",
        f"  per save {_s(p['checkpoint_s'])}, restart {_s(p['restart_s'])} ({restart_from}), step {_s(p['step_s'])}",
        f"  checkpoint interval         {_s(p['interval_s'])} (Young-Daly: {_s(p['young_daly_s'])})",
        f"  goodput, whole restart      {100 * p['goodput_restart']:.2f} % at the run's interval, "
        f"{100 * p['goodput_restart_at_young_daly']:.2f} % at Young-Daly's",
        f"  goodput, replica groups     {100 * p['goodput_replica_groups']:.2f} % ({groups})"])


def run_and_print(args) -> int:
    _check(args)
    figures = measured(args.run)
    if args.gpus is None:
        print(json.dumps(figures, indent=1) if args.json else _ledger_text(args.run, figures))
        return 0
    for key in ("checkpoint_s", "step_s", "interval_s"):
        if figures.get(key) is None:
            raise ValueError(f"goodput: run {args.run!r} has no {key} measured yet (no save or step recorded): pass "
                             f"a run that finished an epoch.")
    restart_s, restart_from = _restart(figures, args.restart_s)
    p = project(figures["checkpoint_s"], restart_s, figures["step_s"], figures["interval_s"], args.gpus,
                args.reclaims_per_gpu_hour, args.notice_s, args.gpus_per_replica_group)
    print(json.dumps({**p, "restart_from": restart_from}, indent=1) if args.json
          else _projection_text(p, restart_from))
    return 0
