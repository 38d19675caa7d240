"""Shared fixtures: one Ray instance for the whole test session.

Ray 2.60's plain ``ray.init()`` turns on token authentication and writes
``~/.ray/auth_token``; tests turn auth off on purpose (the job-submission test turns it
back on for its own head) and point HOME at a temporary folder so nothing of the
developer's is touched.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_AUTH_MODE", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}
    os.environ["HOME"] = str(home)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray Train's controller polls every 2 s by default; each state change waits for a poll.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    ray.init(num_cpus=4, include_dashboard=True, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def storage(tmp_path):
    """A fresh storage_path per test."""
    return str(tmp_path / "results")
