"""``fashion_mnist``: the four standard IDX files, gzipped or not, read with numpy.

Files are looked for in ``data_root`` and in torchvision's layout
``data_root/FashionMNIST/raw/``. With ``download=True`` missing files are fetched with
``torchvision.datasets.FashionMNIST`` and then read by the reader here, so downloaded and
hand-copied files give identical tensors.

IDX format: a 4-byte magic ``0x00 0x00 <type> <ndim>`` (type 0x08 = unsigned byte), then
``ndim`` big-endian uint32 sizes, then the data. The driver-side check reads only the
headers and the file sizes (for ``.gz`` the size recorded in the gzip trailer).
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import struct
from typing import TYPE_CHECKING

import numpy as np

from raytrain_mgpu.data.base import Datasets, ImageArrayDataset, PixelNormaliser, data_root_folder, find_or_download

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

logger = logging.getLogger(__name__)

INPUT_SHAPE, NUM_CLASSES = (1, 28, 28), 10
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_IDX_UBYTE = 0x08


def normaliser() -> PixelNormaliser:
    """Pixels 0..255; the train split's mean and std (of pixels scaled to [0, 1])."""
    return PixelNormaliser(255, mean=(0.2860,), std=(0.3530,), shape=INPUT_SHAPE)


# ----------------------------------------------------------------------------- IDX


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _parse_header(path: str, head: bytes, ndim: int) -> tuple:
    size = 4 + 4 * ndim
    if head[:2] == b"\x1f\x8b":
        raise ValueError(f"{path}: the file is gzip-compressed but its name does not end in .gz. "
                         f"Rename it to {os.path.basename(path)}.gz.")
    if len(head) < size:
        raise ValueError(f"{path}: only {len(head)} bytes, too short for an IDX header with {ndim} "
                         f"dimension(s) ({size} bytes); the file is truncated or not an IDX file. "
                         f"Delete it and copy or download it again.")
    magic, expected = int.from_bytes(head[:4], "big"), (_IDX_UBYTE << 8) | ndim
    if magic != expected:
        raise ValueError(f"{path}: wrong magic number 0x{magic:08x}, expected 0x{expected:08x} (IDX of "
                         f"unsigned bytes with {ndim} dimension(s)); this is not a Fashion-MNIST "
                         f"{'image' if ndim == 3 else 'label'} file. Copy the right file into place.")
    return struct.unpack(f">{ndim}I", head[4:size])


def _check_size(path: str, dims: tuple, num_bytes: int) -> None:
    expected = math.prod(dims)
    if num_bytes < expected:
        raise ValueError(f"{path}: truncated: the header says {dims} ({expected} data bytes) but the file "
                         f"holds {num_bytes}. Delete it and copy or download it again.")
    if num_bytes > expected:
        raise ValueError(f"{path}: {num_bytes - expected} bytes more than its header {dims} describes; "
                         f"this is not a valid IDX file. Copy or download it again.")


def _read_all(path: str) -> bytearray:
    try:
        with _open(path) as f:
            return bytearray(f.read())  # writable, so torch.from_numpy can share it
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot be decompressed ({exc}); the file is truncated or corrupt. "
                         f"Delete it and copy or download it again.") from exc


def read_idx_header(path: str, ndim: int) -> tuple:
    """Dimensions from the header, after checking the data size; reads no data.

    For ``.gz`` files the size comes from the gzip trailer (uncompressed size mod 2**32);
    only when it disagrees is the file decompressed, to report exactly what is wrong.
    """
    try:
        with _open(path) as f:
            dims = _parse_header(path, f.read(4 + 4 * ndim), ndim)
    except (OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot be decompressed ({exc}); the file is truncated or corrupt. "
                         f"Delete it and copy or download it again.") from exc
    header_size = 4 + 4 * ndim
    if not path.endswith(".gz"):
        _check_size(path, dims, os.path.getsize(path) - header_size)
        return dims
    with open(path, "rb") as f:
        f.seek(max(os.path.getsize(path) - 4, 0))
        trailer_size = int.from_bytes(f.read(4), "little")
    if trailer_size != (header_size + math.prod(dims)) % 2**32:
        _check_size(path, dims, len(_read_all(path)) - header_size)
    return dims


def read_idx(path: str, ndim: int) -> np.ndarray:
    """The whole file as a uint8 array of the header's shape."""
    data = _read_all(path)
    dims = _parse_header(path, bytes(data[:4 + 4 * ndim]), ndim)
    _check_size(path, dims, len(data) - (4 + 4 * ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


# ----------------------------------------------------------------------------- dataset


def locate(cfg: "DataConfig") -> dict[str, str]:
    """Paths of the four files; downloads them first when missing and ``download=True``."""
    root = data_root_folder(cfg, "the four Fashion-MNIST IDX files")
    return find_or_download(cfg, "fashion_mnist", "FashionMNIST", root,
                            [root, os.path.join(root, "FashionMNIST", "raw")],
                            [name for pair in FILES.values() for name in pair], allow_gz=True,
                            download_hint="Get them from https://github.com/zalandoresearch/fashion-mnist.")


def _check_pair(images: str, labels: str, image_dims: tuple, label_dims: tuple) -> None:
    if tuple(image_dims[1:]) != INPUT_SHAPE[1:]:
        raise ValueError(f"{images}: images are {tuple(image_dims[1:])}, Fashion-MNIST images are "
                         f"{INPUT_SHAPE[1:]}. Copy the Fashion-MNIST file into place.")
    if image_dims[0] != label_dims[0]:
        raise ValueError(f"{images} holds {image_dims[0]} images but {labels} holds {label_dims[0]} "
                         f"labels; they must match. Copy both files from the same release.")


def load_split(paths: dict[str, str], split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 1, 28, 28) uint8, labels (N,) int64)`` of one split."""
    image_name, label_name = FILES[split]
    images, labels = read_idx(paths[image_name], 3), read_idx(paths[label_name], 1)
    _check_pair(paths[image_name], paths[label_name], images.shape, labels.shape)
    if labels.size and labels.max() >= NUM_CLASSES:
        raise ValueError(f"{paths[label_name]}: label {int(labels.max())} is not in 0..{NUM_CLASSES - 1}; "
                         f"this is not a Fashion-MNIST label file. Copy the right file into place.")
    return images.reshape(-1, *INPUT_SHAPE), labels.astype(np.int64)


def build(cfg: "DataConfig") -> Datasets:
    paths = locate(cfg)
    norm = normaliser()
    splits = {split: ImageArrayDataset(*load_split(paths, split), norm) for split in FILES}
    logger.debug("fashion_mnist: %d train / %d test images from %s", len(splits["train"]),
                 len(splits["test"]), os.path.dirname(paths[FILES["train"][0]]))
    return Datasets(splits["train"], splits["test"], INPUT_SHAPE, NUM_CLASSES)


def check(cfg: "DataConfig") -> tuple[tuple, int]:
    """Headers and sizes of the four files (downloads them first if allowed)."""
    paths = locate(cfg)
    for image_name, label_name in FILES.values():
        _check_pair(paths[image_name], paths[label_name], read_idx_header(paths[image_name], 3),
                    read_idx_header(paths[label_name], 1))
    return INPUT_SHAPE, NUM_CLASSES
