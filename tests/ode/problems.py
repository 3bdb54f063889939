"""Small dynamics shared by the ode tests."""
from __future__ import annotations

import torch
from torch import nn


class MLPDynamics(nn.Module):
    """``f(t, z) = W2 tanh(W1 z + b1 + t) + b2 - lam * z``: time-dependent, contracting for large lam."""

    def __init__(self, dim: int = 4, hidden: int = 16, *, lam: float = 0.0,
                 dtype: torch.dtype = torch.float64, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.l1 = nn.Linear(dim, hidden, dtype=dtype)
        self.l2 = nn.Linear(hidden, dim, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / p.shape[-1] ** 0.5)
        self.lam = lam

    def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(z) + t)) - self.lam * z


class LinearDynamics(nn.Module):
    """``f(t, z) = z A^T`` with a learnable ``A`` (rows of z are states)."""

    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(a.clone())

    def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return z @ self.a.T


def param_grads(module: nn.Module):
    return [p.grad.clone() for p in module.parameters()]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])
