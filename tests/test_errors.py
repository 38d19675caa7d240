"""Errors reach the user whole across process boundaries, and one retry policy judges them (no Ray started).

The Ray Train runs that show both end to end (a user's exception that does not unpickle, raised on rank 1; a
non-finite loss with max_failures=2; a rank stuck for ever) are in tests/test_cluster_failures.py.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest
import torch

import raytrain_mgpu
from raytrain_mgpu.errors import (PlacementTimeoutError, StuckRankError, UnknownFieldError, WorkerError, add_note, crossing,
                                  worker_note)
from raytrain_mgpu.transports.retry import root_cause, verdict


def _package_exception_classes() -> set:
    found = set()
    for info in pkgutil.walk_packages(raytrain_mgpu.__path__, "raytrain_mgpu."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                found.add(cls)
    return found


def _examples() -> dict:
    """One instance of every exception class of the package, with its fields set."""
    from raytrain_mgpu.cli import _UsageError
    from raytrain_mgpu.pipeline.executor import PipelineStepError
    from raytrain_mgpu.pipeline.schedule import ScheduleError
    from raytrain_mgpu.driver.callbacks import CallbackError
    from raytrain_mgpu.engine.step import NonFiniteError
    from raytrain_mgpu.transports.collective_timeouts import CollectiveTimeoutError
    from raytrain_mgpu.engine.replica_groups import HealedFromPeer, RunOver

    return {cls: example for example in (
        WorkerError("mymodule.MyError", "it broke", "Traceback ...\nmymodule.MyError: it broke\n",
                    "rank 1, node 10.0.0.2, pid 7", False),
        StuckRankError("stuck: rank 1 at step 20 (forward)", [1], "rank 1's stacks: ..."),
        PlacementTimeoutError("the cluster did not grant 2 bundle(s)"),
        UnknownFieldError("TrainConfig(): unknown field 'batchsize'. Did you mean 'batch_size'?"),
        CollectiveTimeoutError("a collective timed out because rank 1 never joined it", [1]),
        CallbackError("callbacks entry 'm:C'", "on_epoch_end", ValueError("bad")),
        NonFiniteError("the training loss became NaN or infinite", 2, 17, [0, 1]),
        PipelineStepError("stage 1 failed at 1F0"),
        ScheduleError("an order that deadlocks"),
        _UsageError("train: unknown flag --x"),
        HealedFromPeer("replica group 1 healed at step 950"),  # the engine's control flow: never leaves a rank
        RunOver("the run's other groups had finished"),
    ) for cls in [type(example)]}


def test_every_exception_class_of_the_package_pickles_with_its_message_fields_and_notes():
    examples = _examples()
    assert _package_exception_classes() == set(examples), "a new exception class: add an example above"
    for cls, exc in examples.items():
        add_note(exc, "raised on rank 1 (node 10.0.0.2, pid 7)")
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is cls and str(back) == str(exc), cls
        assert vars(back) == vars(exc), cls  # its fields and the note


class CodedError(Exception):
    """The common pattern that does not unpickle: required arguments that ``args`` does not hold."""

    def __init__(self, code: int, detail: str):
        super().__init__(f"code {code}: {detail}")
        self.code, self.detail = code, detail


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_an_exception_that_does_not_unpickle_crosses_as_a_worker_error_with_its_type_message_and_traceback():
    original = _raised(CodedError(42, "the widget is bent"))
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(original))  # what Ray's controller met, as a WorkerHealthCheckFailedError
    sent = crossing(original, rank=1, node="10.0.0.2", pid=7, retryable=False)
    assert isinstance(sent, WorkerError)
    back = pickle.loads(pickle.dumps(sent))
    assert back.type_name == f"{__name__}.CodedError" and back.message == "code 42: the widget is bent"
    assert back.where == "rank 1, node 10.0.0.2, pid 7" and back.retryable is False
    assert "in _raised" in back.traceback_text and "CodedError: code 42" in back.traceback_text
    assert "code 42: the widget is bent (rank 1, node 10.0.0.2, pid 7)" in str(back)
    assert verdict(back).retryable is False  # the worker's verdict, carried


def test_an_exception_that_pickles_crosses_as_itself_noted_with_where_it_was_raised():
    original = _raised(KeyError("weights"))
    sent = crossing(original, rank=3, node="10.0.0.9", pid=11, retryable=True)
    assert sent is original
    back = pickle.loads(pickle.dumps(sent))
    assert type(back) is KeyError and worker_note(back) == "raised on rank 3 (node 10.0.0.9, pid 11)"
    assert verdict(back).retryable is True


def _shape_error() -> RuntimeError:
    try:
        torch.nn.Linear(4, 2)(torch.zeros(3, 5))
    except RuntimeError as exc:
        return exc
    raise AssertionError("no shape error")


def _import_error() -> ImportError:
    try:
        importlib.import_module("a_module_nobody_wrote")
    except ImportError as exc:
        return exc
    raise AssertionError("imported")


def _ray_errors():
    import ray.exceptions
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return [ray.exceptions.ActorDiedError(), WorkerHealthCheckFailedError("no answer", RuntimeError("x")),
            ray.exceptions.NodeDiedError("node gone")]


def _table():
    from raytrain_mgpu.driver.callbacks import CallbackError
    from raytrain_mgpu.engine.step import NonFiniteError
    from raytrain_mgpu.transports.collective_timeouts import CollectiveTimeoutError

    return [  # (error, stepped, retried)
        *[(e, True, True) for e in _ray_errors()],                                  # a lost process or node
        (CollectiveTimeoutError("timed out because rank 1 never joined", [1]), True, True),
        (StuckRankError("stuck: rank 1", [1]), True, True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:4313"), False, True),
        (ConnectionResetError(104, "reset by the object store"), False, True),    # a storage hiccup
        (_shape_error(), True, True),                                               # after a step: could be transient
        (NonFiniteError("the training loss became NaN or infinite", 1, 4), True, False),
        (ValueError("TrainConfig.batch_size=0: must be a positive integer"), True, False),
        (_import_error(), False, False),
        (torch.OutOfMemoryError("CUDA out of memory"), True, False),
        (FileNotFoundError(2, "No such file", "/data/train.parquet"), True, False),
        (_shape_error(), False, False),                                             # the user's model, before a step
        (CallbackError("loggers entry 'x'", "on_epoch_end", "OSError: disk full"), True, False),
        (PlacementTimeoutError("not granted"), False, False),
    ]


@pytest.mark.parametrize("row", range(len(_table())))
def test_the_retry_policys_table(row):
    error, stepped, retried = _table()[row]
    assert verdict(error, stepped=stepped).retryable is retried, (error, verdict(error, stepped=stepped))


def test_ray_trains_controller_asks_the_same_policy(monkeypatch):
    from ray.train import FailureConfig
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.util import construct_user_exception_with_traceback
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    from raytrain_mgpu.engine.step import NonFiniteError
    from raytrain_mgpu.transports.ray_train.policy import OneRetryPolicy

    def group_error(exc):  # as Ray Train's worker thread wraps a train function's error
        try:
            raise exc
        except BaseException as caught:
            return WorkerGroupError("failed", {1: construct_user_exception_with_traceback(caught)})

    policy = OneRetryPolicy(FailureConfig(max_failures=2))
    assert policy.make_decision(group_error(NonFiniteError("NaN", 1, 4))) == FailureDecision.RAISE
    died = WorkerGroupError("failed", {0: _ray_errors()[0]})
    assert [policy.make_decision(died) for _ in range(3)] == [FailureDecision.RETRY] * 2 + [FailureDecision.RAISE]
    # Ray Train waits 60 s for a worker group's resources, then tries again (for ever, by itself): while
    # placement_timeout_s lasts in all, then not again
    from raytrain_mgpu.transports.ray_train import policy as ray_train_policy

    clock = [1000.0]
    monkeypatch.setattr(ray_train_policy.time, "monotonic", lambda: clock[0])
    pending = ControllerError(WorkerGroupStartupTimeoutError(2))
    waits = OneRetryPolicy(FailureConfig(max_failures=0), placement_timeout_s=150, start_timeout_s=60)
    decisions = []
    for _ in range(3):
        decisions.append(waits.make_decision(pending))
        clock[0] += 60
    assert decisions == [FailureDecision.RETRY, FailureDecision.RETRY, FailureDecision.RAISE]  # 60, 120, 180 s
    assert OneRetryPolicy(FailureConfig()).make_decision(pending) == FailureDecision.RETRY  # no bound: Ray's own


def test_the_failure_shown_of_several_ranks_is_the_cause_not_the_others_lost_peer():
    from raytrain_mgpu.engine.step import NonFiniteError

    lost_peer = RuntimeError("Connection closed by peer")
    assert root_cause({0: lost_peer, 1: ValueError("bad label 11")})[0] == 1
    assert root_cause({0: NonFiniteError("NaN", 1, 4), 1: NonFiniteError("NaN", 1, 4)})[0] == 0
    assert root_cause({0: lost_peer, 1: _ray_errors()[0], 2: KeyError("k")})[0] == 2
