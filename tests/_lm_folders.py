"""What a language-model user brings, made by the tests with no network: a tiny Llama saved as a Hugging Face
folder (random weights from a config, safetensors), a byte-level BPE tokenizer trained with ``tokenizers`` and
saved as ``transformers`` saves one, and real English text as Parquet and JSONL.

The text is Python's own help pages (``pydoc_data.topics``: about 465,000 characters of English prose and code
examples, shipped with every Python), cut into documents at blank lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

VOCAB = 512  # the tokenizer's vocabulary, which the model's embeddings match
MAX_POSITIONS = 128


def english_documents(limit: int = 0) -> List[str]:
    """Python's help topics as documents (paragraphs of at least 40 characters), in a fixed order."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            text = " ".join(paragraph.split())
            if len(text) >= 40:
                documents.append(text)
    return documents[:limit] if limit else documents


def save_tokenizer(folder: Path, documents: List[str]) -> Path:
    """A byte-level BPE tokenizer of :data:`VOCAB` tokens trained on ``documents``, saved with ``transformers``'
    ``PreTrainedTokenizerFast.save_pretrained`` (tokenizer.json and its config), ``<|endoftext|>`` its EOS: the one
    ``bench-lm`` trains (``raytrain_mgpu.bench._lm_materials``)."""
    from raytrain_mgpu.bench._lm_materials import save_tokenizer as train_and_save

    train_and_save(folder, documents, VOCAB)
    return folder


def save_tiny_llama(folder: Path, vocab_size: int = VOCAB, seed: int = 0) -> Path:
    """``LlamaForCausalLM`` at test size (2 layers, hidden 64, 4 heads), random weights seeded by ``seed``, saved
    with ``save_pretrained`` (config.json, model.safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def save_text(folder: Path, documents: List[str], files: int = 2, kind: str = "parquet") -> Path:
    """``documents`` in ``files`` shards under ``folder``: Parquet with a ``text`` column, or JSONL lines
    ``{"text": ...}``."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(documents) // files)
    for index in range(files):
        part = documents[index * per_file:(index + 1) * per_file]
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": part}), folder / f"part-{index:05d}.parquet", row_group_size=256)
        else:
            with open(folder / f"part-{index:05d}.jsonl", "w", encoding="utf-8") as out:
                out.writelines(json.dumps({"text": text}) + "\n" for text in part)
    return folder


def model_folder(root: Path, documents: List[str]) -> Path:
    """A model folder as users bring one: the tiny Llama with its tokenizer files beside it."""
    folder = root / "tiny-llama"
    save_tiny_llama(folder)
    save_tokenizer(folder, documents)
    return folder
