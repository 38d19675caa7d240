"""Unit tests of the dataset readers, on tiny real-format files written to tmp_path.

No network and no Ray: downloads are simulated by monkeypatching torchvision's classes.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_mgpu.config.sections import DataConfig
from raytrain_mgpu.data import (DATASETS, Datasets, PixelNormaliser, build_datasets, check_data,
                                check_dataset_name, dataset_names)
from raytrain_mgpu.data import digits, fashion_mnist, parquet, synthetic
from raytrain_mgpu.data.convert import convert_to_parquet

# torchvision 0.29 deprecates its image codecs (for torchcodec); the parquet reader still
# uses decode_image, as specified, and these tests encode PNGs with it.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")

FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte")


def make_cfg(dataset: str = "digits", **changes) -> DataConfig:
    values = dict(dataset=dataset, data_root=None, download=False, num_samples=None, input_shape=None,
                  num_classes=None, image_column="image", label_column="label", seed=0)
    values.update(changes)
    return DataConfig(**values)


def items(dataset) -> tuple[torch.Tensor, list]:
    pairs = [dataset[i] for i in range(len(dataset))]
    return torch.stack([x for x, _ in pairs]), [int(y) for _, y in pairs]


# ----------------------------------------------------------------------------- writers


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def fashion_arrays(num_train: int = 5, num_test: int = 3) -> dict:
    rng = np.random.default_rng(1)
    return {"train-images-idx3-ubyte": rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
            "train-labels-idx1-ubyte": rng.integers(0, 10, num_train, dtype=np.uint8),
            "t10k-images-idx3-ubyte": rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
            "t10k-labels-idx1-ubyte": rng.integers(0, 10, num_test, dtype=np.uint8)}


def write_fashion(folder, arrays: dict, gz: bool, names=FASHION_FILES) -> None:
    os.makedirs(folder, exist_ok=True)
    for name in names:
        data = idx_bytes(arrays[name])
        if gz:
            with gzip.open(os.path.join(folder, name + ".gz"), "wb") as f:
                f.write(data)
        else:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)


def cifar_arrays() -> dict:
    rng = np.random.default_rng(2)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {name: (rng.integers(0, 256, (2, 3072), dtype=np.uint8), [int(v) for v in rng.integers(0, 10, 2)])
            for name in names}


def write_cifar(folder, arrays: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    for name, (data, labels) in arrays.items():
        with open(os.path.join(folder, name), "wb") as f:  # protocol 2 and bytes keys, like the release
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels}, f, protocol=2)


def write_table(path, columns: dict, metadata: dict | None = None, row_group_size: int = 1024) -> None:
    table = pa.table(columns)
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, str(path), row_group_size=row_group_size)


# ----------------------------------------------------------------------------- registry


def test_registry_names_and_unknown_name_lists_valid_ones():
    assert {"digits", "synthetic", "fashion_mnist", "cifar10", "parquet"} <= set(dataset_names())
    assert dataset_names() == sorted(DATASETS)
    check_dataset_name("digits")
    check_dataset_name("not_importable_anywhere:build")  # not imported here
    with pytest.raises(ValueError, match=r"dataset='mnist': unknown dataset\. Valid names: .*cifar10.*digits"):
        check_dataset_name("mnist")
    with pytest.raises(ValueError, match="unknown dataset"):
        build_datasets(make_cfg("mnist"))


def test_user_factory_is_imported_and_called(tmp_path, monkeypatch):
    (tmp_path / "my_data_ok.py").write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import TensorDataset
        from raytrain_mgpu.data import Datasets

        def build(cfg):
            data = TensorDataset(torch.zeros(4, 3), torch.arange(4))
            return Datasets(data, data, (3,), 4)

        def wrong(cfg):
            return (1, 2)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    built = build_datasets(make_cfg("my_data_ok:build"))
    assert isinstance(built, Datasets) and built.input_shape == (3,) and len(built.train) == 4
    assert check_data(make_cfg("my_data_ok:build")) == ((3,), 4)
    with pytest.raises(ValueError, match=r"returned tuple, not raytrain_mgpu\.data\.Datasets"):
        build_datasets(make_cfg("my_data_ok:wrong"))
    with pytest.raises(ValueError, match=r"module 'my_data_ok' has no function 'missing'"):
        build_datasets(make_cfg("my_data_ok:missing"))


def test_bad_factory_module_names_module_error_and_fix(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg\.data' \(ModuleNotFoundError: "
                                         r".*\)\. Run from the folder that holds no_such_pkg/data\.py, or install"):
        build_datasets(make_cfg("no_such_pkg.data:build"))


def test_factory_module_in_working_directory_is_found(monkeypatch, tmp_path):
    (tmp_path / "cwd_data_factory.py").write_text(
        "from raytrain_mgpu.data import synthetic\nbuild = synthetic.build\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert build_datasets(make_cfg("cwd_data_factory:build", num_samples=8)).input_shape == (1, 28, 28)


# ----------------------------------------------------------------------------- digits


def test_digits_shapes_split_and_normalisation():
    built = build_datasets(make_cfg("digits"))
    assert (built.input_shape, built.num_classes) == ((1, 8, 8), 10)
    assert (len(built.train), len(built.test)) == (1438, 359)
    x, y = built.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    pixels = built.train.images.astype(np.float64) / 16  # constants are the train split's stats
    assert pixels.mean() == pytest.approx(digits.MEAN[0], abs=1e-3)
    assert pixels.std() == pytest.approx(digits.STD[0], abs=1e-3)
    assert check_data(make_cfg("digits")) == ((1, 8, 8), 10)


def test_digits_are_scikit_learns_rows_read_without_importing_it():
    """The loader reads scikit-learn's bundled file itself (a training process saves the import):
    the same images and labels as ``load_digits()``, in its order, and scikit-learn stays unimported."""
    code = ("import sys\nfrom raytrain_mgpu.data import digits\nsplit = digits.load_split()\n"
            "assert 'sklearn' not in sys.modules, 'sklearn imported'\n"
            "from sklearn.datasets import load_digits\nimport numpy as np\nbunch = load_digits()\n"
            "images = bunch.images.astype(np.uint8).reshape(-1, 1, 8, 8)\n"
            "order = np.random.default_rng(digits.SPLIT_SEED).permutation(len(bunch.target))\n"
            "train, test = order[:1438], order[1438:]\n"
            "want = (images[train], bunch.target[train], images[test], bunch.target[test])\n"
            "assert all(np.array_equal(a, b) for a, b in zip(split, want))\n"
            "assert split[1].dtype == np.int64 and split[0].dtype == np.uint8\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_digits_split_is_fixed_and_independent_of_seed():
    first, other_seed = build_datasets(make_cfg("digits", seed=0)), build_datasets(make_cfg("digits", seed=7))
    assert np.array_equal(first.test.images, other_seed.test.images)
    assert np.array_equal(first.train.labels, other_seed.train.labels)
    assert set(np.unique(first.test.labels)) == set(range(10))


def test_image_array_dataset_batch_fetch_equals_items():
    built = build_datasets(make_cfg("digits"))
    batch = built.train.__getitems__([3, 0, 3])
    for (x, y), index in zip(batch, [3, 0, 3]):
        assert torch.equal(x, built.train[index][0]) and y == built.train[index][1]


def test_pixel_normaliser_per_channel_and_mismatch():
    norm = PixelNormaliser(255, (0.0, 0.5, 1.0), (1.0, 0.5, 1.0), (3, 1, 1))
    out = norm(torch.full((3, 1, 1), 255, dtype=torch.uint8))
    assert out.flatten().tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="normalisation has 3 values but samples of shape"):
        PixelNormaliser(255, (0.1, 0.2, 0.3), (1, 1, 1), (1, 28, 28))


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_determinism_and_learnable():
    cfg = make_cfg("synthetic", num_samples=400, input_shape=(3, 4, 4), num_classes=5, seed=3)
    built = build_datasets(cfg)
    assert (built.input_shape, built.num_classes, len(built.train), len(built.test)) == ((3, 4, 4), 5, 400, 100)
    x_train, y_train = items(built.train)
    again_x, again_y = items(build_datasets(cfg).train)
    assert torch.equal(x_train, again_x) and y_train == again_y
    # Items are computed from (seed, index), not drawn from a shared RNG: reading others in
    # between does not change item 7.
    seventh = built.train[7][0]
    built.train[3], built.train[8]
    assert torch.equal(built.train[7][0], seventh) and torch.equal(seventh, x_train[7])
    other = build_datasets(make_cfg("synthetic", num_samples=400, input_shape=(3, 4, 4), num_classes=5, seed=4))
    assert not torch.equal(other.train[0][0], built.train[0][0])
    # learnable: nearest class mean of the train split classifies the test split
    y_train = torch.tensor(y_train)
    means = torch.stack([x_train[y_train == c].mean(0) for c in range(5)]).flatten(1)
    x_test, y_test = items(built.test)
    predicted = torch.cdist(x_test.flatten(1), means).argmin(1)
    assert (predicted == torch.tensor(y_test)).float().mean() > 0.9
    assert check_data(cfg) == ((3, 4, 4), 5)


def test_synthetic_defaults_and_lazy_prototypes(monkeypatch):
    built = build_datasets(make_cfg("synthetic", num_samples=8))
    assert built.input_shape == (1, 28, 28) and built.num_classes == 10 and len(built.test) == 2
    monkeypatch.setattr(synthetic, "MAX_PRECOMPUTED_PROTOTYPE_ELEMENTS", 0)
    lazy = build_datasets(make_cfg("synthetic", num_samples=8))
    assert lazy.train._prototypes is None
    assert torch.equal(lazy.train[5][0], built.train[5][0])
    with pytest.raises(ValueError, match="num_samples=2: synthetic needs at least 4"):
        build_datasets(make_cfg("synthetic", num_samples=2))


# ----------------------------------------------------------------------------- fashion_mnist


@pytest.mark.parametrize("gz, layout", [(True, ""), (False, ""), (True, "FashionMNIST/raw"),
                                        (False, "FashionMNIST/raw")])
def test_fashion_mnist_reads_idx_gz_and_raw_in_both_layouts(tmp_path, gz, layout):
    arrays = fashion_arrays()
    write_fashion(tmp_path / layout, arrays, gz=gz)
    cfg = make_cfg("fashion_mnist", data_root=str(tmp_path))
    assert check_data(cfg) == ((1, 28, 28), 10)
    built = build_datasets(cfg)
    assert (len(built.train), len(built.test), built.input_shape) == (5, 3, (1, 28, 28))
    x, y = items(built.test)
    expected = (torch.from_numpy(arrays["t10k-images-idx3-ubyte"]).float() / 255 - 0.2860) / 0.3530
    assert torch.allclose(x[:, 0], expected, atol=1e-6)
    assert y == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_fashion_mnist_missing_files_lists_names_and_folders(tmp_path):
    write_fashion(tmp_path, fashion_arrays(), gz=True, names=FASHION_FILES[:2])
    with pytest.raises(ValueError) as error:
        check_data(make_cfg("fashion_mnist", data_root=str(tmp_path)))
    message = str(error.value)
    assert "missing file(s) t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz];" in message
    assert "train-images" not in message.split("searched")[0]
    assert f"{tmp_path}, {tmp_path / 'FashionMNIST' / 'raw'}" in message
    assert "download=True" in message


def test_fashion_mnist_needs_data_root():
    with pytest.raises(ValueError, match=r"data_root=None: dataset 'fashion_mnist' reads .* Set data_root"):
        check_data(make_cfg("fashion_mnist"))


def test_fashion_mnist_truncated_files(tmp_path):
    write_fashion(tmp_path, fashion_arrays(), gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    cfg = make_cfg("fashion_mnist", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: truncated: the header says \(5, 28, 28\)"):
        check_data(cfg)
    with pytest.raises(ValueError, match="truncated"):
        build_datasets(cfg)
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="too short for an IDX header"):
        check_data(cfg)


def test_fashion_mnist_truncated_gzip(tmp_path):
    write_fashion(tmp_path, fashion_arrays(), gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-30])
    cfg = make_cfg("fashion_mnist", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: cannot be decompressed .* truncated"):
        check_data(cfg)
    with pytest.raises(ValueError, match="cannot be decompressed"):
        build_datasets(cfg)


def test_fashion_mnist_wrong_magic_and_mislabelled_gzip(tmp_path):
    arrays = fashion_arrays()
    write_fashion(tmp_path, arrays, gz=False)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(arrays["train-images-idx3-ubyte"]))  # an image file in the label's place
    cfg = make_cfg("fashion_mnist", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte: wrong magic number 0x00000803, "
                                         r"expected 0x00000801"):
        check_data(cfg)
    labels.write_bytes(gzip.compress(idx_bytes(arrays["train-labels-idx1-ubyte"])))
    with pytest.raises(ValueError, match="gzip-compressed but its name does not end in .gz"):
        build_datasets(cfg)


def test_fashion_mnist_count_mismatch(tmp_path):
    arrays = fashion_arrays()
    arrays["train-labels-idx1-ubyte"] = arrays["train-labels-idx1-ubyte"][:4]
    write_fashion(tmp_path, arrays, gz=True)
    with pytest.raises(ValueError, match="holds 5 images but .* holds 4 labels"):
        check_data(make_cfg("fashion_mnist", data_root=str(tmp_path)))


# ----------------------------------------------------------------------------- downloads


def test_download_offline_gives_clear_error(tmp_path, monkeypatch):
    import torchvision.datasets

    class Offline:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Error downloading train-images-idx3-ubyte.gz: [Errno -3] name resolution")

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", Offline)
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", Offline)
    for name in ("fashion_mnist", "cifar10"):
        with pytest.raises(ValueError, match=rf"{name}: download into .* failed \(RuntimeError: Error downloading"
                                             r".*The machine may be offline\. Put the files by hand into"):
            check_data(make_cfg(name, data_root=str(tmp_path / name), download=True))


def test_download_then_read_with_our_reader(tmp_path, monkeypatch):
    import torchvision.datasets

    arrays = fashion_arrays()

    class FakeFashionMNIST:  # writes what torchvision would, where it would
        def __init__(self, root, train=True, download=False):
            write_fashion(os.path.join(root, "FashionMNIST", "raw"), arrays, gz=True)

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", FakeFashionMNIST)
    cfg = make_cfg("fashion_mnist", data_root=str(tmp_path), download=True)
    assert check_data(cfg) == ((1, 28, 28), 10)
    assert items(build_datasets(cfg).train)[1] == arrays["train-labels-idx1-ubyte"].tolist()


# ----------------------------------------------------------------------------- cifar10


@pytest.mark.parametrize("layout", ["cifar-10-batches-py", ""])
def test_cifar10_reads_pickle_batches(tmp_path, layout):
    arrays = cifar_arrays()
    write_cifar(tmp_path / layout, arrays)
    cfg = make_cfg("cifar10", data_root=str(tmp_path))
    assert check_data(cfg) == ((3, 32, 32), 10)
    built = build_datasets(cfg)
    assert (len(built.train), len(built.test), built.input_shape) == (10, 2, (3, 32, 32))
    x, y = built.test[1]
    data, labels = arrays["test_batch"]
    green = torch.from_numpy(data[1, 1024:2048].reshape(32, 32)).float()  # planes are R, G, B
    assert torch.allclose(x[1], (green / 255 - 0.4822) / 0.2435, atol=1e-6)
    assert y == labels[1]
    assert items(built.train)[1] == [v for i in range(1, 6) for v in arrays[f"data_batch_{i}"][1]]


def test_cifar10_missing_and_corrupt_batches(tmp_path):
    arrays = cifar_arrays()
    del arrays["data_batch_3"]
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar(folder, arrays)
    cfg = make_cfg("cifar10", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=rf"missing file\(s\) data_batch_3; searched folder\(s\) {folder}, "
                                         rf"{tmp_path}\. .*download=True"):
        check_data(cfg)
    write_cifar(folder, {"data_batch_3": cifar_arrays()["data_batch_3"]})
    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:-50])
    with pytest.raises(ValueError, match=r"data_batch_2: is truncated .*not an intact CIFAR-10 python batch"):
        check_data(cfg)
    with pytest.raises(ValueError, match=r"data_batch_2: cannot be unpickled"):
        build_datasets(cfg)
    with open(batch, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [0, 1]}, f, protocol=2)
    with pytest.raises(ValueError, match=r"needs 'data' and 'labels' \(CIFAR-100 has fine_labels"):
        build_datasets(cfg)


# ----------------------------------------------------------------------------- parquet


def test_convert_round_trip_digits(tmp_path):
    out = tmp_path / "digits_pq"
    paths = convert_to_parquet(make_cfg("digits"), str(out), rows_per_file=500, row_group_size=128)
    assert [os.path.relpath(p, out) for p in paths] == ["train/part-00000.parquet", "train/part-00001.parquet",
                                                        "train/part-00002.parquet", "test/part-00000.parquet"]
    source, copy = build_datasets(make_cfg("digits")), build_datasets(make_cfg("parquet", data_root=str(out)))
    assert (copy.input_shape, copy.num_classes, len(copy.train), len(copy.test)) == ((1, 8, 8), 10, 1438, 359)
    for split in ("train", "test"):
        x_source, y_source = items(getattr(source, split))
        x_copy, y_copy = items(getattr(copy, split))
        assert torch.equal(x_source, x_copy) and y_source == y_copy  # bit-identical normalisation
    meta = pq.read_schema(paths[0]).metadata
    assert meta[b"raytrain_mgpu.shape"] == b"1,8,8" and meta[b"raytrain_mgpu.max_value"] == b"16.0"


@pytest.mark.parametrize("name", ["fashion_mnist", "cifar10"])
def test_convert_round_trip_files_to_file_uri(tmp_path, name):
    if name == "fashion_mnist":
        write_fashion(tmp_path / "src", fashion_arrays(), gz=True)
    else:
        write_cifar(tmp_path / "src", cifar_arrays())
    cfg = make_cfg(name, data_root=str(tmp_path / "src"))
    uri = f"file://{tmp_path}/out"
    paths = convert_to_parquet(cfg, uri, rows_per_file=4, row_group_size=2)
    assert paths[0] == f"{uri}/train/part-00000.parquet"
    source, copy = build_datasets(cfg), build_datasets(make_cfg("parquet", data_root=uri))
    assert copy.input_shape == source.input_shape
    for split in ("train", "test"):
        assert torch.equal(items(getattr(source, split))[0], items(getattr(copy, split))[0])
        assert items(getattr(source, split))[1] == items(getattr(copy, split))[1]
    assert check_data(make_cfg("parquet", data_root=uri)) == (source.input_shape, 10)


def test_convert_refuses_token_datasets(tmp_path, monkeypatch):
    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return torch.zeros(4, dtype=torch.long), 0

    monkeypatch.setitem(DATASETS, "tokens", lambda cfg: Datasets(Tokens(), Tokens(), (4,), 2))
    with pytest.raises(ValueError, match="dataset='tokens': samples are torch.int64, convert writes images"):
        convert_to_parquet(make_cfg("tokens"), str(tmp_path / "out"))


def test_convert_synthetic_as_float_lists_and_refuses_non_empty_out(tmp_path):
    cfg = make_cfg("synthetic", num_samples=40, input_shape=(2, 3), num_classes=3)
    convert_to_parquet(cfg, str(tmp_path / "out"))
    source, copy = build_datasets(cfg), build_datasets(make_cfg("parquet", data_root=str(tmp_path / "out")))
    assert copy.input_shape == (2, 3) and copy.num_classes == 3
    assert torch.equal(items(source.test)[0], items(copy.test)[0])
    with pytest.raises(ValueError, match=r"already holds 2 entries .* Choose a new folder or delete it"):
        convert_to_parquet(cfg, str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"convert rows_per_file=0: must be a positive integer"):
        convert_to_parquet(cfg, str(tmp_path / "other"), rows_per_file=0)


def png_images(num: int, channels: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (channels, 5, 6), dtype=torch.uint8, generator=generator) for _ in range(num)]


@pytest.mark.parametrize("channels, as_struct", [(1, False), (3, False), (3, True)])
def test_parquet_png_bytes_and_hugging_face_struct(tmp_path, channels, as_struct):
    from torchvision.io import encode_png

    images = png_images(20, channels)
    encoded = [encode_png(image).numpy().tobytes() for image in images]
    column = [{"bytes": b, "path": None} for b in encoded] if as_struct else encoded
    write_table(tmp_path / "data.parquet", {"img": column, "y": list(range(20))}, row_group_size=8)
    built = build_datasets(make_cfg("parquet", data_root=str(tmp_path / "data.parquet"), image_column="img",
                                    label_column="y"))
    assert (built.input_shape, built.num_classes) == ((channels, 5, 6), 20)
    assert [int(y) for _, y in [built.test[i] for i in range(len(built.test))]] == [9, 19]  # rows % 10 == 9
    assert len(built.train) == 18
    x, y = built.train[10]  # train row 10 is global row 11
    assert y == 11 and torch.allclose(x, (images[11].float() / 255 - 0.5) / 0.5)


def test_parquet_list_columns_with_shape_metadata(tmp_path):
    values = np.arange(24, dtype=np.uint8).reshape(4, 6)
    meta = {b"raytrain_mgpu.shape": b"1,2,3", b"raytrain_mgpu.num_classes": b"7"}
    (tmp_path / "ints").mkdir()
    write_table(tmp_path / "ints" / "train.parquet", {"image": pa.array(values.tolist(), pa.list_(pa.uint8())),
                                                      "label": [0, 1, 2, 3]}, meta)
    write_table(tmp_path / "ints" / "test.parquet", {"image": pa.array(values[:1].tolist(), pa.list_(pa.uint8())),
                                                     "label": [6]}, meta)
    built = build_datasets(make_cfg("parquet", data_root=str(tmp_path / "ints")))
    assert (len(built.train), len(built.test), built.num_classes) == (4, 1, 7)
    assert torch.allclose(built.train[2][0], (torch.arange(12, 18).float().reshape(1, 2, 3) / 255 - 0.5) / 0.5)
    floats = {b"raytrain_mgpu.shape": b"6", b"raytrain_mgpu.mean": b"0.0", b"raytrain_mgpu.std": b"1.0"}
    write_table(tmp_path / "floats.parquet", {"image": pa.array((values / 10.0).tolist(), pa.list_(pa.float32())),
                                              "label": [0, 1, 0, 1]}, floats)
    built = build_datasets(make_cfg("parquet", data_root=str(tmp_path / "floats.parquet")))
    assert built.input_shape == (6,) and torch.allclose(built.train[0][0], torch.arange(6) / 10.0)


def test_parquet_split_files_on_top_level(tmp_path):
    meta = {b"raytrain_mgpu.shape": b"1,1,2"}
    write_table(tmp_path / "train-0.parquet", {"image": [b"\x00\x01"] * 3, "label": [0, 1, 2]}, meta)
    write_table(tmp_path / "test-0.parquet", {"image": [b"\x02\x03"], "label": [4]}, meta)
    built = build_datasets(make_cfg("parquet", data_root=str(tmp_path)))
    assert (len(built.train), len(built.test), built.num_classes) == (3, 1, 5)


def many_row_groups(path, num_rows: int = 100, row_group_size: int = 10) -> np.ndarray:
    pixels = np.arange(num_rows * 4, dtype=np.int64).reshape(num_rows, 4) % 256
    write_table(path, {"image": [row.astype(np.uint8).tobytes() for row in pixels], "label": list(range(num_rows))},
                {b"raytrain_mgpu.shape": b"1,2,2"}, row_group_size=row_group_size)
    return pixels.astype(np.uint8)


def test_parquet_lru_reads_one_row_group_per_item(tmp_path):
    pixels = many_row_groups(tmp_path / "rg.parquet")
    train = build_datasets(make_cfg("parquet", data_root=str(tmp_path / "rg.parquet"))).train
    assert len(train.table.row_group_keys) == 10
    x, y = train[0]
    assert train.row_groups_read == 1 and len(train._cache) == 1
    assert torch.equal(x, (torch.from_numpy(pixels[0]).float().reshape(1, 2, 2) / 255 - 0.5) / 0.5)
    for index in range(8):  # rows 0..8 are all in row group 0
        train[index]
    assert train.row_groups_read == 1
    for index in range(0, len(train), 3):
        train[index]
    assert len(train._cache) <= train.cache_row_groups and train.row_groups_read == 10
    assert int(train[-1][1]) == 98


def test_parquet_prefetch_reads_each_needed_row_group_once(tmp_path, monkeypatch):
    many_row_groups(tmp_path / "rg.parquet")
    train = build_datasets(make_cfg("parquet", data_root=str(tmp_path / "rg.parquet"))).train
    expected = {i: train[i] for i in (0, 5, 40, 41, 89)}
    reads = []
    read = parquet.ParquetTable.read_row_group
    monkeypatch.setattr(parquet.ParquetTable, "read_row_group",
                        lambda self, group, offsets=None: reads.append(group) or read(self, group, offsets))
    train._cache.clear()
    train.prefetch([89, 40, 0, 5, 41, 5])
    assert sorted(reads) == [0, 4, 9]  # rows 0/5 -> group 0, 44/45 -> group 4, 98 -> group 9
    before = train.row_groups_read
    for index, (x, y) in expected.items():
        assert torch.equal(train[index][0], x) and train[index][1] == y
    assert train.row_groups_read == before and len(train._prefetched) == 5
    restored = pickle.loads(pickle.dumps(train))
    assert restored._prefetched is None and torch.equal(restored[40][0], expected[40][0])
    train.prefetch([])
    assert train._prefetched is None


def test_parquet_errors_name_the_problem_and_the_fix(tmp_path):
    write_table(tmp_path / "raw.parquet", {"pixels": [b"\x00" * 4], "label": [0]})
    cfg = make_cfg("parquet", data_root=str(tmp_path / "raw.parquet"))
    with pytest.raises(ValueError, match=r"no column 'image' \(TrainConfig.image_column\); columns are "
                                         r"\['pixels', 'label'\]\. Set image_column"):
        check_data(cfg)
    with pytest.raises(ValueError, match=r"row 0 of 'pixels' is neither raw pixels .* nor a PNG/JPEG image"):
        check_data(make_cfg("parquet", data_root=str(tmp_path / "raw.parquet"), image_column="pixels"))
    write_table(tmp_path / "list.parquet", {"image": [[1, 2]], "label": [0]})
    with pytest.raises(ValueError, match=r"holds lists of pixels but the schema metadata has no "
                                         r"b'raytrain_mgpu.shape'"):
        check_data(make_cfg("parquet", data_root=str(tmp_path / "list.parquet")))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk\.parquet: cannot be read .* intact Parquet"):
        check_data(make_cfg("parquet", data_root=str(tmp_path / "junk.parquet")))
    with pytest.raises(ValueError, match=r"data_root='.*nowhere': no such file or folder"):
        check_data(make_cfg("parquet", data_root=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="data_root=None: dataset 'parquet' needs"):
        check_data(make_cfg("parquet"))


def test_driver_checks_read_headers_not_data(tmp_path, monkeypatch):
    write_fashion(tmp_path / "fashion", fashion_arrays(), gz=True)
    convert_to_parquet(make_cfg("digits"), str(tmp_path / "pq"))

    def fail(*args, **kwargs):
        raise AssertionError("check_data read image data")

    monkeypatch.setattr(fashion_mnist, "_read_all", fail)
    monkeypatch.setattr(parquet.ParquetTable, "read_row_group", fail)
    assert check_data(make_cfg("fashion_mnist", data_root=str(tmp_path / "fashion"))) == ((1, 28, 28), 10)
    assert check_data(make_cfg("parquet", data_root=str(tmp_path / "pq"))) == ((1, 8, 8), 10)


# ----------------------------------------------------------------------------- validation split


def test_val_fraction_holds_out_a_seeded_part_of_the_training_split_before_any_sharding():
    import raytrain_mgpu as rtm
    from raytrain_mgpu.driver.preflight import train_split_size

    cfg = rtm.TrainConfig(dataset="digits", val_fraction=0.2, train_transform="random_crop_flip", monitor="val_loss")
    built, again = build_datasets(cfg.data), build_datasets(cfg.data)
    whole = len(build_datasets(rtm.TrainConfig(dataset="digits").data).train)
    train, val = built.train.dataset, built.val  # the training split under its augmentation
    assert len(val) == round(0.2 * whole) and len(train) + len(val) == whole
    assert sorted(train.indices + val.indices) == list(range(whole))  # disjoint, together the whole split
    assert val.indices == again.val.indices and train.indices == again.train.dataset.indices  # the seed decides
    assert val.indices != build_datasets(cfg.replace(seed=1).data).val.indices
    assert train_split_size(cfg.data) == len(train)  # the plan's steps count the training part only
    # validation is evaluated, never augmented: its samples are the reader's own
    x, y = val[0]
    raw_x, raw_y = build_datasets(rtm.TrainConfig(dataset="digits").data).train[val.indices[0]]
    assert torch.equal(x, raw_x) and y == raw_y


def test_a_held_out_splits_rows_reach_the_readers_prefetch_as_the_readers_rows():
    from torch.utils.data import Subset

    from raytrain_mgpu.engine.loaders import prefetch

    class Reader:
        asked = None

        def __len__(self):
            return 10

        def prefetch(self, rows):
            Reader.asked = rows

    prefetch(Subset(Reader(), [1, 4, 6, 9]), [0, 2, 3])
    assert Reader.asked == [1, 6, 9]


@pytest.mark.parametrize("fields, error", [
    (dict(val_fraction=1.0), r"val_fraction=1.0: must be a finite number in \(0, 1\)"),
    (dict(val_fraction=0.1, monitor="test_loss"),
     r"monitor='test_loss': ranks epochs on the test split, while val_fraction=0.1 .* Set monitor='val_loss'"),
    (dict(monitor="val_loss"), r"monitor='val_loss': is not a history key of this run \(train_loss, train_accuracy, "
                               r"test_loss, test_accuracy\)"),
])
def test_validation_settings_that_cannot_work_are_refused_with_the_fix(fields, error):
    import raytrain_mgpu as rtm

    with pytest.raises(ValueError, match=error):
        rtm.TrainConfig(**fields)
