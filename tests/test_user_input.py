"""A user's first hour: numbers as people write them, names that help, modes that follow the metric.

Pure unit tests: no Ray, no training.
"""

from __future__ import annotations

import textwrap

import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.config import yaml_values as _yaml
from raytrain_mgpu.config.code import better_mode, monitor_mode
from raytrain_mgpu.data import check_data
from raytrain_mgpu.engine.run_state import best_record, stops_early
from raytrain_mgpu.errors import UnknownFieldError

# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("text, value", [
    ("1e-3", 1e-3), ("5E-4", 5e-4), (".5", 0.5), ("-2e3", -2000.0), ("1.5", 1.5),  # YAML 1.2 floats
    ("1000", 1000), ("1_000", 1000), ("0x10", 16),  # ints stay ints
    ("None", None), ("null", None), ("~", None),  # Python's None as YAML's null
    ("none", "none"), ("'1e-3'", "1e-3"), ("16-mixed", "16-mixed"), ("1-4", "1-4"),  # text stays text
    ("[1e-3, 2]", [1e-3, 2]),
])
def test_yaml_reads_numbers_as_people_write_them(text, value):
    read = _yaml.load(text)
    assert read == value and type(read) is type(value)


def test_a_config_file_with_1e_3_trains_with_0_001(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent("""\
        lr: 1e-3
        weight_decay: 5e-4
        num_samples: 1_000
        dataset: synthetic
        monitor: None
        lr_scaling: null
        """))
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.lr, cfg.weight_decay, cfg.num_samples, cfg.monitor, cfg.lr_scaling) == (1e-3, 5e-4, 1000, None, None)
    assert cfg.optim.scaled_lr() == 0.001  # what the optimizer is given


# ----------------------------------------------------------------------------- names that help


@pytest.mark.parametrize("build, message", [
    (lambda: TrainConfig(batchsize=64), "TrainConfig(): unknown field 'batchsize'. Did you mean 'batch_size'?"),
    (lambda: TrainConfig(learning_rate=0.1), "unknown field 'learning_rate'. Did you mean 'lr'?"),
    (lambda: TrainConfig().replace(epoch=3), "TrainConfig.replace(): unknown field 'epoch'. Did you mean 'epochs'?"),
    (lambda: TrainConfig.from_dict({"warmup_epoch": 1, "zzzz": 2}, "run.yaml"),
     "run.yaml: unknown keys 'warmup_epoch'. Did you mean 'warmup_epochs'?; 'zzzz'. No field is close."),
])
def test_an_unknown_field_is_named_with_the_closest_one(build, message):
    with pytest.raises(UnknownFieldError) as caught:
        build()
    assert message in str(caught.value) and "raytrain-mgpu train --help" in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)  # either catch works
    assert len(str(caught.value)) < 300  # the closest name, not every field


def test_an_unknown_yaml_key_is_named_with_the_closest_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batchsize: 64\n")
    with pytest.raises(ValueError, match=r"run.yaml: unknown key 'batchsize'. Did you mean 'batch_size'\?"):
        TrainConfig.from_yaml(path)


@pytest.mark.parametrize("changes, message", [
    ({"strategy": "fdsp"}, "strategy='fdsp' is not a known strategy. Did you mean 'fsdp'? Valid names: ddp, ddp2, "
                           "ddp_mp, ddp_pipeline, dp, dp_balanced, fsdp, mp, pipeline, auto"),
    ({"model": "lenett"}, "model='lenett' is not a known model. Did you mean 'lenet'?"),
    ({"dataset": "digit"}, "dataset='digit': unknown dataset. Did you mean 'digits'?"),
    ({"loss": "crossentropy"}, "Did you mean 'cross_entropy'?"),
    ({"optimizer": "adam_w"}, "Did you mean 'adamw'?"),
    ({"lr_schedule": "cosin"}, "Did you mean 'cosine'?"),
    ({"metrics": ["acc"]}, "entry 'acc' is not one of ['accuracy', 'top5', 'mae', 'mse'] or a "
                           "'package.module:function'. Did you mean 'accuracy'?"),
    # other tools' spellings of a precision: named, not accepted (one setting, one spelling)
    ({"precision": "fp16"}, "precision='fp16': is not one of ['32', '16-mixed', 'bf16-mixed']. Did you mean "
                            "'16-mixed'?"),
    ({"precision": 16}, "precision='16': is not one of ['32', '16-mixed', 'bf16-mixed']. Did you mean '16-mixed'?"),
    ({"precision": "bf16"}, "Did you mean 'bf16-mixed'?"),
])
def test_a_misspelt_choice_is_answered_with_the_closest_valid_name(changes, message):
    with pytest.raises(ValueError) as caught:
        TrainConfig(**changes)
    assert message in str(caught.value)


def test_a_built_model_is_refused_before_anything_runs_saying_to_pass_its_class():
    from torch import nn

    with pytest.raises(ValueError, match=r"model='<Linear instance>': is a built model.*Pass the class, "
                                         r"model=Linear \(its arguments in model_kwargs\), or a function"):
        TrainConfig(model=nn.Linear(64, 10))


@pytest.mark.parametrize("dataset", ["parquet", "fashion_mnist", "cifar10", "text_file"])
def test_a_data_root_that_does_not_exist_is_said_so(tmp_path, dataset):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(ValueError, match=rf"data_root='{missing}': no such file or folder .*the nearest folder "
                                         rf"that exists is {tmp_path}"):
        check_data(TrainConfig(dataset=dataset, data_root=str(missing)).data)


def test_the_default_run_name_is_a_clean_folder_name():
    assert TrainConfig().name == "lenet-digits-ddp"
    assert TrainConfig(model="torchvision.models:resnet18").name == "torchvision.models.resnet18-digits-ddp"


# ----------------------------------------------------------------------------- modes follow the metric


@pytest.mark.parametrize("key, mode", [
    ("test_accuracy", "max"), ("val_accuracy", "max"), ("val_top5", "max"), ("train_accuracy", "max"),
    ("test_loss", "min"), ("val_loss", "min"), ("test_mae", "min"), ("val_mse", "min"),
])
def test_auto_mode_maximises_accuracy_and_minimises_losses(key, mode):
    assert better_mode(key) == mode
    assert better_mode(key, mode="min") == "min" and better_mode(key, mode="max") == "max"  # the user's word wins


def within_tenth(outputs, targets):
    """A user metric that says which way is better."""
    return ((outputs - targets).abs() < 0.1).sum(), targets.numel()


within_tenth.higher_is_better = True


def abs_error(outputs, targets):
    return (outputs - targets).abs().sum(), targets.numel()


def test_a_user_metric_says_which_way_is_better_or_the_mode_is_asked_for():
    cfg = TrainConfig(dataset="synthetic", metrics=[within_tenth], monitor="test_within_tenth")
    assert monitor_mode(cfg) == "max"
    with pytest.raises(ValueError, match=r"mode='auto': cannot tell whether a higher test_abs_error is better: your "
                                         r"metric 'abs_error' does not say. Set mode='max' or mode='min', or give "
                                         r"the function the attribute higher_is_better"):
        TrainConfig(dataset="synthetic", metrics=[abs_error], monitor="test_abs_error")
    assert monitor_mode(TrainConfig(dataset="synthetic", metrics=[abs_error], monitor="test_abs_error",
                                    mode="min")) == "min"


HISTORY = [{"epoch": 1, "test_accuracy": 0.5, "test_loss": 1.0}, {"epoch": 2, "test_accuracy": 0.9, "test_loss": 0.4},
           {"epoch": 3, "test_accuracy": 0.7, "test_loss": 0.6}, {"epoch": 4, "test_accuracy": 0.8, "test_loss": 0.5}]


def test_keep_best_and_early_stopping_on_accuracy_keep_the_highest():
    cfg = TrainConfig(monitor="test_accuracy", keep_best=True, early_stopping_patience=2)
    assert best_record(cfg, HISTORY)["best"] == {"monitor": "test_accuracy", "mode": "max", "epoch": 2, "value": 0.9}
    assert stops_early(HISTORY, cfg)  # epochs 3 and 4 are below epoch 2's accuracy
    loss = TrainConfig(monitor="test_loss", keep_best=True)
    assert best_record(loss, HISTORY)["best"]["epoch"] == 2 and best_record(loss, HISTORY)["best"]["mode"] == "min"


def _loss_of_nothing():
    return 0.0


def _metric_of_one(outputs):
    return 0.0


def _loss_with_a_weight(outputs, targets, weight=1.0):
    return weight


@pytest.mark.parametrize("changes, message", [
    ({"loss": _loss_of_nothing}, "TrainConfig.loss='test_user_input:_loss_of_nothing': must take (outputs, targets)"),
    ({"metrics": ["accuracy", _metric_of_one]}, "entry 'test_user_input:_metric_of_one' must take (outputs, targets)"),
    ({"loss": "test_user_input:_loss_of_nothing"}, "its signature is _loss_of_nothing()"),
])
def test_a_loss_or_metric_that_cannot_take_outputs_and_targets_is_refused_with_the_config(changes, message):
    """Refused where the config is built (so before Ray), naming the field and the shape the engine calls: such a
    function once failed with a bare TypeError at every worker's first step."""
    with pytest.raises(ValueError, match="as the engine calls it") as caught:
        TrainConfig(**changes)
    assert message in str(caught.value) and "def my_" in str(caught.value)
    TrainConfig(loss=_loss_with_a_weight, metrics=["accuracy", _loss_with_a_weight])  # a default binds


def _transform_of_nothing():
    return None


def test_a_transform_that_cannot_take_one_tensor_is_named_before_training():
    with pytest.raises(ValueError, match=r"TrainConfig.train_transform=.*'_transform_of_nothing' must take one input "
                                         r"tensor.*TypeError"):
        check_data(TrainConfig(train_transform=_transform_of_nothing).data)


def test_text_column_given_to_a_dataset_that_does_not_read_it_is_refused():
    with pytest.raises(ValueError, match="TrainConfig.text_column='body': is read by dataset='text' only"):
        TrainConfig(text_column="body")
    TrainConfig(text_column="text")  # its default: not given
