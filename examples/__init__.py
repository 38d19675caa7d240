"""Runnable examples: your own model, data, loss and metrics (``python -m examples.<name>``)."""
