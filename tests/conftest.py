"""Shared fixtures: one Ray instance for the whole test session.

Ray 2.60's plain ``ray.init()`` turns on token authentication and writes
``~/.ray/auth_token``; tests turn auth off on purpose (the job-submission test turns it
back on for its own head) and point HOME at a temporary folder so nothing of the
developer's is touched.

The shared instance emulates 4 GPUs (``RAYTRAIN_MGPU_EMULATE_GPUS=4``, see
``raytrain_mgpu.engine.devices``): Ray gets 4 fake GPUs, so ``use_gpu=True`` runs schedule
onto them and record ``cuda:k``/nccl while computing on CPU with gloo. The variable is
set from the first test that uses ``ray_session`` to the end of the session; a unit test
that depends on it sets or clears it itself (``monkeypatch``).

The suite's guards (tests/test_suite_guards.py): a time budget after which no test starts, a
last-resort stack dump for a test hung past its timeout, and the machine's room and load in the
header and the summary, so that a slow or stuck CI run still says where and why.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import tempfile
import threading
import time

import pytest

# A test that reaches a Ray API without meaning to (no ray.init: the shared instance is not up in its process)
# fails instead of starting a Ray instance of its own, ~8 s, left idle in the test process or a local rank for
# the rest of its life: local pipeline stages once started one each, in every local pipeline test. Read when
# Ray is first imported, so before this package's imports; Ray's processes and the tests' subprocesses inherit
# it. Every Ray the suite starts is an explicit ray.init (or fit's own).
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

from raytrain_mgpu.transports.ray_train.faults import FIT_POLL_S, POLL_ENV, WATCHER_ENV

EMULATED_GPUS = 4  # the shared Ray instance's fake GPUs

# The test command installs with `pip install --no-compile` (README): pip's byte-compiling of every
# installed module (torch's CUDA build, ray, transformers, ...) was 64 of its 139 s on the 2-core VM,
# and the suite imports a small part of them (first imports compiling it: 6 s). That only pays where
# Python may write the compiled files: a machine that sets PYTHONDONTWRITEBYTECODE (this VM does)
# would compile torch in every one of the suite's several hundred processes. So the suite, its Ray
# nodes and its subprocesses write them (into the venv and the clone's __pycache__ folders).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# CI stops the whole job at 90 minutes, and a job killed from outside prints no summary, no
# durations and no failure. So the suite keeps its own budget: after SUITE_BUDGET_S it stops
# starting tests and reports what it has (RAYTRAIN_MGPU_SUITE_BUDGET_S=0 turns it off).
SUITE_BUDGET_S = float(os.environ.get("RAYTRAIN_MGPU_SUITE_BUDGET_S", 80 * 60))
# pytest-timeout's SIGALRM reaches a test only when its main thread runs Python; a test still
# running this long past its timeout gets every thread's stack printed and the process ends.
HANG_MARGIN_S = float(os.environ.get("RAYTRAIN_MGPU_HANG_MARGIN_S", 120))
_SESSION_START = time.monotonic()


def _cpu_jiffies() -> list:
    """/proc/stat's first line: user nice system idle iowait irq softirq steal (all CPUs)."""
    with open("/proc/stat") as stat:
        return [int(value) for value in stat.readline().split()[1:9]]


_CPU_AT_START = _cpu_jiffies()


def _compile_own_bytecode() -> None:
    """Bytecode for the package and the tests, written once here. Under PYTHONDONTWRITEBYTECODE=1
    (set on the CI machines) no process writes it, so each of the suite's hundreds of processes
    (Ray workers, stage actors, drivers) would compile the package from source again: about
    0.2 s of CPU each on the 2-core VM. Reading bytecode is not affected by the variable."""
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("raytrain_mgpu", "tests"):
        compileall.compile_dir(os.path.join(root, folder), quiet=2, workers=1)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process, once, before the xdist workers start
        _compile_own_bytecode()


def pytest_report_header(config):
    """What a CI log needs to tell a slow or failed run: the room this machine had. Ray counts a
    disk full by 1 - free/size (reserved and other tenants' space included) and refuses new
    objects past 95% (``local_fs_capacity_threshold``); it kills workers past 95% memory."""
    disk = shutil.disk_usage(tempfile.gettempdir())
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available_gib = int(fields["MemAvailable"].split()[0]) / 2**20
    budget = f"{SUITE_BUDGET_S / 60:.0f} min" if SUITE_BUDGET_S > 0 else "off"
    return (f"machine: {os.cpu_count()} cores, {available_gib:.1f} GiB memory available, "
            f"{disk.free / 2**30:.1f} GiB free on {tempfile.gettempdir()} (Ray counts it "
            f"{1 - disk.free / disk.total:.0%} full); "
            f"suite budget {budget}")


def pytest_terminal_summary(terminalreporter):
    """How busy the machine was: the same tests take several times longer on a machine whose
    cores are shared (gloo ranks wait for each other's time slices at every collective)."""
    spent = [end - start for start, end in zip(_CPU_AT_START, _cpu_jiffies())]
    total = sum(spent) or 1
    user, nice, system, idle, iowait, _, _, steal = spent
    terminalreporter.write_line(
        f"machine during the suite: {os.cpu_count()} cores {(user + nice + system) / total:.0%} busy, "
        f"{idle / total:.0%} idle, {iowait / total:.0%} waiting on the disk, {steal / total:.0%} taken by the "
        f"hypervisor (steal); load average {os.getloadavg()[0]:.1f}; "
        f"{time.monotonic() - _SESSION_START:.0f} s since the suite started")


def _timeout_s(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 0)


def _dump_stacks_and_exit(item, after_s: float) -> None:
    """The last resort for a hang: every thread's stack on the real stderr, then the process ends."""
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=False)  # else the stacks go to the test's captured output
    sys.stderr.write(f"\n{item.nodeid} still runs after {after_s:.0f} s, past its timeout, which could not stop "
                     f"it (its main thread is not running Python); every thread's stack, then exit:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timeout_s = _timeout_s(item)
    watchdog = None
    if timeout_s > 0:
        watchdog = threading.Timer(timeout_s + HANG_MARGIN_S, _dump_stacks_and_exit,
                                   args=(item, timeout_s + HANG_MARGIN_S))
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.cancel()
    elapsed = time.monotonic() - _SESSION_START
    if SUITE_BUDGET_S > 0 and elapsed > SUITE_BUDGET_S and not item.session.shouldstop:
        item.session.shouldstop = (f"the suite ran {elapsed / 60:.0f} min, past its budget of "
                                   f"{SUITE_BUDGET_S / 60:.0f} min (RAYTRAIN_MGPU_SUITE_BUDGET_S): stopped "
                                   f"after {item.nodeid} so that the summary and the durations print")


# Modules that start Ray clusters of their own (nodes in network namespaces, a Ray with the
# machine's real CPUs, a head with token auth for job submission, an autoscaling cluster on port
# 6379) rather than use the shared instance: one xdist group of their own, beside the shared
# instance's, so that they run one at a time.
OWN_CLUSTERS = ("test_two_node.py", "test_two_node_elastic.py", "test_two_node_spot.py", "test_hsdp_two_nodes.py",
                "test_real_cpus.py", "test_jobs.py", "test_autoscaler.py")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups and the mark plugin deselects
def pytest_collection_modifyitems(config, items):
    """The quick tier (``-m "not slow"``): unit tests, local multi-process (gloo) tests and the
    few Ray runs marked ``quick``. Every other test that trains through Ray (the shared
    instance, or a Ray of its own: marked ``ray``) costs 10-60 s on 2 cores, so it is ``slow``:
    the full suite runs it, the quick tier does not.

    The two xdist groups (``--dist loadgroup``, pyproject.toml): every test on Ray in one
    process, so that there is one shared Ray instance (``shared_ray``), and the modules with
    clusters of their own in the other (``own_clusters``); the other modules run wherever a process
    is free, each whole in one process.
    """
    for item in items:
        uses_ray = "ray_session" in item.fixturenames or item.get_closest_marker("ray") is not None
        if uses_ray and item.get_closest_marker("quick") is None:
            item.add_marker(pytest.mark.slow)
        if item.path.name in OWN_CLUSTERS:
            item.add_marker(pytest.mark.xdist_group("own_clusters"))
        elif uses_ray:
            item.add_marker(pytest.mark.xdist_group("shared_ray"))
        else:  # a module stays in one process: its module-scoped fixtures (process pools) start once
            item.add_marker(pytest.mark.xdist_group(item.path.name))


# Ray Train settings of the shared instance (Ray Train propagates them from the driver to its
# controller and workers). The suite is CPU-bound on 2 cores, and every fit starts Ray Train's
# controller, its workers and four helper actors, each a Python process (measured with
# /proc/<pid>/stat: 22.6 CPU-s for a 2-epoch MLP fit on 2 workers, 19.7 s with these):
SHARED_RAY_TRAIN_ENV = {
    # each state change waits for a controller poll, every 2 s by default: fit's own poll
    # (transports/ray_train/faults.controller_poll), set here because the tests' drivers set it as a user would;
    POLL_ENV: FIT_POLL_S,
    # the preemption watcher, one more actor per run (1.4 CPU-s): fit leaves it out on a Ray its process
    # started (checkpointing/preemption.py), this instance included; set for the tests' hand-written Ray Train
    # loops. In the driver's environment only, not the raylet's, which every process inherits: the
    # README job's test (tests/test_fit.py) removes it and sees fit's own decision. The spot tests, on
    # nodes of their own (tests/test_two_node_spot.py), keep the watcher, as a user's cluster does;
    WATCHER_ENV: "0",
    # Ray Train's Prometheus metrics, which no test reads.
    "RAY_TRAIN_METRICS_ENABLED": "0",
}  # and Ray's log monitor backs off (tests/_ray_nodes.QUIET_LOG_MONITOR, set in ray_session)


SPOT = "spot"  # the shared instance's custom resource
GPU_TYPE = "H100"  # the type its emulated GPUs are named


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray
    from _ray_nodes import QUIET_LOG_MONITOR  # here: the suite guards' inner pytests copy this file alone

    from raytrain_mgpu.engine.devices import EMULATE_ENV  # imports torch: here, not in every pytest process's start

    home = tmp_path_factory.mktemp("home")
    env = {**SHARED_RAY_TRAIN_ENV, **QUIET_LOG_MONITOR}
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_AUTH_MODE", *env, EMULATE_ENV)}
    os.environ["HOME"] = str(home)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update({k: v for k, v in env.items() if k != WATCHER_ENV})
    os.environ[EMULATE_ENV] = str(EMULATED_GPUS)
    # With its dashboard, although no test reads Ray's state API (tests/test_ray_ingest.py reads the GCS's
    # actor table): Ray Train's PlacementGroupCleaner asks the state API whether the controller lives, and
    # on a Ray without a dashboard that question goes to 127.0.0.1:8265, where another test's Ray may
    # answer "no such actor": the cleaner then removed a live run's placement group (a CI run, 2026-11-25).
    # its node carries a custom resource, as a cluster.yaml node type's "spot: 4" does (resources_per_worker), and
    # names its (emulated) GPUs' type, as Ray names a real GPU node's (accelerator_type)
    ray.init(num_cpus=4, num_gpus=EMULATED_GPUS, resources={SPOT: 4, f"accelerator_type:{GPU_TYPE}": 1},
             include_dashboard=True, log_to_driver=False)
    os.environ[WATCHER_ENV] = env[WATCHER_ENV]  # after the raylet started: the driver's alone (see above)
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
