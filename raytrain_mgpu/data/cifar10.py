"""``cifar10``: the "CIFAR-10 python version" pickle batches.

Files ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` are looked for in
``data_root/cifar-10-batches-py/`` (where the archive and torchvision put them) and in
``data_root``. Each batch is a pickled dict with ``data`` (N x 3072 uint8, channel-major
32x32 planes) and ``labels``. With ``download=True`` missing files are fetched with
``torchvision.datasets.CIFAR10`` and read here.

Pickle can run code while loading, so batches are read with an unpickler that finds only
the few numpy and builtin names a real batch holds (arrays, their dtype, bytes): a planted
batch that names anything else (``os.system``, ...) is refused before it runs.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import TYPE_CHECKING

import numpy as np

from raytrain_mgpu.data.base import Datasets, ImageArrayDataset, PixelNormaliser, data_root_folder, find_or_download

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

logger = logging.getLogger(__name__)

INPUT_SHAPE, NUM_CLASSES = (3, 32, 32), 10
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
FOLDER = "cifar-10-batches-py"


def normaliser() -> PixelNormaliser:
    """Pixels 0..255; the train split's mean and std per channel (of pixels scaled to [0, 1])."""
    return PixelNormaliser(255, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), shape=INPUT_SHAPE)


def locate(cfg: "DataConfig") -> dict[str, str]:
    """Paths of the six batches; downloads them first when missing and ``download=True``."""
    root = data_root_folder(cfg, "the CIFAR-10 python batches")
    return find_or_download(cfg, "cifar10", "CIFAR10", root, [os.path.join(root, FOLDER), root], TRAIN_FILES + TEST_FILES,
                            allow_gz=False, download_hint="Get cifar-10-python.tar.gz from "
                                                          "https://www.cs.toronto.edu/~kriz/cifar.html and unpack it.")


def _corrupt(path: str, what: str) -> ValueError:
    return ValueError(f"{path}: {what}; this is not an intact CIFAR-10 python batch. Delete it and "
                      f"copy or download it again (the 'python version' archive).")


def check_batch_file(path: str) -> None:
    """Cheap sanity check without unpickling: a pickled dict starts with PROTO (0x80,
    protocol 2+; the official files) or MARK/EMPTY_DICT (protocol 0/1) and ends with STOP
    ('.'); a truncated file lacks the STOP."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        first = f.read(1)
        f.seek(max(size - 1, 0))
        last = f.read(1)
    if first not in (b"\x80", b"(", b"}"):
        raise _corrupt(path, f"does not start like a pickle (first byte {first!r}, expected b'\\x80')")
    if last != b".":
        raise _corrupt(path, "is truncated (no pickle STOP opcode at the end)")


# (module, name) a CIFAR-10 batch may reference: numpy arrays as pickled by Python 2 and by
# numpy 1.x/2.x (the module moved to numpy._core), and bytes as Python 3 pickles them in
# protocol 2. Python 2 module names are matched too: our find_class sees them unmapped.
_ALLOWED_GLOBALS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
})


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"it references {module}.{name}, which a CIFAR-10 batch never "
                                         f"holds; refused without running it")
        return super().find_class(module, name)


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 3, 32, 32) uint8, labels (N,) int64)`` of one batch file."""
    try:
        with open(path, "rb") as f:
            # The official files were pickled by Python 2: keys come back as bytes.
            batch = _BatchUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise _corrupt(path, f"cannot be unpickled ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict):
        raise _corrupt(path, f"holds a {type(batch).__name__}, not a dict")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        extra = " (CIFAR-100 has fine_labels: it is not CIFAR-10)" if "fine_labels" in batch else ""
        raise _corrupt(path, f"has keys {sorted(batch)}, needs 'data' and 'labels'{extra}")
    data, labels = np.asarray(batch["data"]), np.asarray(batch["labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise _corrupt(path, f"'data' is {data.dtype} {data.shape}, expected uint8 (N, 3072)")
    if labels.shape != (len(data),):
        raise _corrupt(path, f"{len(data)} images but labels of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise _corrupt(path, f"labels range {labels.min()}..{labels.max()}, expected 0..{NUM_CLASSES - 1}")
    return data.reshape(-1, *INPUT_SHAPE), labels


def _load(paths: dict[str, str], names: tuple) -> ImageArrayDataset:
    parts = [read_batch(paths[name]) for name in names]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return ImageArrayDataset(images, labels, normaliser())


def build(cfg: "DataConfig") -> Datasets:
    paths = locate(cfg)
    train, test = _load(paths, TRAIN_FILES), _load(paths, TEST_FILES)
    logger.debug("cifar10: %d train / %d test images from %s", len(train), len(test),
                 os.path.dirname(paths[TEST_FILES[0]]))
    return Datasets(train, test, INPUT_SHAPE, NUM_CLASSES)


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    """Files exist and look like complete pickles (downloads them first if allowed)."""
    for path in locate(cfg).values():
        check_batch_file(path)
    return INPUT_SHAPE, NUM_CLASSES
