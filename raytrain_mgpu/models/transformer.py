"""A GPT-style causal language model built as a sequence of blocks.

Sized by default like the small BERT of the seed article (8 layers, 8 heads, hidden 256,
sequence 128, BERT's 30522-token vocabulary), but causal: position t predicts token t+1.

Layout: ``TransformerLM`` is an ``nn.Sequential`` of ``[Embedding, Block x num_layers,
Head]``, so pipeline and model parallelism can split it at block boundaries like any
other ``nn.Sequential``. Input and output embeddings are *not* tied: tied weights would
put one parameter on two stages.

Loss convention: the model returns logits shaped ``(batch, vocab, seq)``, the layout
``F.cross_entropy`` expects for per-position targets, so the generic
``F.cross_entropy(model(x), y)`` with ``y`` of shape ``(batch, seq)`` is the mean
token-level loss and ``logits.argmax(dim=1)`` the predicted tokens: the training loop
needs no language-model special case. The transpose is a view (no copy).

``dropout=0.0`` (the default) makes runs reproducible, as the equivalence tests need.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` ids -> ``(B, T, H)``."""

    def __init__(self, vocab_size: int, seq_len: int, hidden: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class Attention(nn.Module):
    """Causal self-attention: separate ``q``, ``k``, ``v`` projections and the output ``proj``.

    The head count is read from the projections' output width (``-1`` in the views), not fixed: a
    tensor-parallel run splits ``q``, ``k``, ``v`` by output features, so each rank computes whole heads
    of its own (separate projections, not one fused ``qkv``, so each rank's share is its heads' q, k and v).
    """

    def __init__(self, hidden: int, num_heads: int, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = hidden // num_heads, dropout
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (B, T, H) -> (B, heads, T, H / heads)
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)
        return self.proj(attn.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int, dropout: float):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"model_kwargs hidden={hidden} must be divisible by num_heads={num_heads}. "
                             f"Choose e.g. hidden={num_heads * max(1, hidden // num_heads)}.")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, num_heads, dropout)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, ffn_hidden), nn.GELU(), nn.Linear(ffn_hidden, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Weights saved before the attention's projections were separate (one fused ``qkv``, ``proj`` in the
        # block) load as they are: the fused rows are q's, k's and v's in that order.
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
            if fused is not None:
                for name, part in zip("qkv", fused.chunk(3, dim=0)):
                    state_dict[f"{prefix}attn.{name}.{kind}"] = part
            if f"{prefix}proj.{kind}" in state_dict:
                state_dict[f"{prefix}attn.proj.{kind}"] = state_dict.pop(f"{prefix}proj.{kind}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection; returns ``(B, V, T)`` logits."""

    def __init__(self, hidden: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x)).transpose(1, 2)


class TransformerLM(nn.Sequential):
    """``Embedding -> Block x num_layers -> Head``: one child module per splittable block."""

    def __init__(self, seq_len: int = 128, vocab_size: int = 30522, num_layers: int = 8,
                 num_heads: int = 8, hidden: int = 256, ffn_hidden: int | None = None,
                 dropout: float = 0.0):
        for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size), ("num_layers", num_layers),
                            ("num_heads", num_heads), ("hidden", hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"transformer_lm {name}={value!r} must be a positive integer.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"transformer_lm dropout={dropout!r} must be in [0, 1). Use 0.0 for reproducible runs.")
        ffn_hidden = ffn_hidden or 4 * hidden
        super().__init__(
            Embedding(vocab_size, seq_len, hidden, dropout),
            *(Block(hidden, num_heads, ffn_hidden, dropout) for _ in range(num_layers)),
            Head(hidden, vocab_size),
        )
        self.seq_len = seq_len
        self.vocab_size = vocab_size
