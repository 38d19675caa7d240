"""Checkpoints: what one holds, its files, the store that keeps them, the run folder, and when one is written.

- ``contents.py``         what a checkpoint holds and the restore with every RNG (``Saver``, ``read``);
- ``files.py``            the checkpoint's file format on any pyarrow filesystem;
- ``store.py``            the one owner of a checkpoint's life: write, seal, publish, the best copy, pruning, the
                          newest (``CheckpointStore``; the run folder's ``FolderStore``; Ray Train's is
                          ``transports/ray_train/store.py``);
- ``run_folder.py``       ``{storage_path}/{name}``: its files, the scanner of its checkpoints, the store's primitives;
- ``manager.py``          one rank's checkpoints in the engine: its triggers, its writer and its store
                          (``CheckpointManager``);
- ``step_checkpoints.py`` when a step checkpoint is due, and the resumable sampler; ``preemption.py``: the notice's
                          checkpoint.

One rank's side, like the engine: no Ray, no transport (``tests/test_imports.py``).
"""
