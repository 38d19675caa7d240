"""The CLI mirrors TrainConfig: every field is an option, YAML < options, errors exit 2."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from raytrain_mgpu import TrainConfig
from raytrain_mgpu.cli import _build_parser, config_from_args, main
from raytrain_mgpu.data import check_data


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in TrainConfig.field_names():
        assert "--" + name.replace("_", "-") in out, name
    assert "GLOBAL batch: samples per optimizer step" in out


def test_help_reads_as_text_without_rest_markup(capsys):
    import re

    from raytrain_mgpu.cli import _plain

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and not re.search(r":[a-z]+:`", out)
    assert "Registry name (lenet, resnet18, mlp, transformer_lm), pkg.module:function, or" in " ".join(out.split())
    # the roles the field docstrings may use, as Sphinx shows them
    assert _plain("a :class:`~raytrain_mgpu.driver.callbacks.Callback` named by :func:`raytrain_mgpu.fit` or "
                  ":doc:`the guide <docs/guide>`, `x`") == "a Callback named by raytrain_mgpu.fit or the guide, x"


def test_options_override_yaml_and_parse_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: mlp\nlr: 0.1\nepochs: 2\n")
    args = _build_parser().parse_args([
        "train", "--config", str(path), "--lr", "0.3", "--model-kwargs", "{widths: [16, 8]}",
        "--input-shape", "1,8,8", "--no-use-gpu", "--precision", "bf16-mixed", "--balance", "[1, 2]"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.lr, cfg.epochs, cfg.use_gpu) == ("mlp", 0.3, 2, False)
    assert cfg.model_kwargs == {"widths": [16, 8]} and cfg.input_shape == (1, 8, 8)
    assert cfg.precision == "bf16-mixed" and cfg.balance == (1, 2)


def test_choice_options_stay_text_and_lr_scaling_null_is_none():
    args = _build_parser().parse_args(["train", "--precision", "32", "--schedule", "1f1b", "--placement", "SPREAD",
                                       "--lr-scaling", "null", "--optimizer", "sgd"])
    cfg = config_from_args(args)
    assert (cfg.precision, cfg.schedule, cfg.placement, cfg.lr_scaling, cfg.optimizer) == \
        ("32", "1f1b", "SPREAD", None, "sgd")
    assert config_from_args(_build_parser().parse_args(["train", "--lr-scaling", "sqrt"])).lr_scaling == "sqrt"


def test_the_profiler_window_takes_the_forms_a_user_types():
    for text in ("10,15", "10-15", "[10, 15]"):
        assert config_from_args(_build_parser().parse_args(["train", "--profile-steps", text])).profile_steps == \
            (10, 15), text
    assert config_from_args(_build_parser().parse_args(["train", "--profile-steps", "null"])).profile_steps is None


def test_bad_input_exits_2_with_the_message(capsys):
    assert main(["train", "--batch-size", "100", "--num-workers", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrain-mgpu: error: TrainConfig.batch_size=100 (global) does not split evenly")


def test_data_convert_writes_parquet_that_trains(tmp_path, capsys):
    out = tmp_path / "digits-parquet"
    assert main(["data", "convert", "--dataset", "digits", "--out", str(out)]) == 0
    assert "Parquet file(s)" in capsys.readouterr().out
    assert pq.read_table(out / "train").num_rows == 1438
    shape, classes = check_data(TrainConfig(dataset="parquet", data_root=str(out)).data)
    assert (tuple(shape), classes) == ((1, 8, 8), 10)


def test_bench_tensor_parallel_is_a_command_that_prints_a_row_per_layout(monkeypatch, capsys):
    # Its options load with the command; the measurement (local gloo ranks, minutes) is faked here.
    from raytrain_mgpu.bench import tensor_parallel

    assert _build_parser().parse_args(["bench-tensor-parallel", "--steps", "2"]).steps == 2
    measured = []
    monkeypatch.setattr(tensor_parallel, "measure", lambda strategy, world, tp, fields, steps: measured.append(
        (strategy, world, tp, fields["model_kwargs"]["num_layers"], steps)) or [(2**20, 2**30, 0.25)] * world)
    assert main(["bench-tensor-parallel", "--layers", "2", "--steps", "3"]) == 0
    assert measured == [("fsdp", world, tp, 2, 3) for world, tp in tensor_parallel.LAYOUTS]
    out = capsys.readouterr().out
    assert "| fsdp 2 x tensor 2 | 4 | 1.00 MiB | 1024 MiB | 250 ms |" in out and out.count("\n") == 2 + 4


def test_version_prints_the_package_version(capsys):
    import raytrain_mgpu

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"raytrain-mgpu {raytrain_mgpu.__version__}"


def test_benchmark_options_are_added_when_their_command_is_parsed(capsys):
    # The benchmark modules import torch, so their options load only for `bench`/`gpu-report`.
    args = _build_parser().parse_args(["bench", "--rounds", "2"])
    assert (args.command, args.rounds) == ("bench", 2)
    assert _build_parser().parse_args(["gpu-report", "--quick"]).quick is True
    assert main(["bench", "--nope"]) == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err
