"""Preemption notices: the check cadence, the save on the first notice only, the config checks.

``get_preemption_info`` is faked; the loop tests drive one rank's engine (``train_epoch``) in this process
(tests/_engine.py). The real notice, from a drained node, is tests/test_two_node_spot.py's business.
"""

from __future__ import annotations

import os
import time

import pytest
from torch import nn

from _engine import RecordingSink, make_engine
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.checkpointing.preemption import CHECK_EVERY_N_STEPS, PreemptionCheck, notice_line, resume_line
from raytrain_mgpu.driver.progress import ProgressPrinter

from ray.train.v2.api.preemption import PreemptionInfo

STEPS_PER_EPOCH = 25
NODE = "a1b2c3d4e5f6" + "0" * 44


class FakeInfo:
    """A worker's notice: None until check ``notice_at`` (1-based: ``local`` counts the checks), the notice
    from then on; ``__call__`` stands in for ``ray.train.get_preemption_info`` (the agreed notice)."""

    def __init__(self, notice_at: int, deadline_ms: int = None):
        self.calls, self.agreed, self.notice_at = 0, 0, notice_at
        self.info = PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={NODE: [1]})

    def local(self):
        self.calls += 1
        return self.info if self.calls >= self.notice_at else None

    def __call__(self):
        self.agreed += 1
        return self.info

    def check(self, cfg, every: int, enabled: bool = True) -> PreemptionCheck:
        """One rank's check reading this notice (no other rank: ``any_rank`` is this rank's answer)."""
        return PreemptionCheck(cfg, every=every, get_info=self, local_notice=self.local, any_rank=lambda seen: seen,
                               enabled=enabled)


def linear(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, num_classes))


def _loop(sink, get_info, steps_per_epoch=STEPS_PER_EPOCH, enabled=True, **overrides) -> tuple:
    """Rank 0's engine of ``steps_per_epoch`` steps an epoch, its preemption check reading ``get_info``; ``saves``:
    the (global step, step in epoch) of each step checkpoint it would write (the checkpoint manager's ``save_step``, recorded instead)."""
    loop = make_engine(dict(model=linear, dataset="synthetic", input_shape=[1, 4, 4], num_classes=3,
                            num_samples=4 * steps_per_epoch, strategy="ddp", batch_size=4, optimizer="sgd", lr=0.1,
                            epochs=3, **overrides), sink=sink)
    loop.checkpoints.triggers = get_info.check(loop.cfg, CHECK_EVERY_N_STEPS, enabled)
    loop.checkpoints.triggers.reporter = loop.reporter
    saves: list = []
    state = loop.state
    loop.checkpoints.save_step = lambda meter: saves.append((state.step, state.step_in_epoch))
    return loop, state, saves


def test_checks_every_n_global_steps_and_saves_once_on_the_first_notice():
    """Checks at steps 10, 20, 30, ... across epochs; the notice on the 3rd check (step 30, mid-epoch
    2) saves there, once, and the checks stop for the rest of the attempt."""
    sink, fake = RecordingSink(), FakeInfo(notice_at=3)
    loop, state, saves = _loop(sink, fake)
    for epoch in range(3):
        loop.train_epoch(epoch)
        state.epoch = epoch + 1
    assert CHECK_EVERY_N_STEPS == 10 and state.step == 75
    assert fake.calls == 3 and loop.checkpoints.triggers.checks == 3  # steps 10, 20, 30; none after the notice
    assert fake.agreed == 1  # Ray's barrier only once a rank has the notice
    assert saves == [(30, 5)]  # global step 30 = step 5 of the second epoch
    notices = [payload for kind, payload in sink.events if kind == "notice"]
    assert notices == [f"preempted (node {NODE[:12]}): saved step 30"]


def test_step_checkpoints_are_kept_and_the_notice_does_not_save_twice():
    """checkpoint_every_n_steps=5: saves at 5, 10, 15, 20 as before; the notice at check 2 (step 20)
    falls on a due step and saves once; after it the K-step checkpoints go on."""
    sink, fake = RecordingSink(), FakeInfo(notice_at=2)
    loop, state, saves = _loop(sink, fake, checkpoint_every_n_steps=5)
    loop.train_epoch(0)
    assert [step for step, _ in saves] == [5, 10, 15, 20]  # 25 is the epoch's end: the epoch checkpoint
    assert fake.calls == 2


def test_a_notice_at_the_epochs_last_step_leaves_the_save_to_the_epoch_checkpoint():
    """Epochs of 20 steps: the notice at step 20 is the epoch's end, where the epoch checkpoint is
    written next; a step checkpoint there (step_in_epoch == steps per epoch) would resume past the epoch."""
    sink, fake = RecordingSink(), FakeInfo(notice_at=2)
    loop, state, saves = _loop(sink, fake, steps_per_epoch=20)
    loop.train_epoch(0)
    assert saves == [] and fake.calls == 2
    assert [payload for kind, payload in sink.events if kind == "notice"] == [
        f"preempted (node {NODE[:12]}): saved step 20"]


def test_no_check_where_no_notice_can_come_and_the_resume_line_once():
    """A transport without notices (the in-process runner: ``enabled=False``) asks nothing; a resumed attempt says
    where it starts, once."""
    sink, fake = RecordingSink(), FakeInfo(notice_at=1)
    loop, state, saves = _loop(sink, fake, enabled=False)
    state.step, state.epoch, state.step_in_epoch = 30, 1, 5
    loop.train_epoch(1)
    assert fake.calls == 0 and state.step == 50
    assert [payload for kind, payload in sink.events if kind == "notice"] == [
        "resuming at step 30 (5/25 steps of epoch 2 done)"]


def test_check_cadence_is_the_global_step_so_every_rank_agrees():
    """The barrier is entered at the same global steps whatever the step in the epoch."""
    fake = FakeInfo(notice_at=99)
    check = fake.check(TrainConfig(), every=4)
    for step in range(1, 18):
        check.after_step(step, step % 7 or 7, 7, lambda: pytest.fail("no notice, no save"))
    assert fake.calls == 4  # steps 4, 8, 12, 16


def test_a_run_on_a_users_ray_datasets_never_asks_and_a_parquet_stream_does():
    """A user's own Ray Datasets that are not materialized stream in Ray Data's order and cannot resume mid-epoch: no
    barrier, no save, whatever the notices. The ``parquet`` stream (a planned order: engine/stream.py) resumes at its
    step: it asks (a materialized split does too: tests/test_ray_datasets.py)."""
    from raytrain_mgpu.data.ray_datasets import RayDataSplits

    fake = FakeInfo(notice_at=1)
    cfg = TrainConfig()
    cfg.ingest, cfg.dataset = "ray_data", RayDataSplits(("train", "test"), 100, (4,), 2)  # the check reads these
    check = fake.check(cfg, every=1)
    for step in range(1, 6):
        assert check.after_step(step, step, 10, lambda: pytest.fail("no save")) is False
    assert fake.calls == 0
    cfg.dataset = "parquet"
    saves = []
    assert fake.check(cfg, every=1).after_step(1, 1, 10, lambda: saves.append(1)) is True and saves == [1]


def test_notice_and_resume_lines():
    info = PreemptionInfo(deadline_ms=1_000_000 + 12_400, preempted_node_to_ranks={NODE: [1, 2]})
    assert notice_line(info, 140, now_s=1_000.0) == f"preempted (node {NODE[:12]}, deadline in 12 s): saved step 140"
    assert resume_line(140, 2, 0, 50) == "resuming at step 140 (epoch 3)"


def test_printer_shows_the_notice_on_its_own_line_over_the_bar():
    import io

    out = io.StringIO()
    printer = ProgressPrinter(3, stream=out, live=True)
    printer.step(5, 25, 1)
    printer.banner("preempted (node x, deadline in 9 s): saved step 5")
    assert out.getvalue().endswith("\r" + " " * 70 + "\rpreempted (node x, deadline in 9 s): saved step 5\n")


@pytest.mark.parametrize("field, value, message", [
    ("max_preemption_failures", -2, r"TrainConfig.max_preemption_failures=-2: must be -1 \(restart after every "
                                    r"preemption\) or a count >= 0\. Leave it at -1 on spot nodes"),
    ("max_preemption_failures", 1.5, r"max_preemption_failures=1.5: must be -1"),
    ("max_preemption_failures", True, r"max_preemption_failures=True: must be -1"),
    ("preemption_grace_s", -1, r"TrainConfig.preemption_grace_s=-1: must be a finite number >= 0\. "
                               r"Set preemption_grace_s to 0"),
    ("preemption_grace_s", float("inf"), r"preemption_grace_s=inf: must be a finite number >= 0"),
])
def test_config_checks(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_config_defaults_are_rays_and_reach_the_failure_config():
    cfg = TrainConfig(max_preemption_failures=3, preemption_grace_s=2.5)
    assert (TrainConfig().max_preemption_failures, TrainConfig().preemption_grace_s) == (-1, 0.0)
    assert (cfg.max_preemption_failures, cfg.preemption_grace_s) == (3, 2.5)
    from raytrain_mgpu.transports.ray_train.driver import run_config
    failure = run_config(cfg).failure_config  # what run_train_workers hands TorchTrainer
    assert (failure.max_preemption_failures, failure.preemption_grace_s) == (3, 2.5)
    assert (failure.max_failures, run_config(cfg).checkpoint_config.num_to_keep) == (
        cfg.max_failures, cfg.num_checkpoints_to_keep)


# ---------------------------------------------------------------- spot-watch (driver/spot_watch.py)


def _metadata_server(answers: list):
    """A local HTTP server answering each GET with the next (status, body); the headers it got are kept."""
    import http.server
    import threading

    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_PUT(self):  # AWS IMDSv2's token
            seen.append({"PUT": self.path, **dict(self.headers)})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"tok123")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/computeMetadata/v1/instance/preempted", seen


@pytest.mark.parametrize("status, body, notice", [
    (200, "FALSE", False), (200, "TRUE", True),  # GCP .../instance/preempted
    (404, "", False), (200, '{"action": "terminate", "time": "2026-11-24T22:20:00Z"}', True),  # AWS instance-action
])
def test_notice_at_url_reads_gcp_and_aws_answers(status, body, notice):
    from raytrain_mgpu.driver.spot_watch import notice_at_url

    server, url, seen = _metadata_server([(status, body)])
    try:
        assert notice_at_url(url) is notice
        assert seen[0].get("Metadata-Flavor") == "Google"  # GCP refuses a request without it
    finally:
        server.shutdown()


def test_notice_at_an_aws_url_asks_with_an_imdsv2_token():
    from raytrain_mgpu.driver.spot_watch import notice_at_url

    server, url, seen = _metadata_server([(200, '{"action": "stop"}')])
    aws = url.replace("/computeMetadata/v1/instance/preempted", "/latest/meta-data/spot/instance-action")
    try:
        assert notice_at_url(aws) is True
    finally:
        server.shutdown()
    token, get = seen
    assert token["PUT"] == "/latest/api/token", token
    assert {k.lower(): v for k, v in token.items()}.get("x-aws-ec2-metadata-token-ttl-seconds") == "300", token
    assert {k.lower(): v for k, v in get.items()}.get("x-aws-ec2-metadata-token") == "tok123", get


def test_notice_at_an_unreachable_url_is_no_notice():
    from raytrain_mgpu.driver.spot_watch import notice_at_url

    assert notice_at_url("http://127.0.0.1:9/", timeout_s=0.5) is False


def _fake_drains(monkeypatch) -> list:
    from raytrain_mgpu.driver import spot_watch

    drains: list = []
    monkeypatch.setattr(spot_watch, "drain_node", lambda address, node_id, grace_s, message: drains.append(
        (address, node_id, grace_s, message, time.monotonic())))
    return drains


def test_watch_drains_its_node_on_sigterm_waits_the_grace_and_restores_the_handler(monkeypatch):
    import signal

    from raytrain_mgpu.driver.spot_watch import watch

    drains = _fake_drains(monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    lines = []

    def log(line):
        lines.append(line)
        if len(lines) == 1:  # "on SIGTERM it drains": the handler is in place, so the notice comes now
            os.kill(os.getpid(), signal.SIGTERM)

    start = time.monotonic()
    assert watch("10.0.0.1:6379", 0.5, node_id="ab" * 28, log=log) == 0
    (address, node_id, grace_s, message, at), = drains
    assert (address, node_id, grace_s) == ("10.0.0.1:6379", "ab" * 28, 0.5) and "SIGTERM" in message
    assert time.monotonic() - at >= 0.5 and at - start < 1.5  # drained at once, then waited out the deadline
    assert signal.getsignal(signal.SIGTERM) is before


def test_watch_drains_on_a_metadata_notice(monkeypatch):
    from raytrain_mgpu.driver.spot_watch import watch

    drains = _fake_drains(monkeypatch)
    server, url, seen = _metadata_server([(200, "FALSE"), (200, "FALSE"), (200, "TRUE")])
    try:
        assert watch("h:1", 0.0, node_id="cd" * 28, notice_url=url, poll_s=0.05, log=lambda line: None) == 0
    finally:
        server.shutdown()
    assert len(seen) == 3 and len(drains) == 1 and url in drains[0][3]


def test_spot_watch_cli_checks_the_grace(capsys):
    from raytrain_mgpu.cli import main

    assert main(["spot-watch", "--grace-s", "-1"]) == 2
    assert "spot-watch --grace-s=-1.0: must be a finite number >= 0" in capsys.readouterr().err


def _any_rank_worker(rank: int, world: int, out: str) -> None:
    from raytrain_mgpu.checkpointing.preemption import AnyRank

    any_rank = AnyRank()
    # rank 1 alone has a notice at the second check; nobody at the first and the third
    answers = [any_rank([seen])[0] for seen in (False, rank == 1, False)]
    with open(f"{out}/{rank}", "w") as f:
        f.write(",".join(str(a) for a in answers))


def test_the_ranks_agree_when_only_one_has_the_notice(tmp_path):
    """The watcher's notice reaches the workers one by one: a check where only rank 1 has it is a
    notice on every rank (each then calls Ray's barrier), the checks before and after are not."""
    import _forkserver

    _forkserver.start_gloo_ranks(_any_rank_worker, (str(tmp_path),))
    assert [(tmp_path / str(rank)).read_text() for rank in (0, 1)] == ["False,True,False"] * 2


# ---------------------------------------------------------------- the pipeline: its own watcher, its own budget


def test_a_stage_actors_drain_watcher_sees_its_node_drained_without_a_call_per_check():
    from raytrain_mgpu.transports.preemption import DrainWatcher

    drains: dict = {}
    polls = []

    def draining():
        polls.append(1)
        return dict(drains)

    watcher = DrainWatcher("node-a", poll_s=0.01, draining=draining)
    try:
        time.sleep(0.05)
        assert watcher.local_notice() is None  # other nodes' drains, or none: no notice
        drains["node-b"] = 0
        time.sleep(0.05)
        assert watcher.local_notice() is None
        drains["node-a"] = 1_000_000
        deadline = time.monotonic() + 5
        while watcher.local_notice() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        notice = watcher.local_notice()
        assert notice.deadline_ms == 1_000_000 and list(notice.preempted_node_to_ranks) == ["node-a"]
        seen = len(polls)
        time.sleep(0.05)
        assert len(polls) == seen  # a notice seen: the thread stops polling
        agreed = watcher.agreed()  # every drained node, for the driver's line
        assert sorted(agreed.preempted_node_to_ranks) == ["node-a", "node-b"]
    finally:
        watcher.close()


def test_a_pipeline_attempt_lost_to_a_preemption_counts_against_max_preemption_failures():
    import ray.exceptions

    from raytrain_mgpu.transports.preemption import DrainWatcher, was_preemption
    from raytrain_mgpu.transports.retry import Verdict, run_attempts

    died = ray.exceptions.RayError("the stage's node went away")
    assert was_preemption(died, DrainWatcher._info({"a1b2c3d4e5f6": 0}))  # a drain noticed: Ray's PreemptionInfo
    assert not was_preemption(died, None)  # no notice, whatever lines the run printed
    marked = RuntimeError("a peer")
    marked.__cause__ = type("Died", (Exception,), {"preempted": True})()
    assert was_preemption(marked)  # Ray marks an actor that died on a node drained for preemption

    cfg = TrainConfig(max_failures=0, max_preemption_failures=2)
    tries = []

    def attempt(_failures):
        tries.append(1)
        if len(tries) <= 2:
            raise died
        return "done"

    retry = lambda exc: Verdict(True, "a lost node")  # noqa: E731
    assert run_attempts(cfg, attempt, retry, preempted=lambda exc: True) == "done" and len(tries) == 3
    tries.clear()
    with pytest.raises(ray.exceptions.RayError):  # the same failures, not preemptions: max_failures=0
        run_attempts(cfg, attempt, retry, preempted=lambda exc: False)
    assert len(tries) == 1


def test_the_drivers_drain_watcher_sees_any_node_of_an_attempts_group_and_asks_once_more_on_a_failure():
    """The driver watches the nodes of a pipeline attempt's placement group (``actor_group/runner.py``); a failed
    attempt asks Ray once more (``poll``) before the group is torn down."""
    from raytrain_mgpu.transports.preemption import DrainWatcher

    drains: dict = {}
    watcher = DrainWatcher({"node-a", "node-b"}, poll_s=3600, draining=lambda: dict(drains))
    try:
        assert watcher.poll() is None
        drains["node-c"] = 0  # a node outside the group
        assert watcher.poll() is None
        drains["node-b"] = 5_000
        notice = watcher.poll()
        assert list(notice.preempted_node_to_ranks) == ["node-b"] and notice.deadline_ms == 5_000
        drains.clear()
        assert watcher.poll() is notice and watcher.local_notice() is notice  # the first one is kept
    finally:
        watcher.close()


def test_the_attempt_driver_charges_a_failure_with_a_drain_notice_to_max_preemption_failures(tmp_path):
    """``transports/attempt.drive`` asks the carrier for a structured notice after each failed attempt: with one, the
    restart counts against ``max_preemption_failures``; without, against ``max_failures``."""
    import ray.exceptions

    from raytrain_mgpu.transports.attempt import Carrier, drive
    from raytrain_mgpu.transports.preemption import DrainWatcher
    from raytrain_mgpu.transports.retry import Verdict

    class Reclaimed(Carrier):  # the driver's own process: no progress channel to open
        in_process, what = True, "test attempt"

        def __init__(self, cfg, notice):
            super().__init__(cfg, None, None)
            self.notice, self.started = notice, []

        def start(self, sink, attempt):
            self.started.append(attempt)

        def wait(self):
            if len(self.started) <= 2:
                raise ray.exceptions.RayError("the stage's node went away")

        def judge(self, exc):
            return Verdict(True, "a lost node")

        def preemption(self):
            return self.notice

    cfg = TrainConfig(storage_path=str(tmp_path), name="reclaimed", max_failures=0, max_preemption_failures=2)
    preempted = Reclaimed(cfg, DrainWatcher._info({"node-a": 0}))
    assert drive(preempted) == ([], None, None) and preempted.started == [0, 1, 2]
    lost = Reclaimed(cfg, None)
    with pytest.raises(ray.exceptions.RayError) as failed:
        drive(lost)
    assert lost.started == [0] and any("training run 'reclaimed' failed" in n for n in failed.value.__notes__)


def _ray_up_at_step(out: str, step: int) -> None:
    """A step event in a local stage's process: whether a Ray instance is up there."""
    import ray

    with open(f"{out}/{os.getpid()}", "a") as f:
        f.write(f"{step}:{ray.is_initialized()}\n")


def test_a_stage_outside_ray_starts_no_ray_to_watch_for_drains(tmp_path):
    """The tests' local stages (and any stage run outside Ray) hear of no drain. Asking Ray for the node there
    started a Ray instance in every stage process (~8 s each on 2 cores), in every local pipeline test."""
    import functools

    from _pipeline_local import LocalRun, run_local

    cfg = TrainConfig(model="mlp", dataset="synthetic", input_shape=[6], num_classes=3, num_samples=48,
                      model_kwargs={"widths": [8]}, batch_size=24, num_microbatches=2, strategy="pipeline",
                      num_stages=2, cpus_per_worker=1, use_gpu=False, num_workers=1)
    run_local([LocalRun(cfg, 2, step_event=functools.partial(_ray_up_at_step, str(tmp_path)))])
    seen = sorted(p.read_text() for p in tmp_path.iterdir())
    assert seen == ["1:False\n2:False\n"] * 2, seen
