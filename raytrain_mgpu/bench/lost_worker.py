"""What a lost worker costs, both ways: ``fault_tolerance="restart"`` against ``"replica_groups"``.

    raytrain-mgpu bench-lost-worker [--steps 1000] [--kill-step 200] [--modes restart,replica_groups]

The same fit, side by side in one invocation on one Ray instance: ``ddp`` on 2 CPU workers (gloo), the MLP on the
embedded digits, ``--steps`` optimizer steps (a checkpoint each epoch of 44 steps), run uninterrupted and with
worker 1's process killed (SIGKILL, no goodbye to its peer) right after its step ``--kill-step``, for each mode.
``restart`` is Ray Train's whole-group restart from the last checkpoint (every worker stops, a new group starts and
trains again the steps since the checkpoint); ``replica_groups`` replaces the lost worker alone while the other
trains on (``engine/replica_groups.py``). Printed per mode: each run's wall time (``fit``'s call to its return), the
lost worker's cost (the killed run's wall time less the uninterrupted one's), the final test accuracy of both, the
worker processes started, and the steps averaged by fewer groups than the run has.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from raytrain_mgpu.data import Datasets, digits as _digits

__all__ = ["killing_digits", "add_arguments", "run_and_print"]


def killing_digits(cfg) -> Datasets:
    """Digits, whose Ray Train worker of world rank ``kill.json``'s ``rank`` (in ``data_root``) kills its own process
    after its optimizer step ``step``, once (it writes ``killed-<rank>`` first: its replacement builds the data again
    and lives). Every worker process writes ``worker-<pid>.json`` (rank, pid, start). Plain digits on the driver."""
    data = _digits.build(cfg)
    try:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
    except Exception:  # on the driver (its data checks): no Ray Train context
        return data
    probe = Path(cfg.data_root)
    (probe / f"worker-{os.getpid()}.json").write_text(json.dumps({"rank": rank, "pid": os.getpid(),
                                                                  "started": time.time()}))
    plan_file = probe / "kill.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    marker = probe / f"killed-{rank}"
    if plan is not None and plan["rank"] == rank and not marker.exists():
        from raytrain_mgpu.engine.step import STEP_EVENTS

        def kill(step: int) -> None:
            if step == plan["step"] and not marker.exists():
                marker.write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        STEP_EVENTS.append(kill)
    return data


def _fit(root: Path, mode: str, kill_step: int, steps: int) -> dict:
    import raytrain_mgpu as rtm

    probe = root / f"{mode}-{'kill' if kill_step else 'whole'}"
    probe.mkdir(parents=True)
    if kill_step:
        (probe / "kill.json").write_text(json.dumps({"rank": 1, "step": kill_step}))
    started = time.perf_counter()
    result = rtm.fit(rtm.TrainConfig(
        model="mlp", dataset="raytrain_mgpu.bench.lost_worker:killing_digits", data_root=str(probe), strategy="ddp",
        num_workers=2, use_gpu=False, runner="ray", epochs=-(-steps // 44), max_steps=steps, batch_size=32, lr=0.05,
        lr_schedule="cosine",
        fault_tolerance=mode, max_failures=2, storage_path=str(probe / "runs"), name="lost-worker"))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "accuracy": result.history[-1].get("test_accuracy"),
            "processes": len(list(probe.glob("worker-*.json"))),
            "short_steps": sum(row.get("short_steps") or 0 for row in result.history),
            "redone_steps": (result.goodput or {}).get("redone_steps")}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of each run")
    parser.add_argument("--kill-step", type=int, default=200, help="worker 1 is killed after this step")
    parser.add_argument("--modes", default="restart,replica_groups", help="fault_tolerance modes, comma-separated")


def run_and_print(args) -> int:
    import ray

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(f"lost worker: ddp, 2 CPU workers (gloo), MLP on digits, {args.steps} steps, worker 1 killed after its "
          f"step {args.kill_step}; {os.cpu_count()} CPU cores")
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-lost-worker-") as tmp:
            for mode in modes:
                whole = _fit(Path(tmp), mode, 0, args.steps)
                lost = _fit(Path(tmp), mode, args.kill_step, args.steps)
                print(f"{mode:>15}: uninterrupted {whole['wall_s']:.1f} s (accuracy {whole['accuracy']:.4f}), killed "
                      f"{lost['wall_s']:.1f} s (accuracy {lost['accuracy']:.4f}): the lost worker cost "
                      f"{lost['wall_s'] - whole['wall_s']:+.1f} s; {lost['processes']} worker processes, "
                      f"{lost['redone_steps'] or 0} steps trained twice, {lost['short_steps']} averaged by one group")
    finally:
        ray.shutdown()
    return 0
