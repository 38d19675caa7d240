"""Projected goodput at scale: what a run's measured checkpoint, restart and step costs make of reclaims on N GPUs.

Goodput is the useful fraction of wall time: the training a failure-free run without checkpoints would do in the
same time. The inputs are a run's own figures (``raytrain-mgpu goodput RUN`` reads them from its run folder):

- ``checkpoint_s`` C: the training thread's stall per checkpoint save;
- ``restart_s`` D: a whole-group restart, from the failure to the next attempt's first step (the reload included);
- ``step_s``: one optimizer step;
- ``interval_s`` T: the run's time between checkpoints (training time, the saves' stalls not included);

and a cluster: ``gpus`` N, reclaims per GPU-hour R, so the N-GPU job fails every ``M = 3600 / (N R)`` seconds on
average (Poisson arrivals), and an optional reclaim notice of ``notice_s`` S seconds.

The model (each closed form is exact for it; :func:`simulate_restart` and :func:`simulate_replica_groups` play it
out with seeded random reclaims, and the tests hold the two within a few per cent):

- **Whole-group restart** (what ``fit`` does): reclaims strike while the run trains or saves, at rate ``1/M``; each
  costs D (a restart runs to its end) and the work since the last completed save. A period of T of training and C of
  saving completes with no reclaim in it, so ``G = T / ((exp((T + C) / M) - 1) (M + D))``; to first order,
  ``T/(T+C) (1 - (T+C)/2M - D/M)``. Young and Daly's interval ``sqrt(2 C M)`` maximises that first-order form.
- **With a notice that covers a save** (S >= C, as ``raytrain-mgpu spot-watch`` turns a notice into a checkpoint):
  a reclaim loses no work, it costs a save and a restart, C + D, and the next interval starts after the restart.
  Between reclaims the run trains ``x ~ Exp(1/M)`` of running time and keeps the training in it, so
  ``G = M (1 - exp(-T/M)) / ((1 - exp(-(T+C)/M)) (M + C + D))``. A shorter notice (S < C) is no notice.
- **Replica-group recovery** (torchft-style: the job is ``g = N // gpus_per_replica_group`` data-parallel replica
  groups; only the lost group is replaced, from a live peer, while the others keep training): a reclaim costs the
  lost group's share ``1/g`` of throughput for D (conservative: a replacement copies weights from a peer, no
  reload) and every other group one step, which is redone as the quorum changes; no work is lost, and the run keeps
  its checkpoints every T (against losing every group at once). So
  ``G = T/(T+C) (1 - (D/g + step_s (g-1)/g) / M)``. With fewer than two groups there is no peer to recover from:
  the figure is the whole-group restart's.
"""

from __future__ import annotations

import math
import random
from typing import Optional

from raytrain_mgpu.checkpointing.preemption import young_daly_s

__all__ = ["mtbf_s", "young_daly_s", "goodput_restart", "goodput_replica_groups", "project", "simulate_restart",
           "simulate_replica_groups", "GPUS_PER_REPLICA_GROUP"]

GPUS_PER_REPLICA_GROUP = 8
"""The default replica group: one 8-GPU node (an HSDP group sharded inside a node, replicated across nodes)."""


def mtbf_s(gpus: int, reclaims_per_gpu_hour: float) -> float:
    """The N-GPU job's mean time between reclaims, in seconds: ``3600 / (N R)``."""
    return 3600.0 / (gpus * reclaims_per_gpu_hour)


def goodput_restart(checkpoint_s: float, restart_s: float, interval_s: float, mtbf: float,
                    notice_covers_save: bool = False) -> float:
    """The useful fraction of wall time with whole-group restarts (the module docstring's first two forms)."""
    c, d, t, m = checkpoint_s, restart_s, interval_s, mtbf
    if notice_covers_save:
        return m * -math.expm1(-t / m) / (-math.expm1(-(t + c) / m) * (m + c + d))
    return t / (math.expm1((t + c) / m) * (m + d))


def goodput_replica_groups(checkpoint_s: float, restart_s: float, interval_s: float, step_s: float, mtbf: float,
                           groups: int) -> Optional[float]:
    """The useful fraction of wall time when only the lost replica group restarts (the module docstring's third
    form); with fewer than two groups, None (there is no peer: the run restarts whole)."""
    if groups < 2:
        return None
    lost_per_reclaim = restart_s / groups + step_s * (groups - 1) / groups
    return interval_s / (interval_s + checkpoint_s) * max(0.0, 1.0 - lost_per_reclaim / mtbf)


def project(checkpoint_s: float, restart_s: float, step_s: float, interval_s: float, gpus: int,
            reclaims_per_gpu_hour: float, notice_s: Optional[float] = None,
            gpus_per_replica_group: int = GPUS_PER_REPLICA_GROUP) -> dict:
    """Every figure ``raytrain-mgpu goodput RUN --gpus N --reclaims-per-gpu-hour R`` prints, by name."""
    mtbf = mtbf_s(gpus, reclaims_per_gpu_hour)
    covers = notice_s is not None and notice_s >= checkpoint_s
    young_daly = young_daly_s(checkpoint_s, mtbf)
    groups = gpus // gpus_per_replica_group
    restart = goodput_restart(checkpoint_s, restart_s, interval_s, mtbf, covers)
    replica = goodput_replica_groups(checkpoint_s, restart_s, interval_s, step_s, mtbf, groups)
    return {"gpus": gpus, "reclaims_per_gpu_hour": reclaims_per_gpu_hour, "notice_s": notice_s,
            "notice_covers_save": covers, "checkpoint_s": checkpoint_s, "restart_s": restart_s, "step_s": step_s,
            "interval_s": interval_s, "mtbf_s": mtbf, "young_daly_s": young_daly,
            "goodput_restart": restart,
            "goodput_restart_at_young_daly": goodput_restart(checkpoint_s, restart_s, young_daly, mtbf, covers),
            "gpus_per_replica_group": gpus_per_replica_group, "replica_groups": groups,
            "goodput_replica_groups": restart if replica is None else replica}


# ----------------------------------------------------------------------------- the same, played out


def simulate_restart(checkpoint_s: float, restart_s: float, interval_s: float, mtbf: float,
                     notice_covers_save: bool = False, horizon_s: float = 1e8, seed: int = 0) -> float:
    """Whole-group restarts played out: periods of ``interval_s`` training and a save, reclaims at random (Poisson,
    mean ``mtbf`` seconds apart in running time), until ``horizon_s`` of wall time; the training kept over the wall
    time."""
    rng = random.Random(seed)
    period = interval_s + checkpoint_s
    wall = kept = into = 0.0  # into: running time into the current period, since the last completed save
    to_reclaim = rng.expovariate(1.0 / mtbf)
    while wall < horizon_s:
        left = period - into
        if to_reclaim >= left:  # the period and its save complete
            wall, kept, to_reclaim, into = wall + left, kept + interval_s, to_reclaim - left, 0.0
            continue
        into += to_reclaim
        if notice_covers_save:  # the notice's save keeps the training so far; then the restart
            wall += to_reclaim + checkpoint_s + restart_s
            kept += min(into, interval_s)
        else:  # back to the last completed save
            wall += to_reclaim + restart_s
        into, to_reclaim = 0.0, rng.expovariate(1.0 / mtbf)
    return kept / wall


def simulate_replica_groups(checkpoint_s: float, restart_s: float, interval_s: float, step_s: float, mtbf: float,
                            groups: int, horizon_s: float = 1e8, seed: int = 0) -> float:
    """Replica-group recovery played out: reclaims at random over wall time, each on a group drawn at random, which
    is down for ``restart_s`` from then (a group reclaimed again while it restarts starts over), and one step of
    every other group redone; the run's saves every ``interval_s``. The training kept over the wall time."""
    rng = random.Random(seed)
    down_until = [0.0] * groups
    lost = 0.0  # group-seconds of training lost, over all groups
    t = rng.expovariate(1.0 / mtbf)
    while t < horizon_s:
        group = rng.randrange(groups)
        lost += min(t + restart_s, horizon_s) - max(t, min(down_until[group], horizon_s))
        lost += step_s * (groups - 1)
        down_until[group] = t + restart_s
        t += rng.expovariate(1.0 / mtbf)
    return interval_s / (interval_s + checkpoint_s) * (1.0 - lost / groups / horizon_s)
