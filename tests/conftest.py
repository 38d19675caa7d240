"""Shared fixtures: one Ray instance for the whole test session.

Ray 2.60's plain ``ray.init()`` turns on token authentication and writes
``~/.ray/auth_token``; tests turn auth off on purpose (the job-submission test turns it
back on for its own head) and point HOME at a temporary folder so nothing of the
developer's is touched.

The shared instance emulates 4 GPUs (``RAYTRAIN_MGPU_EMULATE_GPUS=4``, see
``raytrain_mgpu.runtime.devices``): Ray gets 4 fake GPUs, so ``use_gpu=True`` runs schedule
onto them and record ``cuda:k``/nccl while computing on CPU with gloo. The variable is
set from the first test that uses ``ray_session`` to the end of the session; a unit test
that depends on it sets or clears it itself (``monkeypatch``).
"""

from __future__ import annotations

import os

import pytest

from raytrain_mgpu.runtime.devices import EMULATE_ENV

EMULATED_GPUS = 4  # the shared Ray instance's fake GPUs


def pytest_collection_modifyitems(config, items):
    """The quick tier (``-m "not slow"``): unit tests, local multi-process (gloo) tests and the
    few Ray runs marked ``quick``. Every other test that trains through Ray (the shared
    instance, or a Ray of its own: marked ``ray``) costs 10-60 s on 2 cores, so it is ``slow``:
    the full suite runs it, the quick tier does not."""
    for item in items:
        uses_ray = "ray_session" in item.fixturenames or item.get_closest_marker("ray") is not None
        if uses_ray and item.get_closest_marker("quick") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_AUTH_MODE", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", EMULATE_ENV)}
    os.environ["HOME"] = str(home)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray Train's controller polls every 2 s by default; each state change waits for a poll.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    os.environ[EMULATE_ENV] = str(EMULATED_GPUS)
    ray.init(num_cpus=4, num_gpus=EMULATED_GPUS, include_dashboard=True, log_to_driver=False)
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


@pytest.fixture
def gloo_group():
    """A one-rank gloo process group in this process (DDP and FSDP need one), also on CUDA hosts."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
