"""Shared inputs of the quant.cp tests: a conv weight trained on scikit-learn's digits, and a
low-rank synthetic tensor. Imported by the test modules (it holds no tests itself)."""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

# Training budget of the digits CNN: ~0.7 s on one CPU core, held-out accuracy 0.955.
DIGITS_EPOCHS = 8


@functools.lru_cache(maxsize=1)
def digits_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small CNN trained briefly on scikit-learn's bundled digits, and the data split.

    Returns ``(net, x_train, y_train, x_test, y_test)``; cached for the whole test session.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=gen)
    x, y = x[perm], y[perm]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(DIGITS_EPOCHS):
            order = torch.randperm(len(y_train))
            for i in range(0, len(order), 64):
                idx = order[i:i + 64]
                loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    net.eval()
    return net, x_train, y_train, x_test, y_test


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def low_rank_tensor(shape=(40, 30, 9), rank=10, noise=0.01, seed=1) -> torch.Tensor:
    """An exactly rank-``rank`` CP tensor plus ``noise`` relative Gaussian noise (float32)."""
    gen = torch.Generator().manual_seed(seed)
    factors = [torch.randn(d, rank, generator=gen, dtype=torch.float64) for d in shape]
    t = torch.einsum("ir,jr,kr->ijk", *factors)
    t = t + noise * t.norm() / t.numel() ** 0.5 * torch.randn(t.shape, generator=gen,
                                                              dtype=torch.float64)
    return t.float()


def pinned_errors() -> dict[tuple[str, int], tuple[float, float]]:
    """The (ADMM, CP-then-quantize) errors pinned in test_cp_admm.py, recomputed."""
    from quant.cp import cp_then_quantize, quantized_cp

    conv = digits_cnn()[0][2].weight.detach().reshape(32, 16, 9)
    out = {}
    for name, tensor, rank in [("trained", conv, 40), ("lowrank", low_rank_tensor(), 10)]:
        for bits in (8, 4):
            out[(name, bits)] = (quantized_cp(tensor, rank, bits).error,
                                 cp_then_quantize(tensor, rank, bits).error)
    return out


if __name__ == "__main__":  # python -m tests.quant.cp_fixtures
    for key, (admm, ptq) in pinned_errors().items():
        print(f"{key}: ADMM {admm:.4f}  CP-then-quantize {ptq:.4f}  ratio {admm / ptq:.3f}")
