"""What runs a training run: processes, devices, the loop, checkpoints, metrics, progress.

- ``devices.py``    every CPU/GPU/backend decision (and the GPU emulation);
- ``cluster.py``    connecting to Ray, what the cluster can place, worker runtime envs;
- ``loop.py``       the Ray Train worker loop shared by every data-parallel strategy;
- ``checkpoint.py`` the checkpoint format (model, optimizer, meta, history);
- ``metrics.py``    per-epoch metrics measured on the device;
- ``progress.py``   the driver's one-line-per-epoch display;
- ``faults.py``     stuck-rank naming, and waiting until Ray Train has taken a report;
- ``runlock.py``    one driver per run folder.
"""
