"""``raytrain-mgpu bench-gpu`` (raytrain_mgpu/bench/gpu_bench.py) without a GPU and without Ray: the plain
loop on the CPU at --tiny sizes, the printed table's shape, and the rows' arithmetic (steady samples/s,
ms a step, MFU, the ratio to the plain loop). The figures themselves come from a GPU machine."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from raytrain_mgpu.bench import gpu_bench
from raytrain_mgpu.bench._gpu_bench_runners import Measured, bench_data


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


ROW = re.compile(r"^(resnet18|transformer_lm)\s+(32|bf16-mixed)\s+(plain|lightning)\s+([\d,]+) (img|tok)/s\s+"
                 r"([\d.]+)\s+(-|[\d.]+%)\s+(-|[\d.]+x)$")


def test_the_plain_loop_at_tiny_sizes_prints_one_row_per_model_and_precision(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert gpu_bench.run_and_print(_args("--tiny", "--device", "cpu", "--runners", "plain", "--out", str(out))) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("\n" + gpu_bench.HEADER):].strip().splitlines()
    assert table[0] == gpu_bench.HEADER and set(table[1]) == {"-"} and table[-1].startswith("samples/s: over")
    body = [ROW.match(line) for line in table[2:-1]]
    assert all(body), table
    assert [(m[1], m[2], m[3], m[5]) for m in body] == [
        ("resnet18", "32", "plain", "img"), ("resnet18", "bf16-mixed", "plain", "img"),
        ("transformer_lm", "32", "plain", "tok"), ("transformer_lm", "bf16-mixed", "plain", "tok")]
    assert all(m[7] == "-" and m[8] == "1.00x" for m in body)  # no MFU on a CPU; plain against itself
    assert "217 MFLOPs an image" in printed  # ResNet-18 at 32x32: tests/test_flops.py checks the count
    saved = json.loads(out.read_text())
    assert [len(row["samples"]) for row in saved["rows"]] == [gpu_bench.TINY.epochs] * 4
    assert saved["peaks"] == {"32": None, "bf16-mixed": None}


def test_rows_take_the_steady_epochs_and_compare_with_the_plain_loop_of_the_same_model_and_precision():
    works = gpu_bench.workloads(gpu_bench.FULL)  # resnet18: batch 256, 25,600 images (100 steps) an epoch
    epoch = [25_600, 25_600, 25_600]
    measured = [Measured("resnet18", "bf16-mixed", "plain", epoch, [9.0, 2.0, 2.0]),  # first epoch: warm-up
                Measured("resnet18", "bf16-mixed", "fit", epoch, [9.0, 2.5, 2.5]),
                Measured("resnet18", "32", "fit", epoch, [9.0, 1.0, 1.0]),  # no plain run in fp32
                Measured("resnet18", "bf16-mixed", "lightning", [], [], note="not run: not installed")]
    peaks = {"bf16-mixed": 1e13, "32": None}
    table = gpu_bench.rows(measured, works, peaks, per_sample={"resnet18": 1e8})
    plain, fit, fp32, skipped = table
    assert plain["samples_per_s"] == pytest.approx(12_800) and plain["step_ms"] == pytest.approx(20.0)
    assert fit["samples_per_s"] == pytest.approx(10_240) and fit["vs_plain"] == pytest.approx(0.8)
    # 10,240 images/s x 1e8 FLOPs an image over a 1e13 FLOP/s peak
    assert fit["mfu"] == pytest.approx(0.1024) and plain["mfu"] == pytest.approx(0.128)
    assert fp32["vs_plain"] is None and fp32["mfu"] is None
    lines = gpu_bench.report(table).splitlines()
    assert lines[3] == "resnet18        bf16-mixed fit           10,240 img/s    25.00  10.2%    0.80x"
    assert lines[4].endswith("   10.00      -        -")
    assert lines[5] == "resnet18        bf16-mixed lightning not run: not installed"


def test_tokens_are_the_lm_samples():
    works = gpu_bench.workloads(gpu_bench.TINY)
    lm = works["transformer_lm"]
    assert lm.step_samples == gpu_bench.TINY.lm_batch * gpu_bench.TINY.lm_seq
    table = gpu_bench.rows([Measured("transformer_lm", "32", "plain", [256, 256], [1.0, 0.5])], works,
                           {"32": None}, {"transformer_lm": 1.0})
    assert table[0]["samples_per_s"] == pytest.approx(512) and table[0]["step_ms"] == pytest.approx(250.0)


def test_the_data_is_deterministic_and_the_lm_targets_are_the_inputs_shifted_by_one():
    from types import SimpleNamespace

    text = bench_data(SimpleNamespace(input_shape=(16,), num_classes=64, num_samples=32, seed=0))
    x, y = text.train.tensors
    assert x.shape == y.shape == (32, 16) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 64
    images = [bench_data(SimpleNamespace(input_shape=(3, 32, 32), num_classes=10, num_samples=40, seed=0))
              for _ in range(2)]
    assert images[0].train.tensors[0].shape == (40, 3, 32, 32) and len(images[0].test) == 10
    assert all(torch.equal(a, b) for a, b in zip(images[0].train.tensors, images[1].train.tensors))


def test_choices_and_devices_that_do_not_exist_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"--runners plain ray: unknown \['ray'\]. Valid: plain, fit, fit-ray, lightning"):
        gpu_bench.run_and_print(_args("--tiny", "--device", "cpu", "--runners", "plain,ray"))
    with pytest.raises(ValueError, match=r"--precisions .* Valid: 32, 16-mixed, bf16-mixed"):
        gpu_bench.run_and_print(_args("--tiny", "--device", "cpu", "--precisions", "fp8"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device.*--device cpu --tiny"):
            gpu_bench.run_and_print(_args("--tiny", "--device", "cuda"))
    with pytest.raises(ValueError, match=r"--compile blocks compiles each block, and torchvision's ResNet-18 has "
                                         r"none .* Add --models transformer_lm"):
        gpu_bench.run_and_print(_args("--tiny", "--device", "cpu", "--compile", "blocks"))


def test_compile_takes_the_whole_model_or_its_blocks_as_fit_does():
    from raytrain_mgpu.models.checkpointing import BLOCKS_COMPILE_FROM
    from raytrain_mgpu.models.checkpointing import compiled as _compiled
    from raytrain_mgpu.models import build_model

    assert [_args(*a).compile for a in ([], ["--compile"], ["--compile", "blocks"])] == [False, True, "blocks"]
    model = build_model("transformer_lm", (16,), 32, {})
    if torch.torch_version.TorchVersion(torch.__version__) >= BLOCKS_COMPILE_FROM:
        assert _compiled(model, "blocks") is model and all(b._compiled_call_impl is not None for b in model)
    else:  # nn.Module.compile compiles nothing there: refused, as fit's model check refuses it
        with pytest.raises(ValueError, match="compiles nothing on torch"):
            _compiled(model, "blocks")
    assert type(_compiled(model, True)).__name__ == "OptimizedModule" and _compiled(model, False) is model


def test_lightning_runs_beside_the_plain_loop_where_installed_and_says_so_where_not(capsys):
    from raytrain_mgpu.bench._gpu_bench_runners import lightning_module

    argv = ("--tiny", "--device", "cpu", "--runners", "plain,lightning", "--models", "transformer_lm")
    assert gpu_bench.run_and_print(_args(*argv, "--precisions", "32")) == 0
    table = capsys.readouterr().out.strip().splitlines()[-3:-1]
    assert ROW.match(table[0]) and table[0].split()[2] == "plain"
    if lightning_module() is None:
        assert table[1].split()[2:] == "lightning not run: neither lightning nor pytorch_lightning is installed".split()
    else:
        assert ROW.match(table[1]) and table[1].split()[2] == "lightning"
