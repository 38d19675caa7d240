"""What a checkpoint stalls training: Ray Train's synchronous vs asynchronous upload, side by side.

    raytrain-mgpu bench-checkpoint [--widths 4096 ...] [--storage-path DIR_OR_URI] [--upload-mb-per-s 100]

One Ray Train worker trains an MLP large enough that its checkpoint upload matters (the default:
784-4096x6-10, 87 M parameters, a 350 MB checkpoint) on random batches and, every
``--steps-between`` steps, saves through the engine's own save (``engine/checkpoints.Saver`` over the
Ray Train transport, ``transports/ray_train/worker.py``) to ``--storage-path``, with:

- ``sync``: ``CheckpointUploadMode.SYNC``, the upload inside ``ray.train.report`` (what the runner did before);
- ``async``: ``CheckpointUploadMode.ASYNC``, what the runner does now (the upload in Ray's thread);
- ``none``: the same steps without a save, the baseline of a checkpoint interval.

Per save (the first of each run is a warm-up and left out): the time rank 0 spends inside
the save (the stall the loop sees) and the cycle, the steps of an interval plus its
save. The stall per checkpoint is the cycle minus the ``none`` cycle: it includes what a
background upload takes from the steps it overlaps (CPU, memory bandwidth, the GIL). Each mode
runs once per round, in an order rotated from round to round; figures are medians.
``--upload-mb-per-s`` emulates a remote storage (an upload lasts at least its size at that rate,
waiting without CPU, as on a network) where no remote one is at hand.
The model is ``mlp`` with the given widths on 28x28 inputs, trained by hand on one random batch between saves.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Dict, List

MODES = ("sync", "async", "none")
DEFAULT_WIDTHS = [4096] * 6


def _train_fn(config: dict) -> None:
    """One Ray Train worker: ``saves`` intervals of ``steps_between`` steps, each ending in a save."""
    import torch

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.data import build_datasets
    from raytrain_mgpu.engine.loop import Engine
    from raytrain_mgpu.strategies.plan import build_plan
    from raytrain_mgpu.transports.base import data_parallel_steps
    from raytrain_mgpu.transports.ray_train.worker import RayTrainTransport, _context

    torch.set_num_threads(config["threads"])
    if config["upload_mb_per_s"]:
        _throttle_uploads(config["upload_mb_per_s"])
    cfg = TrainConfig.from_dict(config["cfg"])
    ctx = _context(cfg)
    data = build_datasets(cfg.data)
    mode = config["mode"]
    engine = Engine(cfg, build_plan(cfg, len(data.train)), data_parallel_steps(cfg, ctx, data),
                    RayTrainTransport(cfg, ctx, None, sync_uploads=mode == "sync"), data)
    engine.setup()
    model, optimizer, state = engine.steps.model, engine.optimizer, engine.state
    x, y = torch.randn(config["batch_size"], 1, 28, 28), torch.randint(0, 10, (config["batch_size"],))
    saves, cycles, steps_s = [], [], []
    for _ in range(config["saves"] + 1):  # the first interval warms up
        cycle_start = time.perf_counter()
        for _ in range(config["steps_between"]):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            steps_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        if mode != "none":
            state.history.append({"epoch": len(state.history) + 1, "step": state.step})
            state.epoch = len(state.history)
            engine.checkpoints.saver.save({"step": state.step})
        saves.append(time.perf_counter() - start)
        cycles.append(time.perf_counter() - cycle_start)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with open(config["out"], "w") as f:
        json.dump({"save_s": saves[1:], "cycle_s": cycles[1:], "step_s": steps_s[config["steps_between"]:],
                   "checkpoint_bytes": size}, f)


def _throttle_uploads(mb_per_s: float) -> None:
    """Emulate a remote storage: an upload to ``storage_path`` lasts at least size / ``mb_per_s``
    (waiting, as on a network, without using CPU). Wraps the copy Ray Train V2 uploads with."""
    from ray.train.v2._internal.execution import storage

    copy = storage._pyarrow_fs_copy_files

    def throttled(source, destination, **kwargs):
        start = time.perf_counter()
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(source) for f in files)
        result = copy(source, destination, **kwargs)
        time.sleep(max(0.0, size / (mb_per_s * 1e6) - (time.perf_counter() - start)))
        return result

    storage._pyarrow_fs_copy_files = throttled


def _run_one(mode: str, args, storage: str, scratch: str, r: int) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_mgpu.config.train import TrainConfig
    from raytrain_mgpu.transports.ray_train.faults import controller_poll

    name = f"bench-checkpoint-{mode}-r{r}"
    # epochs: never reached, so no save is the run's last (which always uploads synchronously)
    cfg = TrainConfig(model="mlp", model_kwargs={"widths": list(args.widths)}, dataset="synthetic",
                      input_shape=[1, 28, 28], num_classes=10, num_samples=args.batch_size, batch_size=args.batch_size,
                      optimizer="sgd", lr=1e-4, num_workers=1, use_gpu=False, storage_path=storage, name=name,
                      epochs=10**6)
    out = os.path.join(scratch, f"{name}.json")
    config = {"cfg": cfg.to_dict(), "widths": args.widths, "batch_size": args.batch_size, "mode": mode,
              "saves": args.saves, "steps_between": args.steps_between, "threads": args.threads, "out": out,
              "upload_mb_per_s": args.upload_mb_per_s}
    trainer = TorchTrainer(_train_fn, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": args.threads}),
                           run_config=RunConfig(storage_path=storage, name=name))
    with controller_poll():  # the controller's poll fit runs with (a report waits for the next poll)
        trainer.fit()
    with open(out) as f:
        return json.load(f)


def run(args) -> Dict[str, List[dict]]:
    """Every mode once per round, in an order rotated from round to round."""
    import ray

    measured: Dict[str, List[dict]] = {mode: [] for mode in MODES}
    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-mgpu-bench-ckpt-") as scratch:
            storage = args.storage_path or os.path.join(scratch, "storage")
            for r in range(args.rounds):
                for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                    measured[mode].append(_run_one(mode, args, storage, scratch, r))
    finally:
        ray.shutdown()
    return measured


def report(measured: Dict[str, List[dict]]) -> str:
    def median(mode: str, key: str) -> float:
        return statistics.median(v for run in measured[mode] for v in run[key])

    base = median("none", "cycle_s")
    lines = [f"{'upload':<8} {'in the save':>19} {'step':>8} {'cycle':>8} {'stall per checkpoint':>21}",
             "-" * 68]
    stall = {}
    for mode in ("sync", "async"):
        stall[mode] = median(mode, "cycle_s") - base
        lines.append(f"{mode:<8} {median(mode, 'save_s'):>18.2f}s {median(mode, 'step_s'):>7.3f}s "
                     f"{median(mode, 'cycle_s'):>7.2f}s {stall[mode]:>20.2f}s")
    lines.append(f"{'none':<8} {'':>19} {median('none', 'step_s'):>7.3f}s {base:>7.2f}s")
    saves = {m: median(m, "save_s") for m in ("sync", "async")}
    lines.append(f"async vs sync: time in the save {saves['sync'] / saves['async']:.1f}x shorter; "
                 f"stall per checkpoint {stall['sync'] / max(stall['async'], 1e-3):.1f}x shorter")
    lines.append("medians over every save but each run's first; stall = cycle - the cycle without a save")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--widths", type=int, nargs="+", default=DEFAULT_WIDTHS,
                        help="the MLP's hidden widths (784 inputs, 10 outputs): the checkpoint's size")
    parser.add_argument("--batch-size", type=int, default=16, help="random samples per step")
    parser.add_argument("--steps-between", type=int, default=10, help="training steps between two saves")
    parser.add_argument("--saves", type=int, default=3, help="measured saves per run (after a warm-up one)")
    parser.add_argument("--rounds", type=int, default=2, help="times every mode runs, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (and Ray CPUs) of the worker")
    parser.add_argument("--upload-mb-per-s", type=float,
                        help="emulate a remote storage: each upload takes at least its size at this rate "
                             "(e.g. 100 for an object store over one stream; default: the real copy only)")
    parser.add_argument("--storage-path", help="where checkpoints are uploaded: a folder or URI (default: a "
                                               "temporary local folder; a remote one makes uploads slower)")


def run_and_print(args) -> int:
    params = sum(a * b + b for a, b in zip([784, *args.widths], [*args.widths, 10]))
    print(f"checkpoint stall: mlp 784-{'-'.join(map(str, args.widths))}-10 ({params / 1e6:.0f} M parameters, "
          f"{4 * params / 1e6:.0f} MB), batch {args.batch_size}, a save every {args.steps_between} steps, "
          f"{args.saves} saves per run, {args.rounds} round(s), 1 worker with {args.threads} thread(s), "
          f"{os.cpu_count()} CPU cores, storage {args.storage_path or 'a local temporary folder'}"
          + (f", uploads emulated at {args.upload_mb_per_s:g} MB/s" if args.upload_mb_per_s else ""))
    print(report(run(args)))
    return 0
