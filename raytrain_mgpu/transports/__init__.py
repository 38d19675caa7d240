"""The transports that carry a run's engine (``runtime/engine.py``): Ray Train's workers
(``ray_train.py``) and the driver's own process for a run of one worker (``local.py``); the pipeline's
actor group is the third (``pipeline/``). ``attempts.py``: retrying whole attempts where Ray Train's
controller does not (the pipeline, the in-process runner)."""
