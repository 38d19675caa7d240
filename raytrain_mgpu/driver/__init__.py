"""The driver's services: what ``fit`` uses around a run, in the driver's process.

- ``preflight.py``, ``cluster.py``, ``autoscaler_config.py``, ``worker_nodes.py``: checks before Ray is asked for
  anything, connecting to Ray, what the cluster can have, where the workers may go;
- ``runlock.py``: one driver per run folder; ``progress.py``: the banner, the epoch lines, the ranks' channel to
  the driver; ``heartbeat.py``: the ranks' heartbeats and the driver's answer to a stuck one;
- ``callbacks.py``, ``loggers.py``: the run's events to the user's callbacks and loggers;
- ``export.py``: a run's model out; ``spot_watch.py``: the daemon on a spot node that turns a reclaim notice into
  a Ray preemption drain.
"""
