"""``raytrain-mgpu bench-lm`` (raytrain_mgpu/bench/lm.py) without Ray: its options and their checks, ``--help``
without torch, the rows' arithmetic (steady tokens/s, model FLOP/s, MFU only where a peak is known, the ratio to
the plain loop), a refused configuration as a row saying why, and a tiny run of the plain loop and one in-process
worker. The figures themselves are docs/performance.md's, from the command."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_mgpu.bench import lm

ROOT = Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lm.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_lm_help_loads_neither_torch_nor_ray_nor_transformers():
    code = ("import sys\nfrom raytrain_mgpu.cli import main\ntry:\n    main(['bench-lm', '--help'])\n"
            "except SystemExit as exc:\n    print('exit', exc.code)\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'peft') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["exit 0", "[]"], done.stdout
    for flag in ("--num-workers", "--batch-size", "--seq-len", "--max-steps", "--ingest", "--epochs"):
        assert flag in done.stdout  # TrainConfig's names


def test_options_take_the_configs_names_and_words_or_commas():
    args = _args()
    assert (args.num_workers, args.ingest, args.batch_size, args.seq_len, args.max_steps, args.epochs) == (
        [1, 2], ["loader", "ray_data"], 16, 128, 40, 5)
    assert _args("--ingest", "loader,ray_data", "--num-workers", "2").ingest == ["loader", "ray_data"]


@pytest.mark.parametrize("argv, message", [
    (["--ingest", "ray"], r"--ingest ray: unknown \['ray'\]\. Valid: loader, ray_data"),
    (["--epochs", "1"], r"the first epoch is warm-up.*Set --epochs 2 or more"),
    (["--rounds", "0"], r"--rounds 1 or more"),
    (["--max-steps", "2", "--epochs", "3"], r"--max-steps at least --epochs"),
    (["--num-workers", "2", "--batch-size", "15"], r"the global batch a multiple of each"),
    (["--num-workers", "3", "--cpus", "2"], r"each count must be 1 to --cpus"),
])
def test_bad_options_are_refused_before_anything_is_built(argv, message):
    with pytest.raises(ValueError, match=message):
        lm._check(_args(*argv))


def _setup() -> lm.Setup:
    return lm.Setup(model="m", text="t", blocks=None, batch_size=4, seq_len=8, epochs=3, steps_per_epoch=2,
                    max_steps=6, parameters=1000)


def test_rows_take_the_median_epoch_after_the_first_and_the_ratio_within_each_round():
    def run(runner, ingest, workers, cpus, seconds):  # 64 tokens an epoch
        return lm.Measured(runner, ingest, workers, cpus, tokens=[64] * len(seconds), seconds=seconds,
                           flops_per_step=3.2e6)

    skipped = lm.Measured("fit", "ray_data", 2, 1, note="skipped: ingest='ray_data': no CPU left")
    rounds = [[run("plain", "-", 1, 2, [10.0, 1.0, 2.0, 1.0]), run("fit", "loader", 2, 1, [9.0, 0.5, 0.5, 4.0]),
               skipped],
              [run("fit", "loader", 2, 1, [9.0, 2.0, 2.0, 2.0]), run("plain", "-", 1, 2, [9.0, 4.0, 4.0, 4.0])]]
    table = lm.rows(rounds, _setup(), peak=None)
    # the warm-up epoch left out, the median epoch of each run, the median over rounds
    assert [r["tokens_per_s"] for r in table] == [(64 + 16) / 2, (128 + 32) / 2, None]
    # the ratio of each round to its own plain loop: 128/64 = 2 and 32/16 = 2, though the machine slowed 4x
    assert table[1]["vs_plain"] == 2.0 and table[1]["vs_plain_range"] == (2.0, 2.0)
    assert table[0]["gflops_per_s"] == pytest.approx(3.2e6 / 32 * 40 / 1e9)  # FLOPs a token x tokens a second
    assert table[0]["mfu"] is None and table[2]["note"] == skipped.note  # no peak: no MFU
    lines = lm.report(table, peak=None).splitlines()
    assert lines[0] == lm.HEADER and set(lines[1]) == {"-"}
    assert re.match(r"^plain\s+-\s+1\s+1x2\s+40\s+0\.0\s+-\s+1\.00x  1\.00-1\.00x$", lines[2]), lines[2]
    assert re.match(r"^fit\s+loader\s+2\s+2x1\s+80\s+0\.0\s+-\s+2\.00x  2\.00-2\.00x$", lines[3]), lines[3]
    assert lines[4].endswith("skipped: ingest='ray_data': no CPU left")
    assert "no dense peak is known for a CPU" in lines[-1]
    # a known peak: the FLOPs a second of every worker over the peak of as many devices
    with_peak = lm.rows(rounds, _setup(), peak=1e6)
    assert with_peak[0]["mfu"] == pytest.approx(4e6 / 1e6) and with_peak[1]["mfu"] == pytest.approx(8e6 / 2e6)
    assert "a dense peak of 0.0 TFLOP/s a device" in lm.report(with_peak, peak=1e6)


def test_a_configuration_fit_refuses_is_a_row_saying_why_and_ray_data_leaves_a_cpu(monkeypatch):
    seen = []

    def refusing(setup, workers, ingest, cpus_per_worker, storage):
        seen.append((workers, ingest, cpus_per_worker))
        raise ValueError("ingest='ray_data': the training processes hold 2 of the cluster's 2 CPU.\nLeave one free.")

    monkeypatch.setattr(lm, "fit_config", refusing)
    row = lm._one_run(_setup(), ("fit", "ray_data", 1), 2, "runs")
    assert row.tokens_per_s is None and row.note == ("skipped: ingest='ray_data': the training processes hold 2 of "
                                                     "the cluster's 2 CPU. Leave one free.")
    lm._one_run(_setup(), ("fit", "ray_data", 2), 2, "runs")
    lm._one_run(_setup(), ("fit", "loader", 2), 2, "runs")
    assert seen == [(1, "ray_data", 1), (2, "ray_data", 1), (2, "loader", 1)]  # 1 of 2 CPUs left to Ray Data


def test_the_ray_data_ingest_of_text_is_either_run_or_refused_by_the_config():
    """Today the config refuses it (data/ingest.py), and the row says so; once text streams, the row runs."""
    setup = _setup()
    try:
        cfg = lm.fit_config(setup, 1, "ray_data", 2, "runs")
    except ValueError as exc:
        assert "ingest='ray_data'" in str(exc)
    else:
        assert (cfg.ingest, cfg.dataset, cfg.lora["target_modules"]) == ("ray_data", "text", ["q_proj", "v_proj"])
    cfg = lm.fit_config(setup, 2, "loader", 1, "runs")
    assert (cfg.model, cfg.data_root, cfg.max_steps, cfg.epochs, cfg.cpus_per_worker) == ("hf:m", "t", 6, 3, 1)


def test_a_tiny_run_prints_the_plain_loop_and_one_in_process_worker(capsys):
    from _extras import require

    require("peft", "transformers")
    args = _args("--num-workers", "1", "--ingest", "loader", "--batch-size", "4", "--seq-len", "32",
                 "--max-steps", "4", "--epochs", "2", "--rounds", "1", "--cpus", "1")
    assert lm.run_and_print(args) == 0
    printed = capsys.readouterr().out
    assert "3.16 M parameters" in printed and "2 epochs of 2 steps" in printed
    table = printed[printed.index("\n" + lm.HEADER):].strip().splitlines()
    assert re.match(r"^plain\s+-\s+1\s+1x1\s+[\d,]+\s+[\d.]+\s+-\s+1\.00x$", table[2]), table
    assert re.match(r"^fit\s+loader\s+1\s+1x1\s+[\d,]+\s+[\d.]+\s+-\s+[\d.]+x$", table[3]), table
