"""The transports that carry a run's engine (``engine/loop.py``): Ray Train's workers
(``ray_train.py``) and the driver's own process for a run of one worker (``local.py``); the pipeline's
actor group is the third (``pipeline/``). ``retry.py``: the one retry policy of all three (what a retry can fix,
and whole attempts retried where Ray Train's controller does not: the pipeline, the in-process runner);
``ray_train_policy.py``: that policy inside Ray Train's controller."""
