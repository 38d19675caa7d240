"""The Ray Train transport: each ``TorchTrainer`` worker runs the engine (``worker.py``); its reports and uploads
(``uploads.py``), the retry policy in its controller (``policy.py``), collective timeouts and reports a failure
must not lose (``faults.py``)."""
