"""``text``: documents for causal language models, from Parquet or JSONL, tokenized once and packed into blocks.

``data_root`` is a file, a folder or a ``s3://``/``gs://``/``file://`` URI (``pyarrow.fs``, as ``parquet`` reads)
of ``*.parquet`` and ``*.jsonl`` files, read in sorted order. Its column ``text_column`` holds either documents
(strings), tokenized with ``tokenizer`` (a folder ``transformers.AutoTokenizer.from_pretrained`` loads; default: the
folder of an ``hf:<folder>`` model), or lists of token ids (``input_ids``, as ``raytrain-mgpu data tokenize`` writes
them: ``data/lm_tokenize.py``), used as they are, without a tokenizer. A file without ``text_column`` that has
``input_ids`` is read from that.

Packing: each document's tokens (no special tokens added) followed by the tokenizer's EOS, every document in
order, make one stream, cut into blocks of ``seq_len + 1`` tokens; the tail shorter than a block is dropped, and no
block is padded. Item i is ``(block[:-1], block[1:])``: the labels are the inputs shifted by one
(``data/text.TokenWindows``). Token-id lists are joined as they are (no EOS added: they carry their own), so
``data tokenize``'s blocks read back as the very blocks tokenizing on the fly gives, for the same ``seq_len``.

Splits: ``train/`` and ``test/`` sub-folders when both exist; else the last tenth of the blocks (at least one) is
the test split, a contiguous tail, so the test text is not trained on (but for the one block it starts in).
``val_fraction`` holds blocks out of the training split, as for every dataset.

Tokenized once per process, not per epoch: a worker tokenizes when it builds its splits (the same files, tokenizer
and ``seq_len`` give every worker the same blocks) and keeps them for the process's later builds. A corpus that
takes minutes to tokenize is tokenized once with ``data tokenize``; training then reads token ids only.

The blocks are a map-style dataset, so the loader path gives what it gives the image ``parquet`` dataset: an order
planned by the seed and the epoch (``DistributedSampler``), the same at every worker count and after a restart, and
step checkpoints that resume inside an epoch with no block skipped or repeated (``checkpointing/step_checkpoints.py``).
``ingest="ray_data"`` streams ``data tokenize``'s blocks in that order from their files (``data/lm_blocks.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Tuple

import numpy as np
import pyarrow.json as pajson
import pyarrow.parquet as pq

from raytrain_mgpu.data.base import Datasets
from raytrain_mgpu.data.lm_blocks import (META_SEQ_LEN, META_VOCAB_SIZE, TOKEN_COLUMN, check_streamed, held_out,
                                          streamed_splits)
from raytrain_mgpu.data.lm_fields import default_seq_len, hf_folder, model_limits
from raytrain_mgpu.data.parquet import resolve_uri
from raytrain_mgpu.data.parquet_table import import_arrow
from raytrain_mgpu.data.text import TokenWindows

if TYPE_CHECKING:
    from raytrain_mgpu.config.sections import DataConfig

__all__ = ["build", "check", "TextPlan", "plan", "token_batches", "pack", "load_tokenizer", "META_SEQ_LEN",
           "META_VOCAB_SIZE", "TOKEN_COLUMN"]

logger = logging.getLogger(__name__)

SUFFIXES = (".parquet", ".jsonl")
READ_ROWS = 1024  # documents read and tokenized per call: the fast tokenizer encodes a batch on all cores
JSON_BLOCK_BYTES = 1 << 26  # pyarrow's JSON reader needs a whole line inside one block: documents up to 64 MiB


@dataclass(frozen=True)
class TextPlan:
    """What reading ``cfg``'s text takes, found from file footers, first lines and the tokenizer's files."""

    filesystem: object
    splits: Tuple[Tuple[str, ...], ...]  # (all files,) or (train files, test files)
    column: str
    tokens: bool  # the column holds token ids (used as they are), not documents
    tokenizer: Optional[str]  # the folder (or hub name) that tokenizes the documents
    seq_len: int
    vocab_size: int  # the model's vocabulary (num_classes): the hf: model's config.json, else the tokenizer's
    where: str


# ----------------------------------------------------------------------------- files and columns


def _first_line(filesystem, path: str) -> bytes:
    """The first line of a file, read in 64 KiB pieces (a remote stream has no readline)."""
    line = b""
    with filesystem.open_input_stream(path) as stream:
        while b"\n" not in line and len(line) < JSON_BLOCK_BYTES:
            piece = stream.read(1 << 16)
            if not piece:
                break
            line += piece
    return line.split(b"\n", 1)[0].strip()


@contextlib.contextmanager
def _arrow_errors(where: str):
    pa = import_arrow()
    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"text {where}: cannot be read ({type(exc).__name__}: {exc}). Point data_root at intact "
                         f"Parquet files or JSONL files of one JSON object a line.") from exc


def _files(cfg: "DataConfig") -> Tuple[object, Tuple[Tuple[str, ...], ...], str]:
    """``(filesystem, splits, where)``: the Parquet and JSONL files under ``data_root``, by split."""
    pafs = import_arrow().fs
    if not cfg.data_root:
        raise ValueError("TrainConfig.data_root=None: dataset 'text' reads Parquet or JSONL files. Set data_root to "
                         "a file, a folder of them or a s3:// or gs:// URI.")
    filesystem, path = resolve_uri(cfg.data_root)
    with _arrow_errors(path):
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.File:
            files = [path] if path.endswith(SUFFIXES) else []
            return filesystem, _named(cfg, (tuple(files),), path, [info.base_name]), path
        if info.type == pafs.FileType.NotFound:
            raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: {path} does not exist. Point data_root at a "
                             f"Parquet or JSONL file or a folder of them.")
        found = [f for f in filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
                 if f.type == pafs.FileType.File]
    ours = sorted(f.path for f in found if f.path.endswith(SUFFIXES))
    train, test = ([p for p in ours if p.startswith(f"{path}/{split}/")] for split in ("train", "test"))
    splits = (tuple(train), tuple(test)) if train and test else (tuple(ours),)
    return filesystem, _named(cfg, splits, path, sorted(f.base_name for f in found)), path


def _named(cfg, splits: tuple, path: str, seen: list) -> tuple:
    if not all(splits):
        held = f"; it holds {seen[:8]}{' ...' if len(seen) > 8 else ''}" if seen else " (it is empty)"
        raise ValueError(f"TrainConfig.data_root={cfg.data_root!r}: no Parquet (*.parquet) or JSONL (*.jsonl) files "
                         f"in {path}{held}. Point data_root at the documents' files (convert CSV or text with "
                         f"pyarrow or datasets' to_parquet).")
    return splits


def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl")


def _columns(filesystem, path: str) -> dict:
    """``{column: "text" | "tokens" | other type}`` of one file: a Parquet footer, or a JSONL file's first line."""
    pa = import_arrow()
    with _arrow_errors(path):
        if _is_jsonl(path):
            row = json.loads(_first_line(filesystem, path) or "{}")
            if not isinstance(row, dict):
                raise ValueError(f"text {path}: the first line is not a JSON object. Write one object a line, "
                                 f'e.g. {{"text": "..."}}.')
            return {k: "text" if isinstance(v, str) else "tokens" if isinstance(v, list) else type(v).__name__
                    for k, v in row.items()}
        with filesystem.open_input_file(path) as handle:
            schema = pq.read_schema(handle)
    kinds = {}
    for field in schema:
        kind, types = str(field.type), pa.types
        if types.is_string(field.type) or types.is_large_string(field.type):
            kind = "text"
        elif (types.is_list(field.type) or types.is_large_list(field.type)) and types.is_integer(
                field.type.value_type):
            kind = "tokens"
        kinds[field.name] = kind
    return kinds


def _column(cfg, filesystem, files: Tuple[str, ...]) -> Tuple[str, bool, int]:
    """``(column, holds token ids, vocab_size from data tokenize's metadata or 0)``, the same in every file."""
    chosen = None
    for path in files:
        kinds = _columns(filesystem, path)
        name = cfg.text_column if cfg.text_column in kinds else TOKEN_COLUMN if TOKEN_COLUMN in kinds else None
        if name is None:
            raise ValueError(f"text {path}: no column {cfg.text_column!r} (TrainConfig.text_column); its columns are "
                             f"{sorted(kinds)}. Set text_column to the one with the documents (or token ids).")
        if kinds[name] not in ("text", "tokens"):
            raise ValueError(f"text {path}: column {name!r} holds {kinds[name]}, not documents (strings) or token "
                             f"ids (lists of integers). Set text_column to a column of either.")
        if chosen is not None and chosen != (name, kinds[name]):
            raise ValueError(f"text {path}: column {name!r} holds {kinds[name]}, but {files[0]} gives "
                             f"{chosen[0]!r} of {chosen[1]}. Write every file with the same columns.")
        chosen = (name, kinds[name])
    return chosen[0], chosen[1] == "tokens", _stored_vocab(filesystem, files[0])


def _stored_vocab(filesystem, path: str) -> int:
    if _is_jsonl(path):
        return 0
    with _arrow_errors(path), filesystem.open_input_file(path) as handle:
        metadata = pq.read_schema(handle).metadata or {}
    return int(metadata.get(META_VOCAB_SIZE, b"0"))


# ----------------------------------------------------------------------------- the tokenizer and the plan


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str):
    """``transformers.AutoTokenizer.from_pretrained(name)``, refused with the fix when it does not load or has no
    EOS token (the documents are joined with it); loaded once per process."""
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1  # else a hub id, e.g. "org/name"
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ValueError(f"TrainConfig.tokenizer={name!r}: no such folder. Point tokenizer at a folder saved with "
                         f"save_pretrained (tokenizer.json and tokenizer_config.json).")
    from transformers import AutoTokenizer  # late: optional dependency

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name))
    except (OSError, ValueError) as exc:
        raise ValueError(f"TrainConfig.tokenizer={name!r}: transformers cannot load a tokenizer from it "
                         f"({type(exc).__name__}: {exc}). Point tokenizer at a folder saved with "
                         f"save_pretrained.") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"TrainConfig.tokenizer={name!r} has no EOS token, which ends every document in the packed "
                         f"stream. Set one (tokenizer.eos_token = '<|endoftext|>') and save the folder again.")
    return tokenizer


def _named_tokenizer(cfg, name: str):
    """The tokenizer ``tokenizer`` names, else the ``hf:`` model's folder's (an error says which it was)."""
    try:
        return load_tokenizer(name)
    except ValueError as exc:
        if cfg.tokenizer is not None:
            raise
        raise ValueError(f"TrainConfig.tokenizer=None: the documents are tokenized with the tokenizer in the folder "
                         f"of model={cfg.model!r}, and it does not load ({exc}). Save the tokenizer into that folder, "
                         f"or set tokenizer to a tokenizer folder.") from None


def plan(cfg: "DataConfig") -> TextPlan:
    """Everything :func:`build` needs, checked: the files and column, the tokenizer, the block length and the
    vocabulary, against an ``hf:`` model's ``config.json`` (embeddings and positions)."""
    filesystem, splits, where = _files(cfg)
    column, tokens, stored_vocab = _column(cfg, filesystem, tuple(f for split in splits for f in split))
    name = cfg.tokenizer or hf_folder(cfg.model)
    limits = model_limits(cfg.model)
    if not tokens and name is None:
        raise ValueError(f"TrainConfig.tokenizer=None: dataset 'text' tokenizes the documents of column {column!r} "
                         f"({where}), and no tokenizer is named. Set tokenizer to a tokenizer folder, use "
                         f"model='hf:<folder>' whose folder holds one, or tokenize once with `raytrain-mgpu data "
                         f"tokenize` and train on its input_ids.")
    vocab = len(_named_tokenizer(cfg, name)) if name is not None and (cfg.tokenizer or not tokens) else stored_vocab
    model_vocab, positions = limits.get("vocab_size"), limits.get("max_positions")
    if model_vocab and vocab > model_vocab:
        raise ValueError(f"TrainConfig.tokenizer={name!r}: its vocabulary has {vocab} tokens, more than the "
                         f"{model_vocab} embeddings of model={cfg.model!r} ({limits['where']}: vocab_size); a token "
                         f"id past {model_vocab - 1} has no embedding. Use the model's own tokenizer, or resize its "
                         f"embeddings (model.resize_token_embeddings(len(tokenizer))) and save it.")
    seq_len = cfg.seq_len if cfg.seq_len is not None else default_seq_len(cfg.model)
    if positions and seq_len > positions:
        raise ValueError(f"TrainConfig.seq_len={seq_len}: longer than the {positions} positions of "
                         f"model={cfg.model!r} ({limits['where']}: max_position_embeddings). Set seq_len to "
                         f"{positions} or less.")
    vocab = model_vocab or vocab or cfg.num_classes
    if not vocab:
        raise ValueError(f"dataset 'text': the token ids of {where} say nothing of their vocabulary. Set tokenizer to "
                         f"the folder that made them, or num_classes to the vocabulary's size.")
    return TextPlan(filesystem, splits, column, tokens, name, seq_len, int(vocab), where)


# ----------------------------------------------------------------------------- reading and packing


def _arrays(text: TextPlan, path: str) -> Iterator:
    """The column of one file, :data:`READ_ROWS` rows at a time (pyarrow arrays)."""
    pa = import_arrow()
    with _arrow_errors(path):
        if _is_jsonl(path):
            with text.filesystem.open_input_stream(path) as stream:
                table = pajson.read_json(stream, read_options=pajson.ReadOptions(block_size=JSON_BLOCK_BYTES))
            column = table.column(text.column).combine_chunks() if table.num_rows else pa.array([], pa.string())
            for start in range(0, len(column), READ_ROWS):
                yield column.slice(start, READ_ROWS)
            return
        with text.filesystem.open_input_file(path) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=READ_ROWS, columns=[text.column]):
                yield batch.column(0)


def token_batches(text: TextPlan, files: Tuple[str, ...], tokenizer=None) -> Iterator[np.ndarray]:
    """The token stream of ``files`` in pieces (``int32``): each document's tokens and the EOS, or the stored ids
    as they are. ``tokenizer``: :func:`load_tokenizer`'s, for documents."""
    eos = None if text.tokens else tokenizer.eos_token_id
    for path in files:
        for array in _arrays(text, path):
            if array.null_count:
                raise ValueError(f"text {path}: column {text.column!r} has {array.null_count} missing values "
                                 f"(null). Drop those rows, or write them as empty documents.")
            if text.tokens:
                yield array.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
                continue
            ids = tokenizer(array.to_pylist(), add_special_tokens=False)["input_ids"]
            total = sum(len(doc) for doc in ids) + len(ids)
            yield np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32, count=total)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """``(blocks, seq_len + 1)``: the stream cut into whole blocks, the tail shorter than one dropped."""
    size = seq_len + 1
    count = len(tokens) // size
    return tokens[:count * size].reshape(count, size)


_CACHE: dict = {}  # the blocks this process tokenized: key -> (train, test)
_CACHE_ENTRIES = 2


def _cache_key(text: TextPlan) -> tuple:
    files = [f for split in text.splits for f in split]
    stats = [(i.path, i.size, i.mtime_ns) for i in text.filesystem.get_file_info(files)]
    return (tuple(stats), text.splits, text.column, text.tokenizer, text.seq_len)


def blocks(text: TextPlan) -> Tuple[np.ndarray, np.ndarray]:
    """``(train blocks, test blocks)``, tokenized once per process."""
    key = _cache_key(text)
    if key not in _CACHE:
        tokenizer = None if text.tokens else load_tokenizer(text.tokenizer)
        streams = [np.concatenate([np.zeros(0, np.int32), *token_batches(text, files, tokenizer)])
                   for files in text.splits]
        packed = [pack(stream, text.seq_len) for stream in streams]
        if len(packed) == 1:
            count = len(packed[0])
            held = held_out(count)
            packed = [packed[0][:count - held], packed[0][count - held:]]
        for name, split in zip(("training", "test"), packed):
            if not len(split):
                raise ValueError(f"dataset 'text': {text.where} gives no {name} block of seq_len + 1 = "
                                 f"{text.seq_len + 1} tokens ({sum(len(s) for s in streams)} tokens in all). Use "
                                 f"more text or a smaller seq_len.")
        top = max(int(split.max()) for split in packed)
        if top >= text.vocab_size:
            raise ValueError(f"dataset 'text': token id {top} in {text.where} is past the vocabulary of "
                             f"{text.vocab_size} (the model's embeddings). Tokenize with the model's tokenizer.")
        while len(_CACHE) >= _CACHE_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = tuple(packed)
        logger.debug("text: %d train / %d test blocks of %d tokens", len(packed[0]), len(packed[1]), text.seq_len)
    return _CACHE[key]


def build(cfg: "DataConfig") -> Datasets:
    text = plan(cfg)
    if cfg.ingest == "ray_data":  # the blocks stay in their files, which Ray Data's tasks read by row: lm_blocks.py
        return streamed_splits(text)
    train, test = blocks(text)
    return Datasets(TokenWindows(train), TokenWindows(test), (text.seq_len,), text.vocab_size, seq_len=text.seq_len)


def check(cfg: "DataConfig") -> tuple:
    """Footers, first lines and the tokenizer (no document is tokenized): ``((seq_len,), vocab_size)``."""
    text = plan(cfg)
    if cfg.ingest == "ray_data":
        check_streamed(text, cfg.data_root)  # data tokenize's blocks of seq_len + 1, else the fix
    return (text.seq_len,), text.vocab_size
