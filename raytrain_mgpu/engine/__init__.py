"""The engine: one training run on one rank, whichever transport carries it. No Ray, no transport.
Its checkpoints are ``raytrain_mgpu.checkpointing``'s.

- ``loop.py``             :class:`Engine` and :func:`run_epochs`: the epochs, the steps, evaluation, the epoch row;
- ``step.py``             the step runner's interface (``Steps``) and the end of every step (``OptimizerStep``);
- ``precision.py``        autocast, fp16's grad scaler, their hand-over to replica threads (``Precision``);
- ``objectives.py``       losses and metrics; ``optim.py``: optimizers, parameter groups, LR schedules;
  ``batches.py``: moving, calling, splitting and counting tuple/dict batches;
- ``feed.py``             samplers, loaders (``loaders.py``, ``prefetch.py``), data waits, data on the device;
- ``observe.py``          FLOPs, MFU, the profiler, evaluation every N steps (``flops.py``, ``profiling.py``);
  ``metrics.py``, ``step_scalars.py``, ``run_state.py``: the epoch's sums, the per-step scalars, the row and meta;
- ``liveness.py``         each rank's position (a stuck rank is named from it) and the driver's judge;
- ``devices.py``          every CPU/GPU/backend decision and the GPU emulation; ``weights.py``: weights in.
"""
