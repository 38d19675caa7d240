"""Callbacks (``TrainConfig.callbacks``): the protocol, its checks, a real run and its resume in this
process (the in-process runner: the engine's events, no Ray), and a raising callback that stops a real run
on each runner. The events of the Ray runners are checked with :func:`assert_events_in_order` where those
runs already are: the Ray Train workers' across a resume in tests/test_fit.py
(test_two_workers_equal_one_and_resume_continues_exactly), the pipeline's actor group in
tests/test_step_scalars.py."""

from __future__ import annotations

import io
import signal

import pytest

import raytrain_mgpu as rtm
from raytrain_mgpu.cli import _build_parser, config_from_args
from raytrain_mgpu.driver.callbacks import Callback, CallbackError, RunEvents, RunInfo, load_callbacks
from raytrain_mgpu.driver.progress import ProgressPrinter
from raytrain_mgpu.checkpointing.run_folder import RunFolder

# 256 digits samples, batch 32: a few steps per epoch; a step's scalars every 2 steps.
SMALL = dict(model="mlp", model_kwargs={"widths": [16]}, dataset="digits", num_samples=256, batch_size=32,
             optimizer="sgd", lr=0.1, seed=1, log_every_n_steps=2, use_gpu=False)


class Recorder(Callback):
    """Every event, in order, as (hook, what)."""

    def __init__(self):
        self.events = []

    def on_train_start(self, run):
        self.events.append(("start", run))

    def on_step(self, step, scalars):
        self.events.append(("step", (step, scalars)))

    def on_epoch_end(self, epoch, metrics):
        self.events.append(("epoch", (epoch, metrics)))

    def on_checkpoint(self, path):
        self.events.append(("checkpoint", path))

    def on_train_end(self, result):
        self.events.append(("end", result))

    def kinds(self):
        return [kind for kind, _ in self.events]


class FailsAtEpoch(Callback):
    """Raises at the end of the first epoch."""

    def on_epoch_end(self, epoch, metrics):
        raise RuntimeError(f"disk full at epoch {epoch}")


class NoHooks:
    pass


def assert_events_in_order(recorder: Recorder, result, epochs: list) -> None:
    """start; per epoch its steps, its row, its checkpoint; end; steps only increase."""
    kinds = recorder.kinds()
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == kinds.count("end") == 1
    rows = [what for kind, what in recorder.events if kind == "epoch"]
    assert [epoch for epoch, _ in rows] == epochs
    # the history's rows; strategy="auto"'s record (auto_strategy, auto_reason) is the driver's, added
    # to the history when fit returns, not part of the rows the workers send
    assert [row for _, row in rows] == [{k: v for k, v in row.items() if not k.startswith("auto_")}
                                        for row in result.history[-len(epochs):]]
    # one checkpoint per epoch, each after its epoch's row (uploaded in the background, it may come
    # after the next epoch's steps: transports/ray_train/uploads.py); the last one is TrainResult's
    checkpoints = [what for kind, what in recorder.events if kind == "checkpoint"]
    assert len(checkpoints) == len(epochs) and checkpoints[-1] == result.checkpoint_path
    assert len(set(checkpoints)) == len(checkpoints)
    row_at = [i for i, kind in enumerate(kinds) if kind == "epoch"]
    checkpoint_at = [i for i, kind in enumerate(kinds) if kind == "checkpoint"]
    assert all(r < c for r, c in zip(row_at, checkpoint_at)), kinds
    assert checkpoint_at[-1] < kinds.index("end")
    steps = [what[0] for kind, what in recorder.events if kind == "step"]
    assert steps == sorted(steps)  # a step may have two events (the pipeline's train/* and stage*/*) ...
    named = [(what[0], name) for kind, what in recorder.events if kind == "step" for name in what[1]]
    assert len(named) == len(set(named))  # ... but never the same scalar twice
    for index, (kind, what) in enumerate(recorder.events):  # an epoch's row comes after its steps
        if kind == "epoch":
            assert all(w[0] <= what[1]["step"] for k, w in recorder.events[:index] if k == "step")
    assert recorder.events[-1][1] is result


# ---------------------------------------------------------------------------- no Ray


def test_run_events_fan_out_in_order_and_a_raising_callback_is_named():
    first, second = Recorder(), Recorder()
    events = RunEvents(ProgressPrinter(2, io.StringIO(), live=False), [("callbacks entry 'a:A'", first),
                                                                       ("callbacks entry 'b:B'", second)])
    events.train_start(RunInfo({}, "/run", False, 0, 0))
    events.scalars(2, {"train/loss": 1.0})
    row = {"epoch": 1, "step": 2, "train_loss": 1.0, "samples_per_s": 1.0}
    events.epoch(row)
    events.checkpoint("/run/checkpoint_1")
    assert first.kinds() == second.kinds() == ["start", "step", "epoch", "checkpoint"]

    failing = RunEvents(ProgressPrinter(2, io.StringIO(), live=False),
                        [("callbacks entry 'tests:FailsAtEpoch'", FailsAtEpoch()), ("after", first)])
    seen = []
    failing.on_failure = seen.append
    with pytest.raises(CallbackError, match=r"callbacks entry 'tests:FailsAtEpoch' raised in on_epoch_end: "
                                            r"RuntimeError: disk full at epoch 1") as info:
        failing.epoch(row)
    assert isinstance(info.value.__cause__, RuntimeError) and seen == [info.value]
    assert first.kinds() == ["start", "step", "epoch", "checkpoint"]  # the one after it was not called
    failing.checkpoint("/run/x")  # after a failure nothing more is delivered (and nothing raised again)
    assert first.kinds()[-1] == "checkpoint" and len(first.events) == 4


def test_a_callbacks_error_copies_and_pickles_with_its_message():
    # Ray Tune copies a trial's error (copy.copy) and Ray pickles errors between processes: both rebuild
    # it from its args, which failed with a TypeError that hid the callback's own error.
    import copy
    import pickle

    error = CallbackError("callbacks entry 'my:Hook'", "on_epoch_end", ValueError("no"))
    for again in (copy.copy(error), pickle.loads(pickle.dumps(error))):
        assert type(again) is CallbackError and str(again) == str(error) == (
            "callbacks entry 'my:Hook' raised in on_epoch_end: ValueError: no")
        assert (again.label, again.hook) == ("callbacks entry 'my:Hook'", "on_epoch_end")


def test_callbacks_load_from_names_and_bad_entries_fail_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "my_hooks.py").write_text(
        "from raytrain_mgpu.driver.callbacks import Callback\n"
        "class Notify(Callback):\n    pass\n"
        "class NeedsArg(Callback):\n    def __init__(self, url):\n        self.url = url\n"
        "class Plain:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    [(label, callback)] = load_callbacks(["my_hooks:Notify"])
    assert label == "callbacks entry 'my_hooks:Notify'" and type(callback).__name__ == "Notify"
    with pytest.raises(ValueError, match=r"callbacks entry 'my_hooks:NeedsArg': building it with no arguments"):
        load_callbacks(["my_hooks:NeedsArg"])
    with pytest.raises(ValueError, match=r"'my_hooks:Plain' built a Plain, which has none of the hooks"):
        load_callbacks(["my_hooks:Plain"])
    with pytest.raises(ValueError, match=r"TrainConfig.callbacks='nowhere:X': cannot import module 'nowhere'"):
        load_callbacks(["nowhere:X"])
    # config checks, before anything is imported
    with pytest.raises(ValueError, match=r"TrainConfig.callbacks=\['os:system'\]|'os' is a standard-library"):
        rtm.TrainConfig(callbacks=["os:system"])
    with pytest.raises(ValueError, match=r"entry 'no_colon' is not of the form 'package.module:Class'"):
        rtm.TrainConfig(callbacks=["no_colon"])
    with pytest.raises(ValueError, match=r"has none of the hooks on_train_start"):
        rtm.TrainConfig(callbacks=[NoHooks()])
    # a config FILE names code only when allowed
    (tmp_path / "run.yaml").write_text("callbacks: [my_hooks:Notify]\n")
    with pytest.raises(ValueError, match=r"callbacks\[0\]='my_hooks:Notify' names code to run"):
        rtm.TrainConfig.from_yaml(tmp_path / "run.yaml")
    assert rtm.TrainConfig.from_yaml(tmp_path / "run.yaml", allow_code=True).callbacks == ["my_hooks:Notify"]


def test_a_bad_callback_fails_fit_before_ray(storage, monkeypatch):
    from raytrain_mgpu import api

    # fit's connect, not ray.init: connect skips ray.init where this process's shared Ray is already up
    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("fit connected to Ray before the check"))
    with pytest.raises(ValueError, match=r"TrainConfig.callbacks='nowhere:Hook': cannot import module 'nowhere'"):
        rtm.fit(rtm.TrainConfig(**SMALL, callbacks=["nowhere:Hook"], storage_path=storage))


def test_cli_takes_loggers_and_callbacks_as_lists():
    args = _build_parser().parse_args(["train", "--loggers", "tensorboard", "csv", "--callbacks", "my_hooks:Notify",
                                       "--metrics", "[top5]"])
    cfg = config_from_args(args)
    assert cfg.loggers == ["tensorboard", "csv"] and cfg.callbacks == ["my_hooks:Notify"] and cfg.metrics == ["top5"]
    with pytest.raises(ValueError, match=r"TrainConfig.loggers=\['neptune'\]: must be a list of \['tensorboard', "
                                         r"'mlflow', 'csv', 'wandb'\]"):
        config_from_args(_build_parser().parse_args(["train", "--loggers", "neptune"]))


# ---------------------------------------------------------------------------- real runs


def _no_ray(monkeypatch):
    from raytrain_mgpu import api

    monkeypatch.setattr(api, "connect", lambda *a, **k: pytest.fail("a one-worker run started Ray"))


def test_a_run_and_its_resume_call_every_hook_in_order_in_process(storage, monkeypatch):
    """One worker trains in this process (no Ray): the first fit from scratch, the resume from its last
    step, each in order, with the rows, step scalars and checkpoints the engine made."""
    _no_ray(monkeypatch)
    first_events, resumed_events = Recorder(), Recorder()
    cfg = rtm.TrainConfig(**SMALL, num_workers=1, epochs=2, name="events", storage_path=storage)
    first = rtm.fit(cfg.replace(callbacks=[first_events]), stream=io.StringIO())
    resumed = rtm.fit(cfg.replace(epochs=3, callbacks=[resumed_events]), stream=io.StringIO())
    start = first_events.events[0][1]
    assert start.resumed is False and (start.start_epoch, start.start_step) == (0, 0)
    assert start.config["name"] == "events" and start.path == first.path
    assert_events_in_order(first_events, first, [1, 2])
    scalars = [what for kind, what in first_events.events if kind == "step"]
    assert [step for step, _ in scalars] == list(range(2, first.metrics["step"] + 1, 2))  # every 2 steps
    assert {"train/loss", "train/lr"} <= set(scalars[0][1])
    assert first.config.callbacks == []  # objects are not part of the recorded config
    start = resumed_events.events[0][1]
    assert start.resumed is True and (start.start_epoch, start.start_step) == (2, first.metrics["step"])
    assert_events_in_order(resumed_events, resumed, [3])  # only the third epoch
    assert all(what[0] > first.metrics["step"] for kind, what in resumed_events.events if kind == "step")


def test_a_raising_callback_stops_an_in_process_run_at_once_and_fails_fit_naming_it(storage, monkeypatch):
    """In the driver's process the callback raises inside the engine's epoch: the run stops there, after
    publishing that epoch's checkpoint, and ``max_failures`` does not retry it (the callback would raise again)."""
    _no_ray(monkeypatch)
    recorder = Recorder()
    cfg = rtm.TrainConfig(**SMALL, num_workers=1, epochs=30, max_failures=3, name="failing-here",
                          storage_path=storage, callbacks=[recorder, FailsAtEpoch()])
    with pytest.raises(CallbackError, match=r"callbacks entry 'test_callbacks:FailsAtEpoch' raised in "
                                            r"on_epoch_end: RuntimeError: disk full at epoch 1"):
        rtm.fit(cfg, stream=io.StringIO())
    assert [what[0] for kind, what in recorder.events if kind == "epoch"] == [1]  # no second epoch, no retry
    assert recorder.kinds().count("start") == 1
    assert RunFolder.of(cfg).state().epoch == 1  # the epoch the callback saw is checkpointed: nothing trained is lost


@pytest.mark.slow  # Ray's own stop: the driver's pump stops Ray Train's controller (stop_main_thread_on_failure)
def test_a_raising_callback_stops_a_ray_train_run_early_and_fails_fit_naming_it(ray_session, storage):
    cfg = rtm.TrainConfig(**SMALL, num_workers=2, epochs=30, name="failing", storage_path=storage,
                          callbacks=[FailsAtEpoch()])
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(CallbackError, match=r"callbacks entry 'test_callbacks:FailsAtEpoch' raised in "
                                            r"on_epoch_end: RuntimeError: disk full at epoch 1"):
        rtm.fit(cfg)
    # stopped early: far from 30 epochs. Each takes about a second; the driver polls events every
    # 0.25 s and the workers stop at their next report, so a loaded CI machine reached epoch 4. Counted
    # in epochs, not seconds: a slower machine slows the epochs and the stop alike (a bound on fit's
    # seconds would also time its start-up, which says nothing about stopping).
    assert RunFolder.of(cfg).state().epoch <= 10
    assert signal.getsignal(signal.SIGINT) is handler  # Ray Train's handler, bound to the stopped run, is gone
