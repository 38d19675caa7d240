"""Text datasets for causal language models: ``synthetic_text`` and ``text_file``.

An item is ``(x, y)``: two ``int64`` tensors of ``seq_len`` token ids, ``y`` being ``x``
shifted by one (next-token targets), so ``F.cross_entropy(model(x), y)`` with the
``(batch, vocab, seq)`` logits of ``transformer_lm`` is the causal-LM loss.

- ``synthetic_text``: token streams from a fixed random Markov chain. Every token has one
  favoured successor (taken with probability ``FOLLOW_PROB``) and ``NUM_ALTERNATIVES``
  others, so a model can learn it: the best possible token accuracy is about
  ``FOLLOW_PROB`` (0.75), chance is ``1 / vocab``. Deterministic in ``cfg.seed``;
  ``cfg.input_shape = (seq_len,)``, ``cfg.num_classes`` = vocabulary size,
  ``cfg.num_samples`` = training sequences (the test split is a quarter of it).
- ``text_file``: ``cfg.data_root`` is a local text file, tokenised as bytes (vocabulary
  256) and cut into non-overlapping windows of ``seq_len + 1`` bytes; the last tenth of
  the windows is the test split (a contiguous tail, so no test text is seen in training).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_mgpu.data.base import Datasets, generated_sizes

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

DEFAULT_SEQ_LEN = 128
DEFAULT_VOCAB_SIZE = 30522  # BERT's WordPiece vocabulary, as in the seed article
DEFAULT_NUM_SAMPLES = 2048
FOLLOW_PROB = 0.75
NUM_ALTERNATIVES = 3
BYTE_VOCAB_SIZE = 256
TEST_FRACTION = 0.1
_TRAIN, _TEST = 0, 1


class TokenWindows(Dataset):
    """Rows of a ``(N, seq_len + 1)`` token array; item i is ``(row[:-1], row[1:])``.

    Tokens are held as ``int32`` (half of ``int64``) and widened per item.
    """

    def __init__(self, tokens: np.ndarray):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        row = torch.from_numpy(self.tokens[index].astype(np.int64))
        return row[:-1], row[1:]


def _seq_len(cfg: "DataConfig") -> int:
    if cfg.input_shape is None:
        return DEFAULT_SEQ_LEN
    if len(cfg.input_shape) != 1:
        raise ValueError(f"TrainConfig.input_shape={list(cfg.input_shape)}: text datasets take one value, "
                         f"the sequence length. Set input_shape=[{DEFAULT_SEQ_LEN}].")
    return int(cfg.input_shape[0])


# ----------------------------------------------------------------------------- synthetic_text


def markov_streams(num_sequences: int, length: int, vocab_size: int, seed: int, split: int) -> np.ndarray:
    """``(num_sequences, length)`` token ids from the seeded Markov chain of ``synthetic_text``.

    The chain (successor table) depends on ``seed`` only, so train and test share it;
    the start tokens and the choices come from a per-split stream.
    """
    table_rng = np.random.default_rng([seed % 2**63, 7])
    successors = table_rng.integers(0, vocab_size, size=(vocab_size, 1 + NUM_ALTERNATIVES))
    rng = np.random.default_rng([seed % 2**63, 11, split])
    follow = rng.random((num_sequences, length)) < FOLLOW_PROB
    alternative = rng.integers(1, 1 + NUM_ALTERNATIVES, size=(num_sequences, length))
    choice = np.where(follow, 0, alternative)
    tokens = np.empty((num_sequences, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab_size, size=num_sequences)
    # One vectorised step per position: cost grows with the length, not the sample count.
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return tokens


def _synthetic_settings(cfg: "DataConfig") -> tuple:
    seq_len = _seq_len(cfg)
    vocab_size, num_samples = generated_sizes(cfg, "synthetic_text", "tokens in its vocabulary (e.g. 1000)",
                                              DEFAULT_VOCAB_SIZE, DEFAULT_NUM_SAMPLES)
    return seq_len, vocab_size, num_samples


def build_synthetic_text(cfg: "DataConfig") -> Datasets:
    seq_len, vocab_size, num_samples = _synthetic_settings(cfg)
    train = TokenWindows(markov_streams(num_samples, seq_len + 1, vocab_size, cfg.seed, _TRAIN))
    test = TokenWindows(markov_streams(num_samples // 4, seq_len + 1, vocab_size, cfg.seed, _TEST))
    return Datasets(train, test, (seq_len,), vocab_size, seq_len=seq_len)


def check_synthetic_text(cfg: "DataConfig") -> tuple:
    seq_len, vocab_size, _ = _synthetic_settings(cfg)
    return (seq_len,), vocab_size


# ----------------------------------------------------------------------------- text_file


def _text_file_settings(cfg: "DataConfig") -> tuple:
    if not cfg.data_root:
        raise ValueError("TrainConfig.data_root is not set: text_file reads a local text file. "
                         "Set data_root to its path, e.g. data_root='corpus.txt'.")
    path = Path(cfg.data_root).expanduser()
    if not path.is_file():
        raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: no such file. text_file reads one local "
                         f"text file; give its path.")
    if cfg.num_classes not in (None, BYTE_VOCAB_SIZE):
        raise ValueError(f"TrainConfig.num_classes={cfg.num_classes}: text_file tokenises bytes, so the "
                         f"vocabulary is {BYTE_VOCAB_SIZE}. Leave num_classes unset.")
    seq_len = _seq_len(cfg)
    # Enough for one test window (a tenth, rounded up) and at least one training window.
    needed = 2 * (seq_len + 1)
    size = path.stat().st_size
    if size < needed:
        raise ValueError(f"TrainConfig.data_root={cfg.data_root!r} holds {size} bytes, fewer than the "
                         f"{needed} that one training and one test window of seq_len={seq_len} need. "
                         f"Use a longer file or a smaller input_shape.")
    return path, seq_len


def build_text_file(cfg: "DataConfig") -> Datasets:
    path, seq_len = _text_file_settings(cfg)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    num_windows = len(data) // (seq_len + 1)
    windows = data[: num_windows * (seq_len + 1)].reshape(num_windows, seq_len + 1)
    num_test = max(1, int(np.ceil(num_windows * TEST_FRACTION)))
    train_rows = windows[: num_windows - num_test]
    if cfg.num_samples is not None:
        train_rows = train_rows[: cfg.num_samples]
    return Datasets(TokenWindows(train_rows), TokenWindows(windows[num_windows - num_test:]),
                    (seq_len,), BYTE_VOCAB_SIZE, seq_len=seq_len)


def check_text_file(cfg: "DataConfig") -> tuple:
    _, seq_len = _text_file_settings(cfg)
    return (seq_len,), BYTE_VOCAB_SIZE


DATASETS: Dict[str, Callable[["DataConfig"], Datasets]] = {
    "synthetic_text": build_synthetic_text,
    "text_file": build_text_file,
}
CHECKS: Dict[str, Callable[["DataConfig"], tuple]] = {
    "synthetic_text": check_synthetic_text,
    "text_file": check_text_file,
}
__all__ = ["DATASETS", "CHECKS", "TokenWindows", "markov_streams"]
