"""The ``text`` dataset's fields, checked with the config (no torch, no tokenizer loaded), and what an
``hf:<folder>`` model tells the data: its folder (the default tokenizer) and its ``config.json``'s vocabulary and
positions (what the data must fit).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from raytrain_mgpu.config.names import fail, is_int
from raytrain_mgpu.config.factories import HF_MODEL_PREFIX

__all__ = ["TEXT_DATASET", "DEFAULT_SEQ_LEN", "MAX_DEFAULT_SEQ_LEN", "hf_folder", "model_limits", "default_seq_len",
           "check_text_fields"]

TEXT_DATASET = "text"
DEFAULT_SEQ_LEN = 128
"""``seq_len`` without an ``hf:`` model: ``transformer_lm``'s default positions (and ``synthetic_text``'s length)."""
MAX_DEFAULT_SEQ_LEN = 2048
"""The most positions the default ``seq_len`` takes of an ``hf:`` model: a model of 128k positions would otherwise
train blocks longer than most documents, in a batch few devices hold. Set ``seq_len`` for more."""


def hf_folder(model) -> Optional[str]:
    """The folder (``~`` expanded) or hub id of an ``hf:<...>`` model, which ``AutoTokenizer`` loads its tokenizer
    from; None for any other model, and for one at a storage URI (``s3://``: name its tokenizer with ``tokenizer``,
    rather than copying the model's weights to the driver for it)."""
    source = model[len(HF_MODEL_PREFIX):].strip() if isinstance(model, str) and model.startswith(HF_MODEL_PREFIX) else ""
    if not source or "://" in source:
        return None
    return str(Path(source).expanduser()) if source.startswith("~") else source


def model_limits(model) -> dict:
    """``{"vocab_size", "max_positions", "where"}`` of an ``hf:`` model from its local folder's ``config.json``
    (GPT-2's ``n_positions`` counts as positions); empty for other models, a hub id, or a folder without a readable
    one (the model's own build checks its vocabulary against the data's on the driver, ``models/huggingface.py``)."""
    folder = hf_folder(model)
    path = Path(folder) / "config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    return {"vocab_size": config.get("vocab_size") if is_int(config.get("vocab_size")) else None,
            "max_positions": positions if is_int(positions) else None, "where": str(path)}


def default_seq_len(model) -> int:
    """``seq_len=None``: the ``hf:`` model's positions, at most :data:`MAX_DEFAULT_SEQ_LEN`; else
    :data:`DEFAULT_SEQ_LEN`."""
    positions = model_limits(model).get("max_positions")
    return min(positions, MAX_DEFAULT_SEQ_LEN) if positions else DEFAULT_SEQ_LEN


def check_text_fields(cfg) -> None:
    """``text_column``, ``tokenizer`` and ``seq_len``: their types, and that a registered dataset other than
    ``text`` is not given them (it would not read them; ``text_column`` counts as given when it is not ``"text"``)."""
    if not isinstance(cfg.text_column, str) or not cfg.text_column.strip():
        fail("text_column", cfg.text_column, "must be a non-empty column name",
             "Set it to the column of your documents, e.g. 'text', or of token ids, 'input_ids'.")
    if cfg.tokenizer is not None and (not isinstance(cfg.tokenizer, str) or not cfg.tokenizer.strip()):
        fail("tokenizer", cfg.tokenizer, "must be a tokenizer folder or None",
             "Set it to a folder saved with save_pretrained, or leave it unset for an hf:<folder> model's own.")
    if cfg.seq_len is not None and (not is_int(cfg.seq_len) or cfg.seq_len < 1):
        fail("seq_len", cfg.seq_len, "must be a positive integer or None",
             "Set the tokens per training sequence, e.g. 512, or leave it unset for the model's positions.")
    dataset = cfg.dataset
    if not isinstance(dataset, str) or ":" in dataset:  # a factory or Ray Datasets: may read them itself
        return
    for name in ("tokenizer", "seq_len", "text_column"):
        unset = "text" if name == "text_column" else None  # text_column's default: any other value was set
        if getattr(cfg, name) != unset and dataset != TEXT_DATASET:
            fail(name, getattr(cfg, name), f"is read by dataset='text' only, and dataset={dataset!r}",
                 f"Set dataset='text' for Parquet or JSONL documents, or leave {name} unset"
                 + (" (synthetic_text and text_file take their length from input_shape)." if name == "seq_len"
                    else "."))
    if dataset == TEXT_DATASET and cfg.input_shape is not None:
        fail("input_shape", list(cfg.input_shape), "dataset='text' takes its sequence length from seq_len",
             f"Set seq_len={cfg.input_shape[-1]} and leave input_shape unset.")
