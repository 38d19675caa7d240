"""What carries a run's engine (``engine/loop.py``), side by side, all three returning one ``base.RunResult`` to
``fit`` (:func:`carrier` picks one):

- ``local.py``: the driver's own process, for a run of one worker;
- ``ray_train/``: Ray Train's workers (``worker.py``; ``driver.py``: the worker group ``fit`` starts);
- ``actor_group/``: the pipeline's stage actors (``stage.py``, ``group.py``; ``runner.py``: its attempts).

``base.py``: the ``Transport`` interface each rank's engine talks to, the rank start all three make
(``rank_devices``, ``rank_engine``), the result, which runs train in-process
(``runner_for``); ``retry.py``: the one retry policy of all three; ``preemption.py``, ``ray_data.py``,
``placement.py``: the Ray side the two Ray transports share."""

from __future__ import annotations

from typing import Callable

from raytrain_mgpu.transports.actor_group.runner import run_pipeline
from raytrain_mgpu.transports.local import run_in_process

__all__ = ["carrier"]


def carrier(runner: str, plan) -> Callable:
    """The transport's run function for ``fit``'s choice (``runner_for``, then the plan's runner):
    ``run(cfg, plan, events) -> RunResult``."""
    if runner == "local":
        return run_in_process
    if plan.runner == "actor_group":
        return run_pipeline
    # late: Ray Train and its transport (1.1 s of import over the api's) are only for a run on its workers, not for
    # the in-process runner nor the pipeline's actor group
    from raytrain_mgpu.transports.ray_train.driver import run_train_workers

    return run_train_workers
