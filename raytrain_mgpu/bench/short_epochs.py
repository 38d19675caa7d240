"""Short epochs: ``fit`` against a hand-written Ray Train loop, and what step checkpoints cost.

    raytrain-mgpu bench --short-epochs 10 [--rounds 2]

The README's kind of run: digits, 2 workers, a small MLP, epochs of a fraction of a second, where
what happens between the steps (reports, checkpoints, evaluation) is most of the wall time. Per
round, in an order rotated from round to round, on one Ray instance:

- ``ray train``: what Ray Train's documentation shows a user writing: ``TorchTrainer`` with
  ``prepare_model`` and ``prepare_data_loader`` (a ``DistributedSampler`` underneath), and after
  every epoch ``ray.train.report`` with a checkpoint (``torch.save`` of the model); Ray's default
  controller poll, as a user has it;
- ``fit``: the same model (the same initial weights), data, global batch, epochs and workers,
  evaluated and checkpointed every epoch;
- ``fit, K=10``: the same with a step checkpoint every 10 steps (``checkpoint_every_n_steps``).

Each variant runs ``--short-epochs`` epochs and 1 epoch. Per variant (medians over rounds): the wall
time of the call (``trainer.fit()``, ``fit()``) of the long run, the time an epoch adds outside its
steps ((wall(E) - wall(1)) / (E - 1) less an epoch's time in steps: a method free of
start-up), and the steady samples/s (the epochs after the first, samples over the time in steps).
For ``fit, K=10``: the step checkpoints' time (the rows' ``checkpoint_s`` less the plain fit's, whose
epochs checkpoint too) as a share of the steps' time. Targets: ``fit``'s wall
<= 0.80x the hand-written loop's, its samples/s >= 0.90x, step checkpoints <= 10 % of the steps.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from raytrain_mgpu.config.train import TrainConfig

CONFIG = dict(model="mlp", model_kwargs={"widths": [64]}, dataset="digits", batch_size=64, optimizer="sgd",
              lr=0.1, seed=0, num_workers=2, use_gpu=False, cpus_per_worker=1, epochs=10)
STEP_CHECKPOINT_EVERY = 10
EXAMPLE_STEP_S = 0.05  # the step a save is judged against: 50 ms a step, a save every 10 steps
VARIANTS = ("ray train", "fit", f"fit, K={STEP_CHECKPOINT_EVERY}")


@dataclass
class Run:
    wall_s: float  # the call, from before it to its return
    training_s: List[float]  # per epoch, the time in steps
    samples: List[int]  # per epoch
    checkpoint_s: Optional[List[float]] = None  # per epoch (fit's rows)
    steps_per_epoch: List[int] = field(default_factory=list)  # fit's rows

    @property
    def steps(self) -> int:
        return sum(self.steps_per_epoch)

    @property
    def samples_per_s(self) -> float:
        rates = [n / t for n, t in zip(self.samples, self.training_s)]
        return statistics.median(rates[1:] or rates)


def step_checkpoint_s(with_steps: Run, without: Run) -> float:
    """What one step checkpoint costs: the K run's ``checkpoint_s`` less the plain fit's (whose epochs
    checkpoint too), per step checkpoint (a save every K steps that is not an epoch's last)."""
    saves = sum(n // STEP_CHECKPOINT_EVERY - (n % STEP_CHECKPOINT_EVERY == 0) for n in with_steps.steps_per_epoch)
    return (sum(with_steps.checkpoint_s) - sum(without.checkpoint_s)) / max(1, saves)


def per_epoch_outside_steps(long: Run, short: Run) -> float:
    """What an epoch adds besides its steps: the wall time per extra epoch less an epoch's time in steps."""
    epochs = len(long.training_s) - len(short.training_s)
    return (long.wall_s - short.wall_s) / epochs - statistics.median(long.training_s[1:] or long.training_s)


def hand_written(cfg: TrainConfig, storage: str, name: str) -> Run:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_mgpu.bench._ray_train_loop import hand_written_loop

    out = os.path.join(storage, f"{name}.jsonl")
    trainer = TorchTrainer(hand_written_loop, train_loop_config={"cfg": cfg.to_dict(), "out": out},
                           scaling_config=ScalingConfig(num_workers=cfg.num_workers),
                           run_config=RunConfig(name=name, storage_path=storage))
    start = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start
    with open(out) as f:
        rows = [row for row in map(json.loads, f) if "training_s" in row]
    return Run(wall, training_s=[r["training_s"] for r in rows], samples=[r["samples"] for r in rows])


def ours(cfg: TrainConfig, storage: str, name: str) -> Run:
    from raytrain_mgpu.api import fit

    start = time.perf_counter()
    result = fit(cfg.replace(storage_path=storage, name=name), stream=open(os.devnull, "w"))
    wall = time.perf_counter() - start
    rows = result.history
    steps = [r["step"] for r in rows]
    return Run(wall, training_s=[r["training_s"] for r in rows],
               samples=[round(r["samples_per_s"] * r["training_s"]) for r in rows],
               checkpoint_s=[r["checkpoint_s"] for r in rows],
               steps_per_epoch=[b - a for a, b in zip([0] + steps, steps)])


def run(epochs: int = CONFIG["epochs"], rounds: int = 2) -> Dict[str, List[tuple]]:
    """Per variant and round: ``(long run, 1-epoch run)``."""
    import ray

    base = TrainConfig(**{**CONFIG, "epochs": epochs})
    variants = {
        VARIANTS[0]: lambda cfg, storage, name: hand_written(cfg, storage, name),
        VARIANTS[1]: lambda cfg, storage, name: ours(cfg, storage, name),
        VARIANTS[2]: lambda cfg, storage, name: ours(cfg.replace(checkpoint_every_n_steps=STEP_CHECKPOINT_EVERY),
                                                     storage, name),
    }
    measured: Dict[str, List[tuple]] = {label: [] for label in VARIANTS}
    ray.init(log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            for r in range(rounds):
                for label in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    index = VARIANTS.index(label)
                    measured[label].append(tuple(variants[label](base.replace(epochs=n), storage, f"v{index}-e{n}-r{r}")
                                                 for n in (epochs, 1)))
    finally:
        ray.shutdown()
    return measured


def report(measured: Dict[str, List[tuple]]) -> str:
    base = [long for long, _ in measured[VARIANTS[0]]]
    lines = [f"{'variant':<14} {'wall s':>7} {'vs ray train':>12} {'per epoch outside steps s':>26} "
             f"{'samples/s':>10} {'vs ray train':>12}", "-" * 88]
    for label, runs in measured.items():
        longs = [long for long, _ in runs]
        wall_ratio = statistics.median(r.wall_s / b.wall_s for r, b in zip(longs, base))
        rate_ratio = statistics.median(r.samples_per_s / b.samples_per_s for r, b in zip(longs, base))
        lines.append(f"{label:<14} {statistics.median(r.wall_s for r in longs):>7.1f} {wall_ratio:>11.2f}x "
                     f"{statistics.median(per_epoch_outside_steps(*pair) for pair in runs):>26.3f} "
                     f"{statistics.median(r.samples_per_s for r in longs):>10,.0f} {rate_ratio:>11.2f}x")
    # each round's ratio, not only their median: rounds differ by more than a few percent on a shared machine
    lines.append("samples/s vs ray train, each round: " + "; ".join(
        f"{label} " + " ".join(f"{long.samples_per_s / b.samples_per_s:.2f}x" for (long, _), b in zip(runs, base))
        for label, runs in measured.items() if label != VARIANTS[0]))
    with_steps = [long for long, _ in measured[VARIANTS[2]]]
    without = [long for long, _ in measured[VARIANTS[1]]]
    shares = [(sum(k.checkpoint_s) - sum(f.checkpoint_s)) / sum(k.training_s) for k, f in zip(with_steps, without)]
    per_save = statistics.median(step_checkpoint_s(k, f) for k, f in zip(with_steps, without))
    step_s = statistics.median(sum(k.training_s) / k.steps for k in with_steps)
    lines.append(f"step checkpoints every {STEP_CHECKPOINT_EVERY} steps: {100 * statistics.median(shares):.1f} % of "
                 f"the steps' time (the K run's checkpoint_s less the plain fit's, over its time in steps; "
                 f"target <= 10 %): {1000 * per_save:.1f} ms a save against {STEP_CHECKPOINT_EVERY} steps of "
                 f"{1000 * step_s:.1f} ms; against {STEP_CHECKPOINT_EVERY} steps of {1000 * EXAMPLE_STEP_S:.0f} ms "
                 f"(the example target's) {100 * per_save / (STEP_CHECKPOINT_EVERY * EXAMPLE_STEP_S):.1f} %")
    lines.append("medians over rounds; ratios are within a round. Targets: fit's wall <= 0.80x, "
                 "samples/s >= 0.90x the hand-written Ray Train loop's")
    return "\n".join(lines)


def run_and_print(args) -> int:
    print(f"mlp 64-64-10 on digits, 2 workers x 1 CPU, global batch 64, {args.short_epochs} epochs (and 1), "
          f"{os.cpu_count()} CPU cores, {args.rounds} round(s)")
    print(report(run(args.short_epochs, args.rounds)))
    return 0
