"""A user's own classes and functions handed to ``TrainConfig`` from Python (``raytrain_mgpu/config/factories.py``).

In one process, no Ray: each field that names code takes the object itself and the runners' builders
use it; a run folder records it by name and source hash, so a resume with another object is refused;
an object Ray could not send is refused before Ray. Objects defined in a driver's ``__main__``, sent
by value to the pipeline's stage actors and a Ray Train worker: tests/test_real_cpus.py.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.utils.data import TensorDataset

import raytrain_mgpu as rtm
from raytrain_mgpu import api
from raytrain_mgpu.config.factories import code_record, local_modules_to_ship
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.data.base import Datasets
from raytrain_mgpu.models import build_model
from raytrain_mgpu.engine.objectives import Objective
from raytrain_mgpu.engine.optim import build_optimizer
from raytrain_mgpu.driver.preflight import _compare_identity, run_identity


class Net(torch.nn.Sequential):
    def __init__(self, input_shape, num_classes, width=8):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(int(torch.tensor(input_shape).prod()), width),
                         torch.nn.ReLU(), torch.nn.Linear(width, num_classes))


def four_points(cfg):
    x, y = torch.arange(8.0).reshape(4, 1, 2), torch.tensor([0, 1, 0, 1])
    return Datasets(TensorDataset(x, y), TensorDataset(x, y), (1, 2), 2)


def smooth_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)


def hits(outputs, targets):
    return (outputs.argmax(1) == targets).sum(), targets.numel()


def test_every_field_that_names_code_takes_the_class_or_function_itself():
    cfg = rtm.TrainConfig(model=Net, model_kwargs={"width": 4}, dataset=four_points, loss=smooth_loss,
                          metrics=[hits], optimizer=torch.optim.Adam, monitor="test_hits", mode="max")
    assert cfg.name == "Net-four_points-ddp"  # the default run name from the objects' names
    data = build_datasets(cfg.data)
    assert data.input_shape == (1, 2) and len(data.train) == 4
    model = build_model(cfg.model, data.input_shape, data.num_classes, cfg.model_kwargs)
    assert isinstance(model, Net) and model[1].out_features == 4  # model_kwargs reach the class
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["lr"] == cfg.lr
    objective = Objective.of(cfg, data.num_classes)
    outputs, targets = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), torch.tensor([0, 0, 0])
    assert objective.names == ("hits",)
    assert objective.measure(outputs, targets) == [(2, 3)]
    torch.testing.assert_close(objective.loss(outputs, targets), smooth_loss(outputs, targets))


def test_a_value_that_is_no_name_and_no_code_names_the_three_ways():
    with pytest.raises(ValueError, match=r"TrainConfig.model=3: must be a registry name, a 'package.module:function' "
                                         r"or \(from Python\) a class or function. Set model to e.g. 'lenet'"):
        rtm.TrainConfig(model=3)
    with pytest.raises(ValueError, match=r"TrainConfig.loss=3: is not one of .* or \(from Python\) pass the function"):
        rtm.TrainConfig(loss=3)
    with pytest.raises(ValueError, match=r"TrainConfig.metrics=\[3\]: entry 3 is not one of"):
        rtm.TrainConfig(metrics=[3])


def _cell(source: str) -> dict:
    """A notebook cell's functions: ``__main__``'s, compiled from text, with no source file behind them."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace


def test_a_run_folder_records_an_object_by_name_and_source_and_a_resume_with_another_is_refused():
    cell = "import torch\ndef build(input_shape, num_classes):\n    return torch.nn.Linear(2, num_classes)\n"
    first, again = _cell(cell)["build"], _cell(cell)["build"]  # the same cell run twice: two objects
    edited = _cell(cell.replace("num_classes)\n", "num_classes, bias=False)\n"))["build"]
    assert code_record(first) == code_record(again)  # the same code: a resume goes on
    assert code_record(first) != code_record(edited)  # an edited function: refused
    assert code_record(Net).startswith("<object test_objects:Net sha256:")  # from its source file
    resumed = run_identity(rtm.TrainConfig(model=first))
    _compare_identity(resumed, run_identity(rtm.TrainConfig(model=again)), "run")
    with pytest.raises(ValueError, match=r"trained with model='<object __main__:build sha256:\w+>', but this run has "
                                         r"model='<object __main__:build sha256:\w+>': resuming would mix two runs"):
        _compare_identity(resumed, run_identity(rtm.TrainConfig(model=edited)), "run")


def test_an_object_ray_cannot_send_is_refused_before_ray(tmp_path, monkeypatch):
    lock = threading.Lock()

    def holds_a_lock(input_shape, num_classes):
        with lock:
            return Net(input_shape, num_classes)

    def no_ray(*args, **kwargs):
        raise AssertionError("fit connected to Ray before refusing the object")

    monkeypatch.setattr(api, "connect", no_ray)
    cfg = rtm.TrainConfig(model=holds_a_lock, storage_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"TrainConfig.model='test_objects:test_an_object_ray_cannot_send_is_"
                                         r"refused_before_ray.<locals>.holds_a_lock' cannot be sent to the Ray "
                                         r"workers: pickling it raised TypeError: cannot pickle '_thread.lock' object"):
        api.fit(cfg)
    assert list(tmp_path.iterdir()) == []  # no run folder either


def test_an_objects_own_module_ships_with_the_run_and_main_travels_by_value(tmp_path, monkeypatch):
    (tmp_path / "my_local_models.py").write_text("def build(input_shape, num_classes):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_local_models

    try:
        assert local_modules_to_ship(my_local_models.build) == [str(tmp_path / "my_local_models.py")]
        in_main = _cell("def build(input_shape, num_classes):\n    return None\n")["build"]
        assert local_modules_to_ship(in_main) == []
    finally:
        sys.modules.pop("my_local_models", None)


def noisy(x):
    """A random augmentation of one input: what a user hands ``train_transform`` from Python."""
    return x + torch.rand(x.shape)


def test_a_transform_from_python_is_applied_seeded_per_sample_and_recorded():
    cfg = rtm.TrainConfig(dataset=four_points, train_transform=noisy)
    first, again = build_datasets(cfg.data), build_datasets(cfg.data)
    x, _ = first.train[1]
    assert not torch.equal(x, four_points(cfg.data).train[1][0])  # augmented
    assert torch.equal(x, again.train[1][0])  # seeded by (seed, epoch, sample): the same on every build
    first.train.set_epoch(1)
    assert not torch.equal(first.train[1][0], x)  # another epoch, another draw
    assert torch.equal(first.test[1][0], four_points(cfg.data).test[1][0])  # the test split is not augmented
    assert cfg.to_dict()["train_transform"].startswith("<object test_objects:noisy sha256:")
