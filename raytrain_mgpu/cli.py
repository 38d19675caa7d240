"""``raytrain-mgpu``: the command line mirror of the Python API.

Every ``TrainConfig`` field is an option (``--batch-size``, ``--no-use-gpu``, ...), its help taken from the field's
docstring and grouped by the config's sections; ``--config f.yaml`` supplies defaults that options override. Options
are spelled in full (no abbreviations), with the config's names in every command (the benchmarks' ``--num-workers``).
Errors print one clear line (an unknown option: the command's closest one) and exit with status 2. torch and Ray
load only inside the commands that train: ``--help``, ``--version`` and a bad option answer in a fraction of a second
(tests/test_imports.py holds this).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import importlib
import logging
import re
import sys
import time
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from raytrain_mgpu import __version__
from raytrain_mgpu.config import yaml_values as _yaml
from raytrain_mgpu.config.redact import redact
from raytrain_mgpu._cli_options import (Parser as _Parser, UsageError as _UsageError, WordList, plain as _plain,
                                        renamed, split_commas)
from raytrain_mgpu.config.train import TrainConfig


@functools.lru_cache(maxsize=1)
def _config_layout() -> Tuple[Dict[str, str], Dict[str, str]]:
    """TrainConfig's source, read once: the string literal under each field (its attribute docstring) and the
    ``# --- title`` comment each field sits under (its section, a group of --help). Reading config/train.py's source
    for each of train, compare and tune was ~66 of the 88 ms a ``main`` call took (22 ms read once, 2 cores)."""
    source = inspect.getsource(TrainConfig)
    body = ast.parse(source).body[0].body
    docs, sections = {}, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = _plain(" ".join(str(nxt.value.value).split()))
    headers = [(number, match.group(1).strip()) for number, line in enumerate(source.splitlines(), 1)
               if (match := re.match(r"\s*# --- (\S.*)", line))]
    for node in body:
        if isinstance(node, ast.AnnAssign):
            sections[node.target.id] = next((title for number, title in reversed(headers) if number < node.lineno),
                                            "other fields")
    return docs, sections


def _parse_value(kind: str):
    def parse(text: str) -> Any:
        if kind == "shape":  # "1,28,28" or "[1, 28, 28]"
            text = text if text.strip().startswith("[") else f"[{text}]"
        if kind == "window" and "," in text and not text.strip().startswith("["):  # --profile-steps 10,15
            text = f"[{text}]"
        low, dash, high = text.partition("-")
        if kind in ("range", "window") and dash and low.strip().isdigit() and high.strip().isdigit():
            return int(low), int(high)  # --num-workers 1-4: an elastic (min, max); --profile-steps 10-15
        try:
            value = _yaml.load(text)  # --lr 1e-3 is 0.001, --monitor None is None
        except yaml.YAMLError as exc:  # argparse turns this into one usage error
            raise argparse.ArgumentTypeError(f"{text!r} is not a YAML value ({' '.join(str(exc).split())})")
        if kind == "str" and value is not None:
            return text  # keep "32", "none"-like strings literally (None and null are None)
        return value
    return parse


class _ListOption(argparse.Action):
    """A list field: ``--loggers tensorboard csv`` (or ``tensorboard,csv``), or one YAML value (``--metrics '[mae,
    mse]'``, ``null``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) == 1:
            try:
                value = _parse_value("yaml")(values[0])
            except argparse.ArgumentTypeError as exc:  # argparse reports this one as a usage error; a type's only
                raise argparse.ArgumentError(self, str(exc)) from exc
            if value is None or isinstance(value, list):
                setattr(namespace, self.dest, value)
                return
        setattr(namespace, self.dest, split_commas(values))


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    # The usage line names the command's own options; the ~90 fields are in the groups below it.
    parser.usage = parser.format_usage().partition(": ")[2].rstrip().replace("%", "%%") + " [--FIELD VALUE ...]"
    docs, sections = _config_layout()
    hints = typing.get_type_hints(TrainConfig)
    groups: Dict[str, Any] = {}  # one per section of TrainConfig, titled by it, in its order
    own = {option for action in parser._actions for option in action.option_strings}  # wins: compare's --warmup-steps
    for f in (f for f in dataclasses.fields(TrainConfig) if "--" + f.name.replace("_", "-") not in own):
        title = sections.get(f.name, "other fields")
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = docs.get(f.name, "")  # a docstring that says its default in words (output_device) keeps its own
        help_text = (doc if "(default" in doc else f"{doc} (default: {default!r})").replace("%", "%%")
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        # Names stay text ("32" stays "32"); a Literal with None in it (lr_scaling) is YAML, so "null" is None.
        names = typing.get_origin(hint) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(hint))
        kind = "str" if hint in (str, Optional[str]) or names else "yaml"
        if f.name in ("input_shape", "balance"):
            kind = "shape" if f.name == "input_shape" else "yaml"
        kind = "range" if f.name == "num_workers" else "window" if f.name == "profile_steps" else kind
        if bool in typing.get_args(hint):  # compile, use_gpu: a bare --compile is true, as a boolean's flag
            group.add_argument(flag, dest=f.name, nargs="?", const=True, type=_parse_value("yaml"),
                               default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,  # as a boolean's
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        if list in (hint, typing.get_origin(hint)) or hint == Optional[list]:  # metrics, loggers, callbacks
            group.add_argument(flag, dest=f.name, nargs="+", action=_ListOption, default=argparse.SUPPRESS,
                               metavar=f.name.upper()[:-1], help=help_text)
            continue
        group.add_argument(flag, dest=f.name, type=_parse_value(kind), default=argparse.SUPPRESS,
                           metavar=f.name.upper(), help=help_text)


_CONFIG_OPTIONS = "Every TrainConfig field is an option too (--FIELD VALUE, grouped by its sections below); they " \
                  "override --config."
_ALLOW_CODE_HELP = ("let the --config file name code (model or dataset 'module:function'); without it such a "
                    "file is refused unless the module is listed in RAYTRAIN_MGPU_TRUSTED_MODULES")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raytrain-mgpu", description=_plain(__doc__.split("\n")[0]))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    # The ~90 TrainConfig options are added only for the command parsed (add_arguments).
    train = commands.add_parser("train", help="train a model (default: lenet on digits, ddp on the GPUs found, "
                                              "else 2 CPU workers)",
                                description=_CONFIG_OPTIONS, add_arguments=_add_config_options)
    train.add_argument("--config", help="YAML file of TrainConfig fields")
    train.add_argument("--allow-code", action="store_true", help=_ALLOW_CODE_HELP)

    compare = commands.add_parser(
        "compare", help="run the same model, data and batch under each strategy; table, chart, recommendation",
        description=_CONFIG_OPTIONS, add_arguments=_add_config_options)
    compare.add_argument("--config", help="YAML file of TrainConfig fields")
    compare.add_argument("--allow-code", action="store_true", help=_ALLOW_CODE_HELP)
    compare.add_argument("--strategies", nargs="+", action=WordList, metavar="STRATEGY",
                         help="strategy names (default: every one that can run on this cluster)")
    compare.add_argument("--steps", type=int, default=20, help="measured optimizer steps per strategy")
    compare.add_argument("--warmup-steps", dest="measure_after_steps", type=int, default=5,
                         help="optimizer steps before measuring (rounded up to whole epochs); the runs' LR warm-up "
                              "(TrainConfig.warmup_steps) is set in --config")
    compare.add_argument("--out-dir", help="folder or URI for compare.md, compare.parquet and compare.png "
                                           "(default: <storage-path>/compare-<time>)")
    compare.add_argument("--batch-search", choices=("estimate", "try"),
                         help="largest batch within --memory-budget-bytes from the memory estimate or from "
                              "trial runs (default: try on GPU, estimate on CPU)")

    tune = commands.add_parser("tune", help="hyperparameter search with Ray Tune: one fit per trial, ASHA stopping "
                                            "hopeless trials early; prints the trials and the best values",
                               description=_CONFIG_OPTIONS, add_arguments=_add_config_options)
    tune.add_argument("--config", help="YAML file of TrainConfig fields")
    tune.add_argument("--allow-code", action="store_true", help=_ALLOW_CODE_HELP)
    tune.add_argument("--param", action="append", required=True, metavar="NAME=KIND:VALUES",
                      help="a searched field, e.g. lr=loguniform:1e-4:1e-1, batch_size=grid:32,64, "
                           "optimizer=choice:sgd,adamw, uniform:LOW:HIGH, randint:LOW:HIGH (repeatable)")
    trials = tune.add_argument("--trials", type=int, default=8, help="trials to run (a grid runs each of its values "
                                                                      "this often; --num-samples is the data's size)")
    renamed(tune, trials, "--samples")
    tune.add_argument("--metric", help="history key that ranks the trials (default: --monitor if set, else "
                                       "val_accuracy with --val-fraction, test_accuracy without; a loss for data "
                                       "without classes); maximised for accuracy, minimised for a loss unless "
                                       "--mode says otherwise")
    tune.add_argument("--scheduler", choices=("asha", "none"), default="asha",
                      help="asha: stop trials early on the metric of each epoch; none: train every trial fully")

    commands.add_parser("bench", help="benchmark fit against a plain PyTorch loop and torchrun",
                        add_arguments=_arguments_of("raytrain_mgpu.bench.ddp"))
    for command, (module, help_text) in _MODULE_COMMANDS.items():
        commands.add_parser(command, help=help_text, add_arguments=_arguments_of(module))

    plot = commands.add_parser("plot", help="loss and accuracy per epoch and per step of one or more runs, to a PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="run folder ({storage_path}/{name}): path or URI")
    plot.add_argument("--out", help="PNG path or URI (default: <first RUN>/curves.png)")
    plot.add_argument("--metric", help="history column for the lower panels instead of train/test accuracy, "
                                       "e.g. lr, samples_per_s, data_wait_share")
    plot.add_argument("--live", action="store_true", help="redraw while the runs train, until they finish or Ctrl-C")
    plot.add_argument("--every", type=float, default=5.0, help="seconds between --live redraws")

    export = commands.add_parser("export", help="write a run's newest (or best) checkpoint as model.safetensors "
                                                "and config.json, or as a Hugging Face save_pretrained folder")
    export.add_argument("run", metavar="RUN", help="run folder ({storage_path}/{name}): path or URI")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                        help="safetensors: any model's state dict and the run's config; hf: a transformers model's "
                             "save_pretrained folder, the model built again from the run's recorded config (LoRA "
                             "merged, an hf: model's tokenizer beside it); peft: a LoRA run's adapter folder")
    export.add_argument("--best", action="store_true", help="the best epoch's checkpoint (runs with keep_best and "
                                                            "monitor) instead of the newest")
    export.add_argument("--out", help="folder or URI (default: <RUN>/export, <RUN>/export-best with --best); with "
                                      "--format safetensors, a path ending in .safetensors writes that file, "
                                      "config.json beside it")
    export.add_argument("--allow-code", action="store_true",
                        help="--format hf: build a model the run names as 'module:function' (the run folder names "
                             "code to run; without it such a run is refused unless the module is listed in "
                             "RAYTRAIN_MGPU_TRUSTED_MODULES)")

    data = commands.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    convert = data.add_parser("convert", help="write a dataset as Parquet shards (local path or s3://, gs:// URI)")
    convert.add_argument("--dataset", required=True, help="registry name, e.g. fashion_mnist, cifar10, digits")
    convert.add_argument("--data-root", help="folder with the dataset's files")
    convert.add_argument("--download", action="store_true", help="download the files with torchvision first")
    convert.add_argument("--out", required=True, help="output folder or URI")
    convert.add_argument("--rows-per-file", type=int, default=10000, help="rows per Parquet file")
    tokenize = data.add_parser("tokenize", help="tokenize Parquet or JSONL documents once into Parquet blocks of "
                               "seq_len + 1 token ids (input_ids), which dataset=text reads without a tokenizer")
    tokenize.add_argument("--data-root", required=True, help="file, folder or URI of Parquet or JSONL documents")
    tokenize.add_argument("--tokenizer", required=True, help="tokenizer folder (transformers' save_pretrained)")
    tokenize.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence")
    tokenize.add_argument("--out", required=True, help="output folder or URI")
    tokenize.add_argument("--text-column", default="text", help="column of the documents")
    tokenize.add_argument("--rows-per-file", type=int, default=10000, help="blocks per Parquet file")
    return parser


# Commands a module of their own adds the options of (``add_arguments``) and runs (``run_and_print``):
# {command: (module, help)}, in the order --help lists them.
_MODULE_COMMANDS = {
    "bench-data": ("raytrain_mgpu.bench.data", "images per second to the training loop: our Parquet reader vs "
                   "torchvision ImageFolder on the same PNG files, with 0/1/2 loader workers"),
    "bench-checkpoint": ("raytrain_mgpu.bench.checkpoint", "the training stall per checkpoint: Ray Train's "
                         "synchronous vs asynchronous upload of a large model's checkpoint"),
    "bench-preemption": ("raytrain_mgpu.bench.preemption", "what the preemption check costs: the loop's "
                         "check and ray.train.get_preemption_info() against a small DDP step"),
    "bench-lost-worker": ("raytrain_mgpu.bench.lost_worker", "what a worker killed mid-run costs: a whole-group "
                          "restart against replica groups, each beside an uninterrupted run"),
    "bench-checkpointing": ("raytrain_mgpu.bench.activation_checkpointing", "what activation checkpointing "
                            "saves and costs: a transformer LM's step with and without it"),
    "bench-tensor-parallel": ("raytrain_mgpu.bench.tensor_parallel", "tensor parallel against fsdp alone: per-rank "
                              "parameters, peak memory and step time of a transformer LM on local gloo ranks"),
    "bench-startup": ("raytrain_mgpu.bench.startup", "seconds to the first step: fit in-process and through Ray "
                      "against a hand-written Ray Train loop, each in a fresh process"),
    "bench-gpu": ("raytrain_mgpu.bench.gpu_bench", "fit against a plain PyTorch loop (and Lightning where installed) "
                  "on a GPU: ResNet-18 at CIFAR size and a transformer LM, fp32 and bf16, samples/s and MFU"),
    "bench-lm": ("raytrain_mgpu.bench.lm", "LoRA on a small Llama from a Hugging Face folder: tokens/s and MFU of fit "
                 "on 1 and 2 workers against a plain transformers + peft loop"),
    "gpu-report": ("raytrain_mgpu.bench.gpu_report", "run the GPU-only tests and measure every GPU figure of "
                   "docs/performance.md (under RAYTRAIN_MGPU_EMULATE_GPUS: a quick emulated check)"),
    "spot-watch": ("raytrain_mgpu.driver.spot_watch", "run on a spot node: on SIGTERM (or a cloud termination "
                   "notice) drain it as a preemption, so the run saves a step checkpoint"),
    "goodput": ("raytrain_mgpu.planning.goodput_command", "where a run's time went; --gpus: its goodput at scale")}


def _arguments_of(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """A command's options, added by ``module.add_arguments`` once the command is parsed: the
    module is imported then, so ``raytrain-mgpu --help`` imports no benchmark (tests/test_imports.py)."""
    def add(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(parser)

    return add


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = {name: getattr(args, name) for name in TrainConfig.field_names() if hasattr(args, name)}
    if args.config:
        return TrainConfig.from_yaml(args.config, allow_code=getattr(args, "allow_code", False), **overrides)
    return TrainConfig.from_dict(overrides, source="command line")


def _train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # a bad value fails here, before torch and Ray load
    # late: torch and Ray (2.6 s of import, with the api) load for a run, not for --help or a bad value
    from raytrain_mgpu.api import fit
    from raytrain_mgpu.driver.goodput import describe

    start = time.perf_counter()
    result = fit(cfg)
    m, s = result.metrics, result.startup
    accuracy = f"test_accuracy {m['test_accuracy']:.4f}, " if m.get("test_accuracy") is not None else ""
    startup = (f" (first step after {s['first_step_s']:.1f} s: checks {s['checks_s']:.1f}, Ray {s['ray_s']:.1f}, "
               f"worker group {s['worker_group_s']:.1f}, data and model {s['setup_s']:.1f})" if s else "")
    print(f"done in {time.perf_counter() - start:.0f} s{startup}: {accuracy}{m.get('step', 0)} steps\n  checkpoint: "
          f"{result.checkpoint_path}\n  history:    {result.path}/history.parquet{describe(result.goodput)}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from raytrain_mgpu.api import compare  # late: torch and Ray, as in _train

    report = compare(cfg, strategies=args.strategies, steps=args.steps, warmup_steps=args.measure_after_steps,
                     out_dir=args.out_dir, batch_search=args.batch_search, stream=sys.stdout)
    print(f"\n{report.table()}\n  markdown: {report.paths['markdown']}\n  parquet:  {report.paths['parquet']}"
          f"\n  chart:    {report.paths['chart']}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from raytrain_mgpu.tune import search  # late: torch and Ray, as in _train

    search(cfg, args.param, args.trials, args.metric, None, args.scheduler, stream=sys.stdout)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from raytrain_mgpu.data.convert import convert_to_parquet  # late: torch (2.2 s of import), not for --help

    cfg = TrainConfig(dataset=args.dataset, data_root=args.data_root, download=args.download)
    paths = convert_to_parquet(cfg.data, args.out, rows_per_file=args.rows_per_file)
    print(f"wrote {len(paths)} Parquet file(s) under {args.out}")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from raytrain_mgpu.data.lm_tokenize import tokenize_to_parquet  # late: torch (2.3 s of import), not for --help

    cfg = TrainConfig(dataset="text", data_root=args.data_root, tokenizer=args.tokenizer, seq_len=args.seq_len,
                      text_column=args.text_column)
    paths, blocks = tokenize_to_parquet(cfg.data, args.out, rows_per_file=args.rows_per_file)
    print(f"wrote {blocks} blocks of {args.seq_len + 1} tokens in {len(paths)} Parquet file(s) under {args.out}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from raytrain_mgpu import plot  # late: torch (2.6 s of import) and then matplotlib load here, not for --help

    if args.live:
        print(f"redrawing every {args.every:g} s until every run finishes (Ctrl-C stops)", flush=True)
        path = plot.watch_runs(args.runs, out=args.out, metric=args.metric, every_s=args.every)
    else:
        path = plot.plot_runs(args.runs, out=args.out, metric=args.metric)
    print(f"curves: {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from raytrain_mgpu.driver.export import export_run  # late: torch (2.4 s of import) loads here, not for --help

    paths = export_run(args.run, out=args.out, fmt=args.format, best=args.best, allow_code=args.allow_code)
    print(f"wrote {len(paths)} file(s):")
    for path in paths:
        print(f"  {redact(path)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.short_epochs:
        # late: a benchmark loads when it runs (--help imports none: tests/test_imports.py), and torch and Ray with it
        from raytrain_mgpu.bench import short_epochs

        return short_epochs.run_and_print(args)
    if args.step_scalars:
        from raytrain_mgpu.bench import step_scalars  # late: see short_epochs above

        return step_scalars.run_and_print(args)
    from raytrain_mgpu.bench import ddp as bench  # late: see short_epochs above

    return bench.run_and_print(args)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
    except _UsageError as exc:
        print(f"raytrain-mgpu: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "bench":
            return _bench(args)
        if args.command in _MODULE_COMMANDS:  # a module of its own runs it (imported only now)
            return importlib.import_module(_MODULE_COMMANDS[args.command][0]).run_and_print(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "export":
            return _export(args)
        return _tokenize(args) if args.data_command == "tokenize" else _convert(args)
    except (ValueError, ConnectionError, RuntimeError) as exc:
        # A bad value is one line; a runtime failure may carry a grid or per-rank causes.
        text = " ".join(str(exc).split()) if isinstance(exc, ValueError) else str(exc)
        print(f"raytrain-mgpu: error: {redact(text)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
