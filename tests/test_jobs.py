"""`ray job submit` end to end, against a local head with the dashboard and token auth.

The head runs in a temporary HOME and temp dir, with free ports, the venv first on its
PATH (a job's ``python`` is whatever the head's PATH finds), ``RAY_AUTH_MODE=token`` and
a token file of the test's own. Every ``ray`` command of the test gets the same
environment, so the only difference between the accepted and the refused submissions
is the token.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from _ray_nodes import RAY, RayNode, base_env, free_port, free_port_flags

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
TOKEN = "rtm-test-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def head():
    # A short temp dir: Ray's Unix sockets live under it (108-byte path limit).
    root = Path(tempfile.mkdtemp(prefix="rtmjob-", dir="/tmp"))
    (root / "home").mkdir()
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    env = base_env(root / "home", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    node = RayNode(root / "t", env)
    ports = free_port_flags()
    try:
        node.start(["--head", "--num-cpus", "4", *[str(x) for kv in ports.items() for x in kv]])
        node.dashboard = f"http://127.0.0.1:{ports['--dashboard-port']}"
        node.gcs = f"127.0.0.1:{ports['--port']}"
        node.root = root
        yield node
    finally:
        node.stop()
        shutil.rmtree(root, ignore_errors=True)


def _ray(node: RayNode, *args: str, timeout_s: float = 60, **env: str):
    return node.run([RAY, *args], timeout_s=timeout_s, extra_env=env, cwd=str(REPO))


def _submit_until_agent_ready(node: RayNode, args: list, timeout_s: float = 300):
    """The dashboard answers before its job agent is up ("No available agent"): retry then."""
    for _ in range(20):
        done = _ray(node, "job", "submit", "--address", node.dashboard, *args, timeout_s=timeout_s)
        if "No available agent to submit job" not in done.stdout + done.stderr:
            return done
        time.sleep(3)
    return done


def test_job_trains_and_leaves_checkpoint_and_history(head, tmp_path):
    storage = tmp_path / "results"
    job_id = f"rtm-{uuid.uuid4().hex[:8]}"
    done = _submit_until_agent_ready(head, [
        "--submission-id", job_id, "--working-dir", ".", "--",
        "python", "jobs/train.py", "--config", "jobs/configs/digits.yaml", "--epochs", "2",
        "--name", "digits-job", "--storage-path", str(storage)])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    status = _ray(head, "job", "status", "--address", head.dashboard, job_id)
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr
    logs = _ray(head, "job", "logs", "--address", head.dashboard, job_id).stdout
    assert "global batch 128 = 2 replica(s) x 64" in logs
    epoch_lines = [line for line in logs.splitlines() if line.startswith("epoch")]
    assert [line.split()[1] for line in epoch_lines] == ["1/2", "2/2"], logs[-3000:]

    run = storage / "digits-job"
    assert sorted(p.name for p in run.glob("checkpoint_*/meta.json"))  # at least one checkpoint
    assert (run / "checkpoint_manager_snapshot.json").is_file()
    assert pq.read_table(run / "history.parquet").column("epoch").to_pylist() == [1, 2]

    # What --working-dir uploaded, as unpacked on the head: the source tree without .venv
    # or .git (Ray skips both by default, and whatever .gitignore lists), so it stays small.
    packages = head.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
    unpacked = [p for p in packages.glob("_ray_pkg_*") if p.is_dir()]
    assert len(unpacked) == 1 and (unpacked[0] / "jobs" / "train.py").is_file()
    assert not (unpacked[0] / ".venv").exists() and not (unpacked[0] / ".git").exists()
    size_mib = sum(p.stat().st_size for p in unpacked[0].rglob("*") if p.is_file()) / 2**20
    assert size_mib < 5, f"{size_mib:.1f} MiB uploaded"


def test_submission_without_or_with_a_wrong_token_is_refused(head):
    # The same environment minus the token: RAY_AUTH_MODE still says token, no token found.
    no_token = head.run([RAY, "job", "submit", "--address", head.dashboard, "--", "echo", "hi"],
                        timeout_s=60, extra_env={"RAY_AUTH_TOKEN_PATH": None}, cwd=str(REPO))
    assert no_token.returncode != 0
    assert "authentication token" in no_token.stderr and "RAY_AUTH_TOKEN_PATH" in no_token.stderr

    # Auth mode off on the client: the dashboard answers 401.
    no_mode = _ray(head, "job", "submit", "--address", head.dashboard, "--", "echo", "hi",
                   RAY_AUTH_MODE="disabled")
    assert no_mode.returncode != 0
    assert "Unauthorized: Missing authentication token" in no_mode.stderr

    wrong = _ray(head, "job", "submit", "--address", head.dashboard, "--", "echo", "hi",
                 RAY_AUTH_TOKEN="not-the-token")
    assert wrong.returncode != 0
    assert "Invalid authentication token" in wrong.stderr

    # None of them got in: the job list is readable with the token and holds no `echo`.
    listed = _ray(head, "job", "list", "--address", head.dashboard)
    assert listed.returncode == 0 and "'echo hi'" not in listed.stdout


def test_training_against_the_cluster_with_a_wrong_token_is_refused_at_once(head):
    # The check fit runs before ray.init (which would retry for 20 s, then blame the network).
    probe = f"from raytrain_mgpu.driver.preflight import probe_ray_address; probe_ray_address({head.gcs!r})"
    python = str(Path(RAY).parent / "python")
    assert head.run([python, "-c", probe], timeout_s=120).returncode == 0  # the right token
    wrong = head.run([python, "-c", probe], timeout_s=120, extra_env={"RAY_AUTH_TOKEN": "not-the-token"})
    assert wrong.returncode != 0
    assert "refused the connection: this process sent a token that it does not accept" in wrong.stderr
    assert "RAY_AUTH_TOKEN_PATH" in wrong.stderr  # the fix
    # No token at all: token mode on with no token file, or token mode off (nothing sent).
    no_token = head.run([python, "-c", probe], timeout_s=120, extra_env={"RAY_AUTH_TOKEN_PATH": None})
    assert no_token.returncode != 0
    assert "token authentication is on (RAY_AUTH_MODE=token) but this process has no token" in no_token.stderr
    assert "RAY_AUTH_TOKEN_PATH" in no_token.stderr, no_token.stderr[-2000:]
    no_mode = head.run([python, "-c", probe], timeout_s=120, extra_env={"RAY_AUTH_MODE": "disabled"})
    assert no_mode.returncode != 0
    assert "refused the connection: this process sent no token" in no_mode.stderr, no_mode.stderr[-2000:]
    # Through the job script: fit's connect runs the same check (ray.init would retry for 20 s, then
    # blame the network). Its time is mostly starting Python and importing torch and Ray, so it is
    # measured against the same script refused by an address where nothing listens (the same one
    # refused call, at once), here and now: a slower machine slows both alike.
    dead = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    unreachable = head.run([python, "jobs/train.py", "--address", dead, "--epochs", "1"], timeout_s=120,
                           cwd=str(REPO))
    reference_s = time.monotonic() - start
    assert unreachable.returncode == 2 and "no Ray cluster answers" in unreachable.stderr, unreachable.stderr[-2000:]
    start = time.monotonic()
    done = head.run([python, "jobs/train.py", "--address", head.gcs, "--epochs", "1"], timeout_s=120,
                    extra_env={"RAY_AUTH_TOKEN": "not-the-token"}, cwd=str(REPO))
    refused_s = time.monotonic() - start
    assert done.returncode == 2 and "refused the connection" in done.stderr, done.stderr[-2000:]
    print(f"refused in {refused_s:.1f} s; the same script against a dead address: {reference_s:.1f} s")
    assert refused_s < 2 * reference_s + 5, (refused_s, reference_s)  # not reference + ray.init's 20 s of retries
