"""What ``raytrain-mgpu bench-lm`` (``bench/lm.py``) trains on, made in a folder with no network: a Llama built
from a ``LlamaConfig`` (:data:`LLAMA`) with random weights and a byte-level BPE tokenizer trained with ``tokenizers``,
saved together as a Hugging Face folder (``save_pretrained``); Python's own help pages (``pydoc_data.topics``) as
Parquet documents, ``train/`` sized to the epoch the benchmark runs; the same text tokenized into block Parquet
(``data/lm_tokenize.py``) for ``ingest="ray_data"``; and, for the plain loop, the training blocks packed as
``dataset="text"`` packs them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional

__all__ = ["VOCAB", "LLAMA", "Setup", "documents", "save_tokenizer", "save_model", "prepare", "train_blocks"]

VOCAB = 512  # the tokenizer's vocabulary, which the model's embeddings match
LLAMA = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=0, pad_token_id=1)


@dataclass(frozen=True)
class Setup:
    """The files and sizes every runner trains on."""

    model: str  # the Hugging Face folder (config.json, model.safetensors, tokenizer files)
    text: str  # documents as Parquet: train/ and test/
    blocks: Optional[str]  # the same text as tokenized block Parquet (data tokenize), for ingest="ray_data"
    batch_size: int
    seq_len: int
    epochs: int
    steps_per_epoch: int  # what train/ holds: the first epoch is warm-up
    max_steps: int  # the run's optimizer steps (the last epoch may stop short of a whole one)
    parameters: int  # the base model's


def documents() -> List[str]:
    """Python's help topics as documents (paragraphs of at least 40 characters), in a fixed order."""
    from pydoc_data.topics import topics

    found = (" ".join(p.split()) for name in sorted(topics) for p in topics[name].split("\n\n"))
    return [text for text in found if len(text) >= 40]


def save_tokenizer(folder, texts: List[str], vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``texts`` with ``tokenizers``, saved by
    ``transformers``' ``PreTrainedTokenizerFast.save_pretrained`` (``<|endoftext|>`` its EOS, id 0; ``<pad>`` 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            pad_token="<pad>").save_pretrained(folder)


def save_model(folder: str, texts: List[str]) -> int:
    """The Llama of :data:`LLAMA` (random weights, seed 0) and its tokenizer, saved as a Hugging Face folder;
    returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    save_tokenizer(folder, texts)
    from transformers.utils import logging as hf_logging

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar, in the middle of the bench's lines
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _write_parquet(path: str, texts: List[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, row_group_size=256)


def prepare(root: str, batch_size: int, seq_len: int, epochs: int, max_steps: int, blocks: bool) -> Setup:
    """The model folder and the text under ``root``: ``train/`` the first documents whose tokens (and EOS) fill an
    epoch of ``ceil(max_steps / epochs)`` steps (one block to spare), ``test/`` the next ones filling a batch."""
    from transformers import AutoTokenizer

    texts = documents()
    folder = os.path.join(root, "tiny-llama")
    parameters = save_model(folder, texts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    steps = math.ceil(max_steps / epochs)
    lengths = [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    cuts, total = [], 0
    for index, length in enumerate(lengths):
        total += length
        if total >= ((steps * batch_size if not cuts else batch_size) + 1) * (seq_len + 1):
            cuts.append(index + 1)
            total = 0
            if len(cuts) == 2:
                break
    if len(cuts) < 2:
        raise ValueError(f"raytrain-mgpu bench-lm: Python's help text ({sum(lengths):,} tokens) holds fewer than the "
                         f"{(steps + 1) * batch_size} blocks of {seq_len + 1} tokens an epoch of {steps} steps and a "
                         f"test batch take. Lower --batch-size, --seq-len or --max-steps, or raise --epochs.")
    text = os.path.join(root, "text")
    _write_parquet(os.path.join(text, "train", "part-00000.parquet"), texts[:cuts[0]])
    _write_parquet(os.path.join(text, "test", "part-00000.parquet"), texts[cuts[0]:cuts[1]])
    blocks_root = None
    if blocks:
        from raytrain_mgpu.config.train import TrainConfig
        from raytrain_mgpu.data.lm_tokenize import tokenize_to_parquet

        blocks_root = os.path.join(root, "blocks")
        tokenize_to_parquet(TrainConfig(dataset="text", data_root=text, tokenizer=folder, seq_len=seq_len).data,
                            blocks_root)
    return Setup(folder, text, blocks_root, batch_size, seq_len, epochs, steps, max_steps, parameters)


def train_blocks(setup: Setup):
    """The training documents packed as ``dataset="text"`` packs them: ``(x, y)`` rows, ``y`` the next tokens."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.model)
    texts = pq.read_table(os.path.join(setup.text, "train")).column("text").to_pylist()
    stream = [t for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
              for t in (*ids, tokenizer.eos_token_id)]
    size = setup.seq_len + 1
    blocks = torch.tensor(stream[:len(stream) // size * size]).view(-1, size)
    return torch.utils.data.TensorDataset(blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous())
