"""The pipeline's transport: a Ray actor group of stage processes (``stage.py``), its lifecycle (``group.py``),
and the attempts the driver runs (``runner.py``: :func:`~raytrain_mgpu.transports.actor_group.runner.run_pipeline`,
called by ``fit``)."""
