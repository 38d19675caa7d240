"""Config validation: every bad input fails on the driver with a message naming the fix."""

from __future__ import annotations

import dataclasses
import re
import typing
import warnings

import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.config.sections import DataConfig, OptimConfig, ParallelConfig
from raytrain_mgpu.engine.optim import lr_factor


def test_defaults_are_the_demo_run():
    cfg = TrainConfig()
    # the devices: the GPUs found when fit starts, else 2 CPU workers (tests/test_auto_devices.py)
    assert (cfg.model, cfg.dataset, cfg.strategy, cfg.num_workers, cfg.use_gpu) == ("lenet", "digits", "ddp", "auto",
                                                                                  "auto")
    assert cfg.name == "lenet-digits-ddp"


@pytest.mark.parametrize("field,value,match", [
    ("model", "resnet19", r"model='resnet19' is not a known model. Did you mean 'resnet18'\? Valid names: lenet, "
                         r"mlp, resnet18"),
    ("dataset", "mnist2", r"dataset='mnist2': unknown dataset.( Did you mean '\w+'\?)? Valid names: .*digits"),
    ("strategy", "horovod", r"strategy='horovod' is not a known strategy. Valid names: .*ddp"),
    ("batch_size", 0, r"batch_size=0: must be a positive integer"),
    ("num_workers", -1, r"num_workers=-1: must be a positive integer"),
    ("epochs", 0, r"epochs=0"),
    ("lr", -0.1, r"lr=-0.1: must be a finite positive number"),
    ("precision", "fp8", r"precision='fp8': is not one of"),
    ("model", "my-models:build", r"is not of the form 'package.module:function'"),
    ("balance", (2, 0), r"balance=\(2, 0\)"),
    ("resources_per_worker", {"GPU": 1}, r"resources_per_worker=\{'GPU': 1\}: 'GPU' is not a custom resource\. Set "
                                         r"use_gpu and gpus_per_worker instead"),
    ("resources_per_worker", {"spot": 0}, r"the amount of 'spot' must be a positive number"),
    ("resources_per_worker", {"accelerator_type:H100": 1}, r"names a GPU type\. Set accelerator_type='H100'"),
    ("label_selector", {"zone": 1}, r"label_selector=\{'zone': 1\}: must be a mapping of label names to values"),
    ("stall_timeout_s", -1, r"stall_timeout_s=-1: must be a finite number >= 0"),
    ("placement_timeout_s", 0, r"placement_timeout_s=0: must be a finite positive number"),
])
def test_bad_values_name_field_and_fix(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_a_gpu_type_needs_gpus():
    with pytest.raises(ValueError, match=r"accelerator_type='H100': needs use_gpu=True"):
        TrainConfig(accelerator_type="H100", use_gpu=False)
    assert TrainConfig(accelerator_type="H100").use_gpu == "auto"  # fit counts the GPUs of that type


def test_batch_must_split_over_workers_and_accumulation():
    with pytest.raises(ValueError, match=r"batch_size=100 \(global\) does not split evenly over 3 .*"
                                         r"grad_accum_steps=2 = 6 micro-batches. Use a multiple of 6, e.g. batch_size=96"):
        TrainConfig(batch_size=100, num_workers=3, grad_accum_steps=2)
    TrainConfig(batch_size=96, num_workers=3, grad_accum_steps=2)  # divides: fine


def test_fp16_without_gpu_is_an_error_not_a_silent_fp32_run():
    with pytest.raises(ValueError, match="16-mixed.*needs CUDA.*bf16-mixed"):
        TrainConfig(precision="16-mixed", use_gpu=False)


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'batchsize'. Did you mean 'batch_size'\?"):
        TrainConfig.from_dict({"batchsize": 64})
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nbatch_sise: 64\n")
    with pytest.raises(ValueError, match=r"c.yaml: unknown key 'batch_sise'. Did you mean 'batch_size'\?"):
        TrainConfig.from_yaml(path)


def test_yaml_round_trip_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: mlp\nmodel_kwargs: {widths: [32]}\nbatch_size: 64\nlr: 0.1\ninput_shape: [1, 8, 8]\n")
    cfg = TrainConfig.from_yaml(path, lr=0.2)
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.input_shape) == ("mlp", 64, 0.2, (1, 8, 8))
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("text,match", [
    ("- a\n- b\n", r"expected a mapping of TrainConfig fields, got list"),
    ("lr: [0.1\n", r"is not valid YAML"),
])
def test_yaml_that_is_not_a_mapping_or_not_yaml(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_yaml(path)


def test_missing_yaml_file():
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.from_yaml("/nonexistent/c.yaml")


def test_lr_scaling_and_schedules():
    cfg = TrainConfig(lr=0.1, batch_size=512, base_batch_size=256, lr_scaling="linear").optim
    assert cfg.scaled_lr() == pytest.approx(0.2)
    assert TrainConfig(lr=0.1, batch_size=1024, lr_scaling="sqrt").optim.scaled_lr() == pytest.approx(0.2)
    warm = TrainConfig(warmup_epochs=1, lr_schedule="cosine").optim
    factors = [lr_factor(s, warm, steps_per_epoch=10, epochs=3) for s in range(30)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)  # linear warm-up
    assert factors[10] == pytest.approx(1.0) and factors[-1] < 0.01  # cosine to ~0
    step = TrainConfig(lr_schedule="step", lr_step_epochs=1, lr_step_gamma=0.5).optim
    assert [lr_factor(s, step, 10, 3) for s in (0, 10, 20)] == [1.0, 0.5, 0.25]


# ----------------------------------------------------------------------------- choices, sections, replace


def test_choices_are_the_literal_types_values():
    hints = typing.get_type_hints(TrainConfig)
    literal = {name for name, hint in hints.items() if typing.get_origin(hint) is typing.Literal}
    # optimizer, lr_schedule and loss: Union[Literal, str] (a name or "module:function"), checked as factories
    assert literal == {"precision", "lr_scaling", "schedule", "placement", "mode", "ingest", "runner",
                       "on_nonfinite", "save", "resume", "fault_tolerance"}
    for name in sorted(literal):
        valid = list(typing.get_args(hints[name]))
        with pytest.raises(ValueError, match=rf"TrainConfig.{name}='bogus': is not one of "
                                             rf"{re.escape(str(valid))}. Set {name} to one of them."):
            TrainConfig(**{name: "bogus"})


@pytest.mark.parametrize("section", [DataConfig, OptimConfig, ParallelConfig])
def test_sections_are_filled_by_name_from_the_fields(section):
    cfg = TrainConfig(dataset="synthetic", num_samples=64, seed=7, optimizer="sgd", lr=1, lr_schedule="cosine",
                      strategy="pipeline", num_workers=1, batch_size=64, num_stages=3, schedule="gpipe",
                      placement="SPREAD", collective_timeout_s=60.0)
    built = {"data": cfg.data, "optim": cfg.optim, "parallel": cfg.parallel}
    got = next(value for value in built.values() if type(value) is section)
    names = [f.name for f in dataclasses.fields(section)]
    assert set(names) <= set(TrainConfig.field_names())  # one name each: no positional mapping
    assert {name: getattr(got, name) for name in names} == {name: getattr(cfg, name) for name in names}
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def _no_warnings(build):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return build()


def test_replace_warns_only_about_options_the_change_leaves_unused():
    ddp = _no_warnings(lambda: TrainConfig(strategy="ddp", bucket_cap_mb=50))  # ddp reads it
    with pytest.warns(UserWarning, match=r"bucket_cap_mb=50 has no effect with strategy='dp'") as record:
        dp = ddp.replace(strategy="dp", num_workers=1, gpus_per_worker=2)
    assert len(record) == 1 and record[0].filename == __file__  # at the caller's line
    _no_warnings(lambda: dp.replace(epochs=3, lr=0.1))  # the original warned already: once is enough
    with pytest.warns(UserWarning, match=r"bucket_cap_mb=60 has no effect") as record:
        dp.replace(bucket_cap_mb=60)  # a new value is a new setting
    assert len(record) == 1
    _no_warnings(lambda: dp.replace(strategy="ddp", num_workers=2, gpus_per_worker=1))  # read again


def test_construction_warns_at_the_users_line():
    with pytest.warns(UserWarning, match=r"num_stages=3 has no effect with strategy='ddp'") as record:
        TrainConfig(strategy="ddp", num_stages=3)
    assert [w.filename for w in record] == [__file__]


def test_replace_validates_and_names_unknown_fields():
    cfg = TrainConfig()
    with pytest.raises(ValueError, match=r"batch_size=0: must be a positive integer"):
        cfg.replace(batch_size=0)
    with pytest.raises(TypeError, match=r"unknown field 'batchsize'. Did you mean 'batch_size'\?"):
        cfg.replace(batchsize=64)
    moved = cfg.replace(input_shape=[1, 8, 8], storage_path="~/elsewhere")  # normalised like a new config
    assert moved.input_shape == (1, 8, 8) and "~" not in moved.storage_path and cfg.input_shape is None
