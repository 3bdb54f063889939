"""Small reference models shared by the benchmarks and the tests (built from code, no weights).

* :class:`GPT` — a GPT-style decoder (pre-LN blocks, causal attention written out or through
  ``scaled_dot_product_attention``, GELU MLP, dropout), returning logits or a loss.
* :class:`ResNet` — a ResNet-style CNN with BatchNorm and residual basic blocks.
* :class:`UNet` — a U-Net (conv-BN-ReLU levels, max-pool down, transposed-conv up, long skip
  connections from each encoder level to its decoder level: a DAG, not a chain).
* :class:`MLP` — a plain multilayer perceptron.
* :class:`ViT` — a Vision Transformer (patch embedding, class token, pre-norm blocks without a
  causal mask, classification head), returning logits or the loss.
* :class:`Mamba` — a Mamba-style language model whose selective scan is a Python loop over time
  steps (no fused kernel), so a captured step has thousands of small ops.
* :class:`RecurrentLM` — embedding, a stacked ``nn.LSTM``/``nn.GRU``/``nn.RNN``, a vocabulary head.
* :class:`CellLoopLM` — the same with an ``nn.LSTMCell`` called in a Python loop over time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "ResNet", "UNet", "MLP", "ViT", "Mamba", "RecurrentLM", "CellLoopLM",
           "gpt_batch", "image_batch"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    dropout: float = 0.0
    attention: str = "manual"  # "manual" | "sdpa"
    # Hidden width of each block's MLP, one per layer (None: 4 * d_model in every layer).
    mlp_widths: tuple[int, ...] | None = None
    causal: bool = True  # False: every token attends to every token (a ViT's encoder)

    def __post_init__(self) -> None:
        if self.mlp_widths is not None and len(self.mlp_widths) != self.n_layer:
            raise ValueError(f"GPTConfig(mlp_widths={self.mlp_widths!r}): expected one width per "
                             f"layer ({self.n_layer}), got {len(self.mlp_widths)}; pass "
                             f"n_layer={len(self.mlp_widths)} or that many widths")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.attention = cfg.attention
        self.dropout = cfg.dropout
        self.causal = cfg.causal
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.seq_len, cfg.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if self.causal:
                att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block; ``mlp_width`` is the MLP's hidden width (default 4 * d_model)."""

    def __init__(self, cfg: GPTConfig, mlp_width: int | None = None) -> None:
        super().__init__()
        hidden = mlp_width or 4 * cfg.d_model
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden), nn.GELU(),
            nn.Linear(hidden, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style language model; ``forward(idx, targets=None)`` returns logits or the loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        widths = cfg.mlp_widths or (None,) * cfg.n_layer
        self.blocks = nn.ModuleList(Block(cfg, w) for w in widths)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.short(x))


class ResNet(nn.Module):
    """A small ResNet-style CNN (BatchNorm, residual basic blocks) for ``(N, 3, H, W)`` images."""

    def __init__(self, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2), num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, c = [], width
        for stage, n in enumerate(blocks):
            c_out = width * 2 ** stage
            for k in range(n):
                layers.append(BasicBlock(c, c_out, 2 if (k == 0 and stage > 0) else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


class DoubleConv(nn.Sequential):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(*conv_bn_relu(c_in, c_out), *conv_bn_relu(c_out, c_out))


class Down(nn.Module):
    """Encoder level: two conv-BN-ReLU, then a 2x2 max-pool; returns ``(skip, pooled)``."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = DoubleConv(c_in, c_out)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self.conv(x)
        return skip, self.pool(skip)


class Up(nn.Module):
    """Decoder level: 2x transposed-conv upsampling, concat with the encoder's skip, two conv-BN-ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv = DoubleConv(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """A small U-Net for ``(N, in_ch, H, W)`` images (H, W divisible by ``2 ** depth``).

    ``depth`` encoder levels (channels ``width * 2**i``), a bottleneck, ``depth`` decoder levels
    (each concatenating the matching encoder output) and a 1x1 head; returns ``(N, out_ch, H, W)``.
    """

    def __init__(self, width: int = 16, depth: int = 3, in_ch: int = 3, out_ch: int = 3) -> None:
        super().__init__()
        chans = [width * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList(Down(c_in, c_out) for c_in, c_out in zip([in_ch] + chans, chans[:depth]))
        self.bottleneck = DoubleConv(chans[depth - 1], chans[depth])
        self.up = nn.ModuleList(Up(chans[i + 1], chans[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(width, out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for level in self.down:
            skip, x = level(x)
            skips.append(skip)
        x = self.bottleneck(x)
        for level, skip in zip(self.up, reversed(skips)):
            x = level(x, skip)
        return self.head(x)


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, width: int = 256, depth: int = 4, d_out: int = 10,
                 activation: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), activation()) for a, b in zip(dims, dims[1:])])
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(x))


class ViT(nn.Module):
    """A Vision Transformer for ``(N, 3, H, W)`` images; ``forward(x, labels=None)`` returns the
    logits or the cross-entropy loss.

    Patches of ``patch x patch`` pixels are embedded by a strided convolution, a class token and
    learned position embeddings are added, ``depth`` pre-norm :class:`Block` s (no causal mask)
    follow, and the class token's final state is classified.
    """

    def __init__(self, image: int = 32, patch: int = 4, d_model: int = 192, depth: int = 4,
                 n_head: int = 4, num_classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        if image % patch:
            raise ValueError(f"ViT(image={image}, patch={patch}): the image size must be a "
                             "multiple of the patch size; pass e.g. image=32, patch=4")
        tokens = (image // patch) ** 2 + 1
        cfg = GPTConfig(seq_len=tokens, d_model=d_model, n_layer=depth, n_head=n_head,
                        dropout=dropout, causal=False)
        self.patch = nn.Conv2d(3, d_model, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(depth))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (N, patches, d_model)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x[:, 0]))
        return logits if labels is None else F.cross_entropy(logits, labels)


class MambaBlock(nn.Module):
    """A Mamba block (Gu & Dao, 2023): input projection, causal depthwise convolution, SiLU,
    input-dependent ``(dt, B, C)``, a sequential selective scan, SiLU gate, output projection.

    The scan is the reference recurrence ``h_t = exp(dt_t A) h_t-1 + dt_t B_t x_t``,
    ``y_t = C_t h_t + D x_t``, written as a Python loop over the time steps (no fused kernel).
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: int = 2, d_conv: int = 4) -> None:
        super().__init__()
        d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner)
        a = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(a))  # (d_inner, d_state)
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)  # (N, T, d_inner) each
        u = F.silu(self.conv(u.transpose(1, 2))[..., :t].transpose(1, 2))
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # (N, T, d_inner)
        a = -torch.exp(self.A_log)
        dtu = dt * u
        h = x.new_zeros(x.shape[0], a.shape[0], self.d_state)  # (N, d_inner, d_state)
        ys = []
        for i in range(t):  # each step's (N, d_inner, d_state) factors exist only inside it
            da = torch.exp(dt[:, i].unsqueeze(-1) * a)
            h = da * h + dtu[:, i].unsqueeze(-1) * b[:, i].unsqueeze(1)
            ys.append((h * c[:, i].unsqueeze(1)).sum(-1))  # (N, d_inner)
        y = torch.stack(ys, dim=1) + u * self.D
        return self.out_proj(y * F.silu(z))


class Mamba(nn.Module):
    """A Mamba-style language model: embedding, pre-norm residual :class:`MambaBlock` s, a final
    norm and a head; ``forward(idx, targets=None)`` returns the logits or the loss."""

    def __init__(self, vocab_size: int = 256, d_model: int = 64, n_layer: int = 2,
                 d_state: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layer))
        self.blocks = nn.ModuleList(MambaBlock(d_model, d_state) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RecurrentLM(nn.Module):
    """Embedding, a stacked recurrent layer (``cell``: ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN``,
    batch-first, dropout between its layers), a vocabulary head; ``forward(idx, targets)``
    returns the loss."""

    def __init__(self, cell: type = nn.LSTM, *, vocab_size: int = 1000, d_embed: int = 64,
                 hidden: int = 128, n_layer: int = 2, bidirectional: bool = False,
                 dropout: float = 0.3, **kwargs) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_embed)
        self.rnn = cell(d_embed, hidden, num_layers=n_layer, batch_first=True,
                        bidirectional=bidirectional, dropout=dropout, **kwargs)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten())


class CellLoopLM(nn.Module):
    """Embedding, an ``nn.LSTMCell`` called once per time step in a Python loop, a vocabulary
    head; ``forward(idx, targets)`` returns the loss. A captured step is a loop-shaped graph of
    thousands of small ops."""

    def __init__(self, vocab_size: int = 256, d_embed: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d_embed)
        self.cell = nn.LSTMCell(d_embed, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        h = c = x.new_zeros(x.shape[0], self.cell.hidden_size)
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        logits = self.head(torch.stack(outs, 1))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(cfg: GPTConfig, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def image_batch(batch: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(10, (batch,), generator=g)
