"""``raytrain-mgpu data tokenize``: a corpus tokenized once, written as Parquet blocks that ``dataset="text"`` reads
without a tokenizer.

The same stream as the ``text`` dataset's (``data/lm_text.py``: each document's tokens and the EOS, the files in
sorted order), cut into blocks of ``seq_len + 1`` tokens, one block a row of an ``input_ids`` column (``list<int32>``),
``rows_per_file`` rows a file: ``out/part-00000.parquet``, ... (``out/train/`` and ``out/test/`` when the source has
both). Read back with the same ``seq_len`` they are the blocks tokenizing on the fly gives, so the test split (the
last tenth of the blocks) is the same too. Schema metadata keeps ``seq_len`` and the vocabulary's size, which sizes
``transformer_lm`` when no tokenizer is named.

Memory: one read batch of documents and the rows of the file being written (``rows_per_file`` blocks). One process
reads and writes: the fast tokenizer encodes each batch on every core of this machine (its own threads), which for
a corpus of a few GB is minutes; Ray Data's ``map_batches`` over the files would spread the tokenizing over a
cluster, and is not used here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Tuple

import numpy as np
import pyarrow.parquet as pq

from raytrain_mgpu.data.lm_text import (META_SEQ_LEN, META_VOCAB_SIZE, TOKEN_COLUMN, load_tokenizer, plan,
                                        token_batches)
from raytrain_mgpu.data.parquet import resolve_uri
from raytrain_mgpu.data.parquet_table import import_arrow

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["tokenize_to_parquet"]

logger = logging.getLogger(__name__)

ROW_GROUP_ROWS = 1024  # blocks a row group: what a reader's batch holds


def tokenize_to_parquet(cfg: "DataConfig", out: str, rows_per_file: int = 10000) -> Tuple[List[str], int]:
    """``cfg``'s text (``data_root``, ``text_column``, ``tokenizer``, ``seq_len``) as Parquet blocks under ``out``
    (a folder or URI): ``(paths written, blocks written)``."""
    if not isinstance(rows_per_file, int) or rows_per_file < 1:
        raise ValueError(f"--rows-per-file={rows_per_file!r}: must be a positive number of blocks, e.g. 10000.")
    text = plan(cfg)
    tokenizer = None if text.tokens else load_tokenizer(text.tokenizer)
    filesystem, root = resolve_uri(out)
    names = ("train", "test") if len(text.splits) == 2 else ("",)
    paths, count = [], 0
    for name, files in zip(names, text.splits):
        folder = f"{root}/{name}" if name else root
        filesystem.create_dir(folder, recursive=True)
        written, blocks = _write_split(text, files, tokenizer, filesystem, folder, rows_per_file)
        paths += written
        count += blocks
    logger.info("data tokenize: %d blocks of %d tokens in %d files under %s", count, text.seq_len + 1, len(paths), out)
    return paths, count


def _write_split(text, files, tokenizer, filesystem, folder: str, rows_per_file: int) -> Tuple[List[str], int]:
    """One split's stream cut into blocks as it is read (the tail shorter than a block dropped)."""
    size = text.seq_len + 1
    carry = np.zeros(0, np.int32)
    pending: List[np.ndarray] = []  # the blocks of the file being filled
    paths: List[str] = []
    count = 0
    for piece in token_batches(text, files, tokenizer):
        stream = np.concatenate([carry, piece])
        whole = len(stream) // size
        carry = stream[whole * size:]
        rows = stream[:whole * size].reshape(whole, size)
        while len(rows):
            room = rows_per_file - sum(len(p) for p in pending)
            pending.append(rows[:room])
            rows = rows[room:]
            if sum(len(p) for p in pending) == rows_per_file:
                count += _write_file(text, np.concatenate(pending), filesystem, folder, paths)
                pending = []
    if pending:
        count += _write_file(text, np.concatenate(pending), filesystem, folder, paths)
    return paths, count


def _write_file(text, blocks: np.ndarray, filesystem, folder: str, paths: List[str]) -> int:
    pa = import_arrow()
    values = pa.array(blocks.reshape(-1), pa.int32())
    column = pa.FixedSizeListArray.from_arrays(values, blocks.shape[1]).cast(pa.list_(pa.int32()))
    metadata = {META_SEQ_LEN: str(text.seq_len).encode(), META_VOCAB_SIZE: str(text.vocab_size).encode()}
    table = pa.table({TOKEN_COLUMN: column}).replace_schema_metadata(metadata)
    path = f"{folder}/part-{len(paths):05d}.parquet"
    with filesystem.open_output_stream(path) as stream:
        pq.write_table(table, stream, row_group_size=ROW_GROUP_ROWS)
    paths.append(path)
    return len(blocks)
