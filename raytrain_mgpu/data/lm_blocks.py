"""The ``text`` dataset's blocks as ``raytrain-mgpu data tokenize`` writes them, read by row from their files: the
splits of ``ingest="ray_data"``, whose training split Ray Data streams (``data/parquet_stream.py``).

The format: one block of ``seq_len + 1`` token ids a row of an ``input_ids`` column (``list<int32>``), the block
length and the vocabulary in the schema metadata. A row is a sample, so the splits stay in their files: the planned
stream's read tasks take the training split's rows in the planned order and its decode is the block -> ``(x, y)``
split (:func:`token_samples`); the test and validation splits are evaluated on the loader path (:class:`TokenBlocks`,
read a row group at a time). A worker holds the row-group layout (from the footers), not the corpus.

Documents, or token ids that are not such blocks (no ``seq_len`` in their metadata, JSONL, another ``seq_len``), are
refused before Ray with the fix (:func:`check_streamed`): tokenizing in Ray Data's tasks would redo it every epoch,
and ``data tokenize`` does it once. The split rule is the loader path's (:func:`held_out`), so both paths train and
test on the same blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from raytrain_mgpu.data.base import Datasets
from raytrain_mgpu.data.parquet_table import ParquetTable, arrow_errors

if TYPE_CHECKING:
    from raytrain_mgpu.data.lm_text import TextPlan

__all__ = ["TOKEN_COLUMN", "META_SEQ_LEN", "META_VOCAB_SIZE", "held_out", "block_pairs", "TokenTable", "TokenBlocks",
           "token_samples", "check_streamed", "streamed_splits"]

TOKEN_COLUMN = "input_ids"
# Schema metadata of data tokenize's Parquet: the block length and vocabulary it was written with.
META_SEQ_LEN = b"raytrain_mgpu.seq_len"
META_VOCAB_SIZE = b"raytrain_mgpu.vocab_size"
TEST_FRACTION = 0.1


def held_out(count: int) -> int:
    """Blocks the test split takes of a corpus of ``count`` blocks without ``train/`` and ``test/``: the last tenth,
    at least one."""
    return max(1, math.ceil(count * TEST_FRACTION))


def block_pairs(blocks: np.ndarray) -> tuple:
    """``(x, y)`` of ``(n, seq_len + 1)`` blocks: the inputs and the labels, the inputs shifted by one, int64."""
    tokens = torch.from_numpy(np.asarray(blocks, dtype=np.int64))
    return tokens[:, :-1], tokens[:, 1:]


class TokenTable(ParquetTable):
    """``data tokenize``'s files as a :class:`ParquetTable` (row groups from the footers, sorted rows read in one
    pass): the token column in place of images, no labels; rows read as ``(rows, seq_len + 1)`` int32 blocks."""

    def __init__(self, filesystem, files, column: str, seq_len: int):
        self.seq_len = seq_len
        super().__init__(filesystem, files, column, label_column="")

    def _read_schema(self, schema) -> None:  # lm_text.plan checked the column: lists of integers
        self.kind, self.value_is_float = "list", False

    def _read_labels(self) -> None:  # a block's labels are its own tokens
        return None

    def _shape(self) -> tuple:
        return (self.seq_len + 1,)

    def _num_classes(self) -> None:
        return None

    def _normaliser(self) -> None:
        return None


class TokenBlocks(Dataset):
    """Rows ``rows`` of a :class:`TokenTable`; item i is :func:`block_pairs` of its block, the loader path's
    ``TokenWindows`` item. The last row group read is kept: in-order access (an evaluation's strided shard of a
    sorted split) reads each row group once."""

    def __init__(self, table: TokenTable, rows: np.ndarray):
        self.table, self.rows = table, np.asarray(rows, np.int64)
        self._group: tuple = (-1, None)

    def __getstate__(self) -> dict:  # the kept row group is per process
        return {**self.__dict__, "_group": (-1, None)}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        groups, offsets = self.table.locate(self.rows[[range(len(self))[index]]])
        group = int(groups[0])
        if self._group[0] != group:
            self._group = (group, self.table.read_row_group(group))
        x, y = block_pairs(self._group[1][offsets[0]][None])
        return x[0], y[0]


def token_samples(batch: dict, table: TokenTable) -> tuple:
    """The stream's row -> sample function for token blocks (``data/parquet_stream.ParquetStream``): ``(x, y)``."""
    return block_pairs(batch["stored"])


def _stored_seq_len(filesystem, path: str) -> Optional[int]:
    """``data tokenize``'s block length in a Parquet file's metadata; None for JSONL or a file without it."""
    if not path.endswith(".parquet"):
        return None
    with arrow_errors(path), filesystem.open_input_file(path) as handle:
        metadata = pq.read_schema(handle).metadata or {}
    return int(metadata[META_SEQ_LEN]) if META_SEQ_LEN in metadata else None


def check_streamed(text: "TextPlan", data_root: str) -> None:
    """``ingest="ray_data"``: every file of ``text`` holds ``data tokenize``'s blocks of ``seq_len + 1`` tokens, or
    the error with the fix (footers only)."""
    fix = (f"Tokenize once: `raytrain-mgpu data tokenize --data-root {data_root} --tokenizer TOKENIZER --seq-len "
           f"{text.seq_len} --out DIR`, and set data_root=DIR; or set ingest='loader'.")
    if not text.tokens:
        raise ValueError(f"TrainConfig.ingest='ray_data': dataset='text' streams token blocks, and {text.where} holds "
                         f"documents (column {text.column!r}), which Ray Data's tasks would tokenize again every "
                         f"epoch. {fix.replace('TOKENIZER', str(text.tokenizer))}")
    for path in (path for files in text.splits for path in files):
        stored = _stored_seq_len(text.filesystem, path)
        if stored is None:
            raise ValueError(f"TrainConfig.ingest='ray_data': {path} holds token ids that are not data tokenize's "
                             f"blocks (JSONL, or no {META_SEQ_LEN.decode()} in its Parquet metadata), and the stream "
                             f"reads one block a row. {fix}")
        if stored != text.seq_len:
            raise ValueError(f"TrainConfig.seq_len={text.seq_len}: {path} holds blocks of seq_len={stored} (data "
                             f"tokenize's --seq-len), and ingest='ray_data' streams one block a row. Set "
                             f"seq_len={stored}, or tokenize again with --seq-len {text.seq_len}.")


def streamed_splits(text: "TextPlan") -> Datasets:
    """``text``'s splits read by row from their files: the blocks the loader path packs from them (``check_streamed``
    holds), split by the same rule."""
    tables = [TokenTable(text.filesystem, files, text.column, text.seq_len) for files in text.splits]
    if len(tables) == 2:
        train, test = (TokenBlocks(table, np.arange(len(table))) for table in tables)
    else:
        count = len(tables[0])
        kept = count - held_out(count)
        train, test = TokenBlocks(tables[0], np.arange(kept)), TokenBlocks(tables[0], np.arange(kept, count))
        if not kept:
            raise ValueError(f"dataset 'text': {text.where} holds {count} block(s) of seq_len + 1 = {text.seq_len + 1} "
                             f"tokens, and the test split takes the last: none is left to train on. Use more text "
                             f"or a smaller seq_len.")
    return Datasets(train, test, (text.seq_len,), text.vocab_size, seq_len=text.seq_len)
