"""Small models and batches for the remat tests (CPU, float32, fast to capture)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from benchmarks.models import GPT, MLP, GPTConfig, ResNet, UNet, gpt_batch, image_batch


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Dropout(0.3), nn.Linear(96, 96),
                                 nn.Tanh(), nn.Dropout(0.2), nn.Linear(96, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DictOut(nn.Module):
    """Returns a dict: two heads over a shared trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 96), nn.GELU())
        self.a = nn.Linear(96, 8)
        self.b = nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"logits": self.a(h), "aux": torch.sigmoid(self.b(h))}


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 96), nn.SiLU(),
                                  nn.Linear(96, 96), nn.Tanh())
        self.head = nn.Linear(96, 8)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.body(x)
        return Output(self.head(h), h)


def gpt_config(attention: str, dropout: float) -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layer=2, n_head=2,
                     dropout=dropout, attention=attention)


def make(name: str) -> tuple[nn.Module, tuple]:
    """A fresh model (seeded) and its example batch (positional args)."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(d_in=32, width=96, depth=3), (torch.randn(128, 32),)
    if name == "gpt_manual":
        cfg = gpt_config("manual", 0.1)
        return GPT(cfg), gpt_batch(cfg, 8)
    if name == "gpt_sdpa":
        cfg = gpt_config("sdpa", 0.0)
        return GPT(cfg), (gpt_batch(cfg, 8)[0],)
    if name == "cnn_bn":
        return ResNet(width=8, blocks=(1, 1)), (image_batch(8, size=16)[0],)
    if name == "unet":  # long skip connections: a DAG, not a chain of blocks
        return UNet(width=4, depth=2), (image_batch(4, size=16)[0],)
    if name == "dropout":
        return DropoutMLP(), (torch.randn(128, 32),)
    if name == "dict_out":
        return DictOut(), (torch.randn(128, 32),)
    if name == "dataclass_out":
        return DataclassOut(), (torch.randn(128, 32),)
    raise KeyError(name)


MODELS = ["mlp", "gpt_manual", "gpt_sdpa", "cnn_bn", "unet", "dropout", "dict_out", "dataclass_out"]


def scalar_of(out: object) -> torch.Tensor:
    """A scalar that depends on every output tensor with distinct weights per element.

    ``vdot`` allocates no output-sized temporary, so the only memory the test adds to the
    module's step is this scalar (and, in backward, the output gradients the module expects).
    """
    total = 0
    for k, t in enumerate(leaves(out)):
        if t.dim() == 0:
            total = total + t * (k + 1)
            continue
        w = _weights(t.numel(), t.dtype)
        total = total + torch.vdot(t.reshape(-1), w) * (k + 1)
    return total


_WEIGHTS: dict = {}


def _weights(n: int, dtype: torch.dtype) -> torch.Tensor:
    if (n, dtype) not in _WEIGHTS:
        _WEIGHTS[(n, dtype)] = torch.linspace(-1.0, 1.0, n, dtype=dtype)
    return _WEIGHTS[(n, dtype)]


def leaves(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return list(out.values())
    return [getattr(out, k) for k in vars(out)]
