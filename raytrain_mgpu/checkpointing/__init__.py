"""Checkpoints: what one holds, its files, the run folder that keeps them, and when one is written.

- ``contents.py``         what a checkpoint holds and the restore with every RNG (``Saver``, ``read``);
- ``files.py``            the checkpoint's file format on any pyarrow filesystem;
- ``run_folder.py``       ``{storage_path}/{name}``: publishing, the best copy, pruning, the checkpoint to resume from;
- ``manager.py``          one rank's checkpoint lifecycle in the engine (``CheckpointManager``);
- ``step_checkpoints.py`` when a step checkpoint is due, and the resumable sampler; ``preemption.py``: the notice's
                          checkpoint.

One rank's side, like the engine: no Ray, no transport (``tests/test_imports.py``).
"""
