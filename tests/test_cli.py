"""The CLI mirrors TrainConfig: every field is an option, YAML < options, errors exit 2."""

from __future__ import annotations

import re

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
    assert "unrecognized arguments: --nope. (see `raytrain-mgpu bench --help`)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- what a new user meets

def _commands(parser):
    """(name, parser) of every command and subcommand, their options added (as parsing them does)."""
    for name, command in parser._commands.choices.items():
        command._add_arguments and command._add_arguments(command)
        command._add_arguments = None
        yield name, command
        if command._commands is not None:
            yield from ((f"{name} {sub}", subparser) for sub, subparser in _commands(command))


@pytest.fixture(scope="module")
def every_help():
    """{command: (its parser, its --help)} for the top level and every command (benchmarks included)."""
    parser = _build_parser()
    helps = {"": (parser, parser.format_help())}
    helps.update({name: (command, command.format_help()) for name, command in _commands(parser)})
    return helps


def _option_help(text: str, option: str) -> str:
    """The lines of ``--help`` that describe ``option``: its line and the indented ones under it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"  {re.escape(option)}(?=[ ,]|$)", line))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 6)), len(lines))
    return "\n".join(lines[start:end])


SECTIONS = ["model and data", "data loading", "parallelism", "batch and optimisation", "DDP and model options",
            "run, storage and failures", "checkpoints: the best one and early stopping",
            "watching a run: loggers and callbacks"]  # TrainConfig's "# --- <section>" headers, in order


def test_train_help_groups_the_fields_by_the_configs_sections(every_help):
    titles = SECTIONS
    text = every_help["train"][1]
    headings = re.findall(r"^(\S.*):$", text, re.M)
    assert headings == ["options", *titles], headings  # one group per section, titled by it, in its order
    for option, title in (("--batch-size", "batch and optimisation"), ("--num-workers", "parallelism"),
                          ("--loader-workers", "data loading"), ("--monitor", next(t for t in titles if "best" in t))):
        section = text.split(f"\n{title}:\n")[1].split("\n\n")[0]
        assert re.search(rf"^  {option} ", section, re.M), (option, title)
    assert text.splitlines()[0] == "usage: raytrain-mgpu train [-h] [--config CONFIG] [--allow-code] [--FIELD VALUE ...]"


def test_every_default_is_said_once_and_help_is_plain_text(every_help):
    import argparse

    assert every_help[""][0].description == "raytrain-mgpu: the command line mirror of the Python API."
    for command, (parser, text) in every_help.items():
        assert "``" not in text and not re.search(r":[a-z]+:`", text), command
        for action in parser._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            said = _option_help(text, action.option_strings[0]).count("(default")
            field = command in ("train", "compare", "tune") and action.dest in TrainConfig.field_names()
            worth = field or action.default not in (None, False, [], argparse.SUPPRESS)  # else none, or in words
            assert said == 1 if worth else said <= 1, (command, action.option_strings, said)
    compare = every_help["compare"][1]
    assert " ".join(_option_help(compare, "--steps").split()) == "--steps STEPS measured optimizer steps per strategy " \
                                                                 "(default: 20)"
    assert " ".join(_option_help(compare, "--lr").split()).endswith("(default: 0.02)")


def test_no_abbreviations_an_option_is_its_whole_name(every_help, capsys):
    assert all(parser.allow_abbrev is False for parser, _ in every_help.values())
    assert main(["train", "--gpus", "2"]) == 2  # argparse took it for --gpus-per-worker 2
    assert capsys.readouterr().err == ("raytrain-mgpu: error: unrecognized arguments: --gpus 2. Did you mean "
                                       "'--gpus-per-worker'? (see `raytrain-mgpu train --help`)\n")
    assert main(["bench-startup", "--round", "2"]) == 2
    assert "Did you mean '--rounds'? (see `raytrain-mgpu bench-startup --help`)" in capsys.readouterr().err


def test_an_unknown_option_or_command_names_the_closest_one_and_the_help_that_lists_it(capsys):
    assert main(["train", "--batch-szie", "64", "--epochs", "1"]) == 2
    assert capsys.readouterr().err == ("raytrain-mgpu: error: unrecognized arguments: --batch-szie 64. Did you mean "
                                       "'--batch-size'? (see `raytrain-mgpu train --help`)\n")
    assert main(["tune", "--param", "lr=grid:1,2", "--metirc=val_loss"]) == 2
    assert "--metirc=val_loss. Did you mean '--metric'? (see `raytrain-mgpu tune --help`)" in capsys.readouterr().err
    assert main(["trian", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrain-mgpu: error: unknown command 'trian'. Did you mean 'train'? Commands: train, "
                          "compare, tune,") and err.endswith("(see `raytrain-mgpu --help`)\n")
    assert main(["data", "conv"]) == 2
    assert "unknown command 'conv'. Did you mean 'convert'? Commands: convert, tokenize (see `raytrain-mgpu data --help`)" in \
        capsys.readouterr().err
    assert main(["export", "run", "--format", "safetensor"]) == 2
    assert "argument --format: invalid choice: 'safetensor'. Did you mean 'safetensors'? Valid: safetensors, hf" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command, old, new, values, dest, value", [
    (["bench-preemption"], "--workers", "--num-workers", ["3"], "num_workers", 3),
    (["bench-startup"], "--workers", "--num-workers", ["1", "2"], "num_workers", [1, 2]),
    (["bench-data"], "--train-workers", "--num-workers", ["1", "2"], "num_workers", [1, 2]),
    (["bench-tensor-parallel"], "--batch", "--batch-size", ["4"], "batch_size", 4),
    (["bench-checkpointing"], "--batch", "--batch-size", ["4"], "batch_size", 4),
    (["bench-gpu"], "--samples", "--num-samples", ["64"], "num_samples", 64),
    (["tune", "--param", "lr=grid:1,2"], "--samples", "--trials", ["3"], "trials", 3),
])
def test_benchmarks_take_trains_flag_names_and_the_old_ones_with_a_warning(command, old, new, values, dest, value,
                                                                           capsys):
    assert getattr(_build_parser().parse_args([*command, new, *values]), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(_build_parser().parse_args([*command, old, *values]), dest) == value
    assert capsys.readouterr().err == f"raytrain-mgpu {command[0]}: warning: {old} is deprecated, use {new}\n"
    parser = _build_parser()
    parser.parse_args(command[:1] + ["--param", "x=grid:1"] * (command[0] == "tune"))
    text = parser._commands.choices[command[0]].format_help()
    assert re.search(rf"{new}(?![\w-])", text) and not re.search(rf"{old}(?![\w-])", text)  # the old name hidden


def test_lists_take_words_apart_or_joined_by_commas():
    parse = _build_parser().parse_args
    for words in (["ddp", "fsdp"], ["ddp,fsdp"], ["ddp,", "fsdp"]):
        assert parse(["compare", "--strategies", *words]).strategies == ["ddp", "fsdp"], words
    assert parse(["bench-gpu", "--models", "resnet18,transformer_lm", "--runners", "plain", "fit"]).models == \
        ["resnet18", "transformer_lm"]
    assert parse(["bench-gpu"]).precisions == ["32", "bf16-mixed"]
    assert parse(["gpu-report", "--only", "scale,tests"]).only == parse(["gpu-report", "--only", "scale", "tests"]).only
    assert config_from_args(parse(["train", "--loggers", "tensorboard,csv"])).loggers == ["tensorboard", "csv"]
    assert config_from_args(parse(["train", "--loggers", "tensorboard", "csv"])).loggers == ["tensorboard", "csv"]


def test_tune_counts_trials_with_trials_and_leaves_num_samples_to_the_data(monkeypatch):
    asked = []
    monkeypatch.setattr("raytrain_mgpu.tune.search", lambda cfg, params, trials, *rest, **kw: asked.append(
        (cfg.num_samples, params, trials)))
    assert main(["tune", "--param", "lr=grid:0.1,0.2", "--dataset", "synthetic", "--num-samples", "64"]) == 0
    assert main(["tune", "--param", "lr=grid:0.1,0.2", "--trials", "3"]) == 0
    assert asked == [(64, ["lr=grid:0.1,0.2"], 8), (None, ["lr=grid:0.1,0.2"], 3)]


def test_none_and_numbers_read_as_yaml_writes_them():
    cfg = config_from_args(_build_parser().parse_args(["train", "--lr-scaling", "None", "--monitor", "None",
                                                       "--lr", "1e-3", "--max-steps", "None"]))
    assert (cfg.lr_scaling, cfg.monitor, cfg.max_steps) == (None, None, None)
    assert cfg.lr == 0.001 and isinstance(cfg.lr, float)
    cfg = config_from_args(_build_parser().parse_args(["train", "--lr-scaling", "sqrt", "--monitor", "test_loss"]))
    assert (cfg.lr_scaling, cfg.monitor) == ("sqrt", "test_loss")
