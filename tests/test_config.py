"""Config validation: every bad input fails on the driver with a message naming the fix."""

from __future__ import annotations

import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.optim import lr_factor


def test_defaults_are_the_demo_run():
    cfg = TrainConfig()
    assert (cfg.model, cfg.dataset, cfg.strategy, cfg.num_workers, cfg.use_gpu) == ("lenet", "digits", "ddp", 2, False)
    assert cfg.name == "lenet-digits-ddp"


@pytest.mark.parametrize("field,value,match", [
    ("model", "resnet19", r"model='resnet19' is not a known model. Valid names: lenet, mlp, resnet18"),
    ("dataset", "mnist2", r"dataset='mnist2': unknown dataset. Valid names: .*digits"),
    ("strategy", "horovod", r"strategy='horovod' is not a known strategy. Valid names: .*ddp"),
    ("batch_size", 0, r"batch_size=0: must be a positive integer"),
    ("num_workers", -1, r"num_workers=-1: must be a positive integer"),
    ("epochs", 0, r"epochs=0"),
    ("lr", -0.1, r"lr=-0.1: must be a finite positive number"),
    ("precision", "fp8", r"precision='fp8': is not one of"),
    ("model", "my-models:build", r"is not of the form 'package.module:function'"),
    ("balance", (2, 0), r"balance=\(2, 0\)"),
])
def test_bad_values_name_field_and_fix(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_batch_must_split_over_workers_and_accumulation():
    with pytest.raises(ValueError, match=r"batch_size=100 \(global\) does not split evenly over 3 .*"
                                         r"grad_accum_steps=2 = 6 micro-batches. Use a multiple of 6, e.g. batch_size=96"):
        TrainConfig(batch_size=100, num_workers=3, grad_accum_steps=2)
    TrainConfig(batch_size=96, num_workers=3, grad_accum_steps=2)  # divides: fine


def test_fp16_without_gpu_is_an_error_not_a_silent_fp32_run():
    with pytest.raises(ValueError, match="16-mixed.*needs CUDA.*bf16-mixed"):
        TrainConfig(precision="16-mixed", use_gpu=False)


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['batchsize'\]. Valid keys: model, model_kwargs"):
        TrainConfig.from_dict({"batchsize": 64})
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.1\nbatch_sise: 64\n")
    with pytest.raises(ValueError, match=r"c.yaml: unknown key\(s\) \['batch_sise'\]"):
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
