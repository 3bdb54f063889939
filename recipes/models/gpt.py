"""A small GPT-style decoder-only language model (pre-LN transformer blocks, causal attention).

Architecture after Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2,
2019): token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
self-attention, then a 4x GELU MLP, each in a residual branch), a final LayerNorm and a linear
head (tied to the token embedding by default).

NOTE [ Attention written out ]
    Attention is written as ``softmax(q k^T / sqrt(d) + causal mask) v`` with an explicit dropout
    on the attention weights rather than ``F.scaled_dot_product_attention``: the (T x T) attention
    matrices are the activations that dominate memory at long context, and rematerialization needs
    them to be separate values in the captured graph (a fused kernel hides them).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; see NOTE [ Attention written out ]."""

    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool
    ) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.ones(block_size, block_size, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(
        self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout, bias)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        vocab_size: Number of token ids (256 for bytes).
        block_size: Longest sequence (context length) the position embedding covers.
        n_layer: Number of transformer blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        dropout: Dropout probability on embeddings, attention weights and residual branches.
        bias: Biases in the Linear and LayerNorm layers.
        tie_weights: Share the output head's weight with the token embedding (GPT-2 does).

    Shapes:
        ``forward(idx)``: ``idx`` is ``(batch, time)`` int64 with ``time <= block_size``;
        returns logits ``(batch, time, vocab_size)`` in the parameters' dtype.

    Raises:
        ValueError: if ``n_embd`` is not a multiple of ``n_head``, or a size is not positive.

    Example:
        >>> net = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
        >>> net(torch.zeros(4, 32, dtype=torch.long)).shape
        torch.Size([4, 32, 256])
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be a positive int")
        if n_embd % n_head:
            raise ValueError(
                f"n_embd={n_embd}: must be a multiple of n_head={n_head}; change one of them"
            )
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_embd, n_head, block_size, dropout, bias) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the init of the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
