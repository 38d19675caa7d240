"""``raytrain-mgpu bench-data``: the two layouts hold the same images, both paths deliver the same
tensors for them, and the command prints every path and worker count with its ratio (small and fast)."""

from __future__ import annotations

import os
import re

import torch

from raytrain_mgpu.bench import data as bench
from raytrain_mgpu.cli import main
from raytrain_mgpu.config.train import TrainConfig
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.engine.loaders import worker_context


def test_parquet_rows_and_imagefolder_files_are_the_same_images(tmp_path):
    root, folder = str(tmp_path / "parquet"), str(tmp_path / "imagefolder")
    bench.write_images(root, 24, (3, 12, 12), seed=1)
    assert bench.export_imagefolder(root, folder) == 24
    setup = bench.Setup(root, folder, 24, (3, 12, 12), batch_size=8, seed=1)
    ours = build_datasets(TrainConfig(dataset="parquet", data_root=root).data).train
    theirs = bench._imagefolder_epochs(setup, 0)(0).dataset
    files = {os.path.basename(path): index for index, (path, _) in enumerate(theirs.samples)}
    for row in (0, 7, 23):
        x_ours, x_theirs = ours[row][0], theirs[files[f"{row:07d}.png"]][0]
        assert x_ours.dtype == x_theirs.dtype == torch.float32 and x_ours.shape == (3, 12, 12)
        torch.testing.assert_close(x_ours, x_theirs, rtol=0, atol=1e-6)
    assert ours[0][0].std() > 0.05  # not blank images
    # its loader workers start as ours: forked with this process's objects frozen (tests/test_loaders.py)
    assert bench._imagefolder_epochs(setup, 1)(0).multiprocessing_context is worker_context()


def test_the_command_prints_every_path_and_worker_count(capsys):
    assert main(["bench-data", "--num-images", "64", "--image-size", "8", "--batch-size", "16",
                 "--loader-workers", "0", "1", "--epochs", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "64 PNG images 3x8x8" in out
    rows = re.findall(r"^\s+(\d)\s+(parquet|imagefolder)\s+(\d+)\s+(\d+)\s+([\d.]+)x$", out, re.M)
    assert sorted((w, p) for w, p, _, _, _ in rows) == [("0", "imagefolder"), ("0", "parquet"),
                                                        ("1", "imagefolder"), ("1", "parquet")]
    assert all(float(ratio) == 1.0 for _, path, _, _, ratio in rows if path == "imagefolder")
    assert all(int(best) >= int(median) > 0 for _, _, best, median, _ in rows)


def test_another_path_joins_the_table(tmp_path):
    """The hook another ingest uses: an entry in the paths list, timed and compared like the others."""
    def constant(setup, workers):
        batches = [(torch.zeros(setup.batch_size, 1), None)] * 4
        return lambda epoch: batches

    setup = bench.Setup("", "", 0, (1,), batch_size=8, seed=0)
    results = bench.run(setup, [0, 2], epochs=1, paths=[("constant", constant)])
    assert set(results) == {("constant", 0), ("constant", 2)}
    assert "constant" in bench.report(results) and results[("constant", 0)][0] > 0


def test_training_rows_aggregate_the_ranks_as_the_epoch_row_does():
    """Samples over the mean rank's time; every rank's wait over every rank's time; the fastest epoch's share."""
    from raytrain_mgpu.bench import data_stream

    rank0 = [(100, 2.0, 0.5), (100, 1.0, 0.1)]  # (samples, seconds, waiting) of 2 timed epochs
    rank1 = [(100, 2.0, 1.5), (100, 1.0, 0.3)]
    best, share, median = data_stream._figures([rank0, rank1])
    assert (best, share) == (200 / 1.0, 0.4 / 2.0) and median == (200 / 2.0 + 200 / 1.0) / 2
    assert data_stream._timed_epoch([(torch.zeros(3, 1), None)] * 2, step_s=0.0)[0] == 6


def test_the_command_times_training_workers_of_each_ingest(ray_session, capsys):
    """On the shared Ray: 1 and 2 workers of each ingest, and the planned order against Ray Data's own."""
    assert main(["bench-data", "--num-images", "64", "--image-size", "8", "--batch-size", "16", "--loader-workers", "0",
                 "--epochs", "1", "--rounds", "1", "--num-workers", "1", "2", "--step-ms", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+([12])\s+(loader|ray_data|ray_data_free)\s+(\d+)\s+(\d+)\s+([\d.]+)$", out, re.M)
    assert sorted((w, p) for w, p, *_ in rows) == [(w, p) for w in "12" for p in ("loader", "ray_data", "ray_data_free")]
    assert all(int(best) > 0 and 0 < float(share) <= 1 for *_, best, _, share in rows), out
    assert re.findall(r"^planned order vs Ray Data's own, ([12]) worker\(s\): [\d.]+x", out, re.M) == ["1", "2"]
