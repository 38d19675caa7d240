"""Pipeline parallelism on a separate Ray actor group: one actor per stage (and replica).

Layout:

- ``schedule.py``  the schedule as data: per-rank orders of ``Action``s, pure and tested;
- ``plan.py``      which blocks go to which stage (built on ``meta``; see ``models/partition.py``);
- ``executor.py``  runs one rank's order: forwards, backwards, point-to-point messages;
- ``p2p.py``       the point-to-point channels (NCCL semantics, bounded waits);
- ``steps.py``     a stage's step runner: what one rank gives the engine (``runtime/engine.py``);
- ``worker.py``    one stage process: process group, data, the engine's run, its transport;
- ``group.py``     the actor group's lifecycle (placement group, actors, teardown);
- ``runner.py``    :func:`run_pipeline`: attempts of one actor group each, retries (called by ``fit``).

The tests run the same stages as local processes, without Ray (``tests/_pipeline_local.py``).

The benchmark lives with the others in :mod:`raytrain_mgpu.bench`. Importing this
package imports nothing: ``plan`` and ``schedule`` are used by planning without Ray.
"""
