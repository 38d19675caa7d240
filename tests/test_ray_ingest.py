"""``ingest="ray_data"``: the training split streamed by Ray Data (``data/parquet_stream.py``, ``transports/ray_data.py``).

Ray Data's free-order read of a split (``transports/ray_data.train_dataset``, the benchmark's baseline) gives
the loader path's samples, bit for bit (compared sorted by label and pixels): PNG Parquet in train/test
folders (``read_parquet``), one PNG file split 90/10 (rows read by number), and ``data convert``'s raw output
against the original digits. A fit through the planned stream, whose samples Ray Data's tasks decode, trains
the loader path's steps, with full micro-batches, on Ray Train workers and on a pipeline's first stage (the
order, resumes and transforms: tests/test_stream_resume.py). Bad combinations are refused when the config is
built, before Ray.
"""

from __future__ import annotations

import io
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import raytrain_mgpu as rtm
from raytrain_mgpu.data import build_datasets
from raytrain_mgpu.data.convert import convert_to_parquet
from raytrain_mgpu.data.transforms import build_transform

DIGITS_META = {b"raytrain_mgpu.max_value": b"16", b"raytrain_mgpu.mean": b"0.5", b"raytrain_mgpu.std": b"0.5"}


def micro_batch_rows(outputs, targets):
    """A metric: the mean micro-batch size (every micro-batch counts once)."""
    return torch.ones_like(targets).sum(), 1


def write_raw_parquet(out) -> None:
    """digits as raw pixel bytes in train/ and test/ (``raytrain-mgpu data convert``'s output): the fits
    below stream it (no image decode on Ray Data's tasks, no torchvision to import there: the PNG decode
    is checked bit for bit above them)."""
    convert_to_parquet(rtm.TrainConfig(dataset="digits").data, str(out), rows_per_file=500)


def write_png_parquet(out, split_folders: bool = True) -> None:
    """digits as PNG bytes: train/ and test/ with two files each, or one file of both splits."""
    from torchvision.io import encode_png

    digits = build_datasets(rtm.TrainConfig(dataset="digits").data)
    splits = {"train": digits.train, "test": digits.test}
    if not split_folders:
        splits = {"all": digits.train}
    for split, dataset in splits.items():
        encoded = [encode_png(torch.from_numpy(image.copy())).numpy().tobytes() for image in dataset.images]
        folder = os.path.join(out, split) if split_folders else out
        os.makedirs(folder, exist_ok=True)
        half = len(encoded) // 2
        for part, rows in enumerate((slice(0, half), slice(half, None))):
            table = pa.table({"image": pa.array(encoded[rows], pa.binary()),
                              "label": pa.array(dataset.labels[rows], pa.int64())})
            pq.write_table(table.replace_schema_metadata(DIGITS_META), os.path.join(folder, f"part-{part}.parquet"),
                           row_group_size=200)
            if not split_folders:
                return  # one file: the reader splits its rows 90/10


def sorted_samples(xs: torch.Tensor, ys: torch.Tensor) -> tuple:
    """Samples ordered by (label, pixel bytes): an order that does not depend on how they were read."""
    keys = [(int(y), x.numpy().tobytes()) for x, y in zip(xs, ys)]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return xs[order], ys[order]


def loader_samples(data_cfg) -> tuple:
    train = build_datasets(data_cfg).train
    items = [train[i] for i in range(len(train))]
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def ray_data_samples(data_cfg) -> tuple:
    from raytrain_mgpu.transports.ray_data import train_dataset

    batches = list(train_dataset(data_cfg).iter_torch_batches(batch_size=256, device="cpu"))
    return torch.cat([b["x"] for b in batches]), torch.cat([b["y"] for b in batches])


def actors_started(ray, name: str) -> int:
    """Actors of class ``name`` started on this Ray so far (alive or dead), from the GCS's actor table
    (no dashboard needed). Ray Train's ``DatasetManager``: one per run with ``datasets=``, none for a
    loader run (``transports/ray_train/driver.torch_trainer_class``). Ray Data's ``FooterReader``: one per execution of a read
    of a few files (``ray_ingest.footer_readers``), 32 without it."""
    from ray._private import state

    return sum(actor["ActorClassName"].endswith(name) for actor in state.actors().values())


def loader_run(common: dict) -> tuple:
    """The weights and per-epoch history of ``common`` read through the loader, trained here without Ray on one
    rank (``_reference.train_one_worker``: what a 1-worker fit, or a 1-replica pipeline, trains).
    Imported here: the Ray workers import this module for its metric, and only it is shipped."""
    from _reference import train_one_worker

    fields = {k: v for k, v in common.items() if k not in ("storage_path", "metrics", "strategy", "num_stages",
                                                            "num_microbatches", "num_workers")}
    weights, _, _, history = train_one_worker({**fields, "num_workers": 1, "metrics": ["accuracy"]})
    return weights, history


def loader_history(common: dict) -> list:
    """The per-epoch history of :func:`loader_run`."""
    return loader_run(common)[1]


class RecordingTransform:
    """A user's transform (``train_transform=`` from Python): ``inner`` (else the identity), recording in
    ``probe`` what kind of Ray process applied it to a sample: ``task-<pid>`` (Ray Data's decode tasks) or
    ``actor-<pid>`` (a Ray Train worker or a pipeline stage, where the loader path applies it). The shape
    probe's all-zero input is not recorded."""

    def __init__(self, probe: str, inner=None):
        self.probe, self.inner = probe, inner

    def __call__(self, x):
        if bool(x.any()):
            import ray

            actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
            mark = os.path.join(self.probe, f"{'actor' if actor else 'task'}-{os.getpid()}")
            if not os.path.exists(mark):
                open(mark, "w").close()
        return x if self.inner is None else self.inner(x)


def applied_in(probe) -> set:
    """The kinds of process that applied a :class:`RecordingTransform` (``{"task"}``: Ray Data's tasks only)."""
    return {name.split("-")[0] for name in os.listdir(probe)}


def assert_trained_the_loader_paths_steps(streamed, loaded: list) -> None:
    """The planned order of a split of one window is the loader path's sampler's: the same steps, so the same
    losses up to the order of the sums over the replicas."""
    for row, want in zip(streamed.history, loaded, strict=True):
        assert row["train_loss"] == pytest.approx(want["train_loss"], rel=1e-4), (streamed.history, loaded)


def assert_same_samples(data_cfg) -> int:
    loader_x, loader_y = sorted_samples(*loader_samples(data_cfg))
    ray_x, ray_y = sorted_samples(*ray_data_samples(data_cfg))
    assert ray_x.dtype == loader_x.dtype == torch.float32
    assert torch.equal(ray_y, loader_y) and torch.equal(ray_x, loader_x)  # bit-identical, every row once
    return len(loader_y)


def test_ray_data_samples_are_the_loader_paths_bit_for_bit(ray_session, tmp_path):
    write_png_parquet(tmp_path / "folders")
    cfg = rtm.TrainConfig(dataset="parquet", data_root=str(tmp_path / "folders"), ingest="ray_data")
    assert assert_same_samples(cfg.data) == 1438  # read_parquet of train/, PNG decoded in map_batches

    write_png_parquet(tmp_path / "one", split_folders=False)
    single = cfg.replace(data_root=str(tmp_path / "one" / "part-0.parquet"))
    assert assert_same_samples(single.data) == 719 - 719 // 10  # the 90/10 split's training rows only

    # `raytrain-mgpu data convert` output (raw bytes, train/ and test/) reads as the original digits.
    convert_to_parquet(rtm.TrainConfig(dataset="digits").data, str(tmp_path / "converted"), rows_per_file=500)
    converted = cfg.replace(data_root=f"file://{tmp_path / 'converted'}")
    digits_x, digits_y = sorted_samples(*loader_samples(rtm.TrainConfig(dataset="digits").data))
    ray_x, ray_y = sorted_samples(*ray_data_samples(converted.data))
    assert torch.equal(ray_y, digits_y) and torch.equal(ray_x, digits_x)


def test_fit_through_ray_data_with_random_crops_and_flips_on_2_workers_ends_with_one_loader_workers_weights(ray_session, tmp_path, storage):
    write_raw_parquet(tmp_path / "raw")
    common = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="parquet", data_root=str(tmp_path / "raw"),
                  batch_size=64, num_workers=2, use_gpu=False, epochs=2, optimizer="sgd", lr=0.1, storage_path=storage,
                  metrics=["accuracy", "test_ray_ingest:micro_batch_rows"])
    managers, probe = actors_started(ray_session, "DatasetManager"), tmp_path / "probe"
    probe.mkdir()
    crop_flip = build_transform("random_crop_flip", (1, 8, 8), "train_transform")[0]  # the package's recipe
    printed = io.StringIO()
    streamed = rtm.fit(rtm.TrainConfig(**common, ingest="ray_data", name="streamed",
                                       train_transform=RecordingTransform(str(probe), crop_flip)), stream=printed)
    # the banner says where Ray Data's tasks run: the shared instance's CPUs the 2 workers leave (no ingest node)
    assert re.search(r"^ingest: Ray Data's tasks on \d+ CPU beside the training processes' 2 ", printed.getvalue(),
                     re.M), printed.getvalue()
    # Each worker streams its own planned share: no dataset for Ray Train to split, no shard server; Ray
    # Data's tasks decoded and transformed every sample, the workers none.
    assert actors_started(ray_session, "DatasetManager") == managers
    assert applied_in(probe) == {"task"}
    # The same config through the loader on one worker (what a 2-worker fit trains: 2 x 32 = 1 x 64), the same
    # seeded crops and flips: the same steps, so the same weights and accuracy.
    (tmp_path / "probe-loader").mkdir()
    weights, loaded = loader_run({**common, "train_transform": RecordingTransform(str(tmp_path / "probe-loader"),
                                                                                  crop_flip)})
    assert_trained_the_loader_paths_steps(streamed, loaded)
    for key, value in streamed.load_model().state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=1e-4, atol=1e-4 * weights[key].abs().max().item())
    assert streamed.metrics["test_accuracy"] == pytest.approx(loaded[-1]["test_accuracy"], abs=1e-9)
    steps = 1438 // 2 // 32  # each worker's equal share of rows, in full micro-batches of 64 / 2
    assert [row["step"] for row in streamed.history] == [row["step"] for row in loaded] == [steps, 2 * steps]
    # Every micro-batch held exactly 32 samples: each step had the global batch of 64.
    assert [row["train_micro_batch_rows"] for row in streamed.history] == [32.0, 32.0]
    # A user's metric (this module's micro_batch_rows) is in the result and the history file, on both splits.
    rows = pq.read_table(f"{streamed.path}/history.parquet").to_pylist()
    assert 0 < streamed.metrics["test_micro_batch_rows"] <= 64
    assert [(row["train_micro_batch_rows"], row["test_micro_batch_rows"]) for row in rows][-1] == (
        streamed.metrics["train_micro_batch_rows"], streamed.metrics["test_micro_batch_rows"])
    # evaluated on the map-style test split (crops of up to 4 pixels off an 8 x 8 digit: far from learned in 2 epochs)
    assert streamed.metrics["test_accuracy"] > 0.1
    assert streamed.history[-1]["train_loss"] < streamed.history[0]["train_loss"]


def test_pipeline_first_stages_read_the_stream(ray_session, tmp_path, storage):
    write_raw_parquet(tmp_path / "raw")
    common = dict(model="mlp", model_kwargs={"widths": [32]}, dataset="parquet", data_root=str(tmp_path / "raw"),
                  batch_size=64, strategy="pipeline", num_stages=2, num_microbatches=2, epochs=2, optimizer="sgd",
                  lr=0.1, storage_path=storage,
                  use_gpu=False)  # 2 stage actors: 2 of the shared Ray's 4 CPUs left to Ray Data
    probe = tmp_path / "probe"
    probe.mkdir()
    streamed = rtm.fit(rtm.TrainConfig(**common, ingest="ray_data", name="pipe-streamed",
                                       train_transform=RecordingTransform(str(probe))))
    assert applied_in(probe) == {"task"}  # the first stage read the stream, decoded by Ray Data's tasks
    loaded = loader_history(common)  # one replica of 2 x 32 micro-batches trains what one rank of 64 does
    assert_trained_the_loader_paths_steps(streamed, loaded)
    steps = 1438 // 64  # one replica: the whole split (a streaming_split of 1) in batches of 64
    assert [row["step"] for row in streamed.history] == [row["step"] for row in loaded] == [steps, 2 * steps]
    assert streamed.metrics["test_accuracy"] > 0.85
    assert streamed.history[-1]["train_loss"] < streamed.history[0]["train_loss"]


class FakeShard:
    """A stand-in for a Ray Data shard: ``rows`` rows in batches, and what each call asked for."""

    def __init__(self, rows: int):
        self.rows, self.calls, self.read = rows, [], []

    def iter_torch_batches(self, batch_size, drop_last, **options):
        self.calls.append(options["local_shuffle_seed"])
        for start in range(0, self.rows - batch_size + 1 if drop_last else self.rows, batch_size):
            self.read.append(start)
            yield {"x": torch.full((batch_size, 1), float(start)), "y": torch.zeros(batch_size, dtype=torch.long)}


def test_shard_loader_gives_the_planned_batches_and_ends_each_stream():
    from raytrain_mgpu.engine.stream import ShardLoader

    shard = FakeShard(rows=100)  # 12 micro-batches of 8 (4 rows dropped)
    loader = ShardLoader(shard, micro_batch=8, num_batches=12, seed=3, rank=1)
    assert len(loader) == 12 and list(loader.sampler) == []  # the parquet reader gets nothing to prefetch
    assert [int(x[0, 0]) for x, _ in loader] == list(range(0, 96, 8))
    loader.sampler.set_epoch(1)
    batches = iter(loader)
    next(batches)  # an epoch that stops after one micro-batch (max_steps)
    shard.read.clear()
    assert sum(1 for _ in loader) == 12 and len(shard.read) == 23  # the 11 left over read off first, then 12
    assert len(set(shard.calls)) == 2  # each epoch its own shuffle seed
    short = ShardLoader(FakeShard(rows=40), micro_batch=8, num_batches=6, seed=0, rank=0)
    with pytest.raises(RuntimeError, match=r"rank 0's shard ended after 5 of 6 micro-batches of 8"):
        list(short)


def test_bad_combinations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"ingest='ray_data': Ray Data reads Parquet files, and dataset='digits' is "
                                         r"not 'parquet'\. Write it as Parquet \(`raytrain-mgpu data convert"):
        rtm.TrainConfig(dataset="digits", ingest="ray_data")
    # transforms and a validation split apply to the stream as to the loader (tests/test_stream_resume.py)
    rtm.TrainConfig(dataset="parquet", data_root="/data", ingest="ray_data", train_transform="random_crop_flip",
                    val_fraction=0.1)
    with pytest.raises(ValueError, match=r"ingest.*is not one of \['loader', 'ray_data'\]"):
        rtm.TrainConfig(ingest="ray")
    assert rtm.TrainConfig(dataset="parquet", data_root="/data", ingest="ray_data").data.ingest == "ray_data"


def test_a_run_that_leaves_ray_data_no_cpu_is_refused_before_any_bundle(caplog):
    """2 workers x 1 CPU on a 2-CPU machine: Ray Data's read task would wait for a CPU for ever."""
    from raytrain_mgpu.driver.cluster import Capacity, NodeType
    from raytrain_mgpu.transports.ray_data import check_cpus_left
    from raytrain_mgpu.strategies.plan import build_plan

    cfg = rtm.TrainConfig(dataset="parquet", data_root="/data", ingest="ray_data", num_workers=2, use_gpu=False)
    laptop = Capacity(alive=({"CPU": 2.0},))
    with pytest.raises(ValueError, match=r"ingest='ray_data': the training processes hold 2 of the cluster's 2 CPU "
                                         r"\(2 x 1\), so Ray Data's read and decode tasks would wait for a CPU for "
                                         r"ever\. Leave at least 1 CPU free: lower num_workers or cpus_per_worker"):
        check_cpus_left(cfg, build_plan(cfg), laptop)
    check_cpus_left(cfg.replace(num_workers=1), build_plan(cfg.replace(num_workers=1)), laptop)  # 1 left
    pipe = cfg.replace(strategy="pipeline", num_stages=2, num_microbatches=2, num_workers=1)
    with pytest.raises(ValueError, match=r"lower num_workers or num_stages or cpus_per_worker"):
        check_cpus_left(pipe, build_plan(pipe), laptop)
    check_cpus_left(cfg.replace(ingest="loader"), build_plan(cfg), laptop)  # the loader needs no spare CPU
    # An autoscaling cluster: judged by what its node types can add; where that is no CPU either, a warning
    # (the run waits for a node), since its node types can change under it.
    check_cpus_left(cfg, build_plan(cfg), Capacity(alive=({"CPU": 2.0},), node_types=(
        NodeType("cpu", {"CPU": 4.0}, 2),)))  # room once a CPU node is added: nothing said
    assert not caplog.records
    full = Capacity(alive=({"CPU": 2.0, "GPU": 1.0},), node_types=(NodeType("gpu", {"CPU": 2.0, "GPU": 1.0}, 1),))
    check_cpus_left(cfg, build_plan(cfg), full)
    assert "would wait for a CPU for ever" in caplog.text and "autoscales" in caplog.text


def test_footer_readers_follow_the_file_count_and_keep_a_users_value(monkeypatch):
    from raytrain_mgpu.transports.ray_data import FOOTER_ACTORS_ENV, footer_readers

    monkeypatch.delenv(FOOTER_ACTORS_ENV, raising=False)
    for files, actors in ((1, "1"), (3, "1"), (11, "2"), (310, "31")):
        with footer_readers(files):
            assert os.environ[FOOTER_ACTORS_ENV] == actors, files
        assert FOOTER_ACTORS_ENV not in os.environ  # only around the read
    with footer_readers(320):  # as many batches as Ray's pool: Ray's own choice
        assert FOOTER_ACTORS_ENV not in os.environ
    monkeypatch.setenv(FOOTER_ACTORS_ENV, "7")
    with footer_readers(3):
        assert os.environ[FOOTER_ACTORS_ENV] == "7"
