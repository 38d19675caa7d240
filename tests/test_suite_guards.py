"""The suite's own guards (tests/conftest.py), run in a pytest of their own: a hung test prints
every thread's stack and ends the run; past its time budget the suite stops starting tests and
still prints its summary and the machine's load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

HUNG = '''
import signal, time, pytest

@pytest.mark.timeout(1)
def test_hung_where_sigalrm_cannot_reach():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as a main thread stuck in C code
    time.sleep(60)

def test_never_started():
    pass
'''

TWO = '''
def test_first():
    pass

def test_second():
    pass
'''


def _pytest(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "test_it.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env})


def test_a_test_hung_past_its_timeout_prints_every_threads_stack_and_ends_the_run(tmp_path):
    out = _pytest(tmp_path, HUNG, RAYTRAIN_MGPU_HANG_MARGIN_S="2")
    assert out.returncode == 1
    assert "test_it.py::test_hung_where_sigalrm_cannot_reach still runs after 3 s, past its timeout" in out.stderr
    assert 'in test_hung_where_sigalrm_cannot_reach' in out.stderr  # the hung test's frame, from faulthandler
    assert "test_never_started" not in out.stdout + out.stderr


def test_past_its_budget_the_suite_stops_and_still_prints_the_summary_and_the_machines_load(tmp_path):
    out = _pytest(tmp_path, TWO, RAYTRAIN_MGPU_SUITE_BUDGET_S="0.001")
    assert out.returncode == 2  # interrupted: a suite that did not run every test fails CI, whatever passed
    assert "past its budget" in out.stdout and "stopped after test_it.py::test_first" in out.stdout
    assert "1 passed" in out.stdout and "test_second" not in out.stdout
    assert "machine: " in out.stdout and "free on" in out.stdout  # the header
    assert "machine during the suite:" in out.stdout and "steal" in out.stdout  # the summary


def test_a_ray_api_reached_without_ray_init_fails_instead_of_starting_a_ray():
    """conftest turns Ray's auto-init off: a stray call shows as an error, not as seconds of a Ray start."""
    from ray._private import auto_init_hook

    assert auto_init_hook.enable_auto_connect is False
