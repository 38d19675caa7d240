"""Pipeline parallelism: the schedules, the partition plan, the executor and its point-to-point channels. The
stages run in a Ray actor group of their own (``transports/actor_group/``); a stage's step runner is
``pipeline/steps.py``.

Layout:

- ``schedule.py``  the schedule as data: per-rank orders of ``Action``s, pure and tested;
- ``plan.py``      which blocks go to which stage (built on ``meta``; see ``models/partition.py``);
- ``executor.py``  runs one rank's order: forwards, backwards, point-to-point messages;
- ``p2p.py``       the point-to-point channels (NCCL semantics, bounded waits);
- ``steps.py``     a stage's step runner: the engine's ``Steps`` over the executor.

The tests run the same stages as local processes, without Ray (``tests/_pipeline_local.py``).

The benchmark lives with the others in :mod:`raytrain_mgpu.bench`. Importing this
package imports nothing: ``plan`` and ``schedule`` are used by planning without Ray.
"""
