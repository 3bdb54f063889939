"""A neural-ODE classifier for 8x8 images: Linear -> ``ode.ODEBlock`` -> Linear (no Lightning).

The ODE block is differentiated by ``grad`` (``"adjoint"``, ``"interpolated"`` or
``"backprop"``); the ``interp_adjoint`` plugin section switches it to the interpolated adjoint
(Daulbaev et al., NeurIPS 2020) during fit.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["DigitsODENet", "MLPDynamics"]


class MLPDynamics(nn.Module):
    """Autonomous dynamics ``f(t, y) = W2 tanh(W1 y + b1) + b2``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


class DigitsODENet(nn.Module):
    """``(N, 1, 8, 8)`` images -> ``(N, num_classes)`` logits through one ODE block.

    Args:
        width: State size of the ODE.
        hidden: Hidden units of the dynamics MLP.
        t_end: The block integrates over ``[0, t_end]``.
        grad, method, rtol, atol, n_nodes: Passed to :class:`ode.ODEBlock`.
        num_classes: Output classes.
    """

    def __init__(self, *, width: int = 32, hidden: int = 64, t_end: float = 1.0,
                 grad: str = "adjoint", method: str = "dopri5", rtol: float = 1e-4,
                 atol: float = 1e-6, n_nodes: int = 17, num_classes: int = 10):
        super().__init__()
        from ode import ODEBlock  # needs the ode extra (torchdiffeq) only when built

        self.encoder = nn.Linear(64, width)
        self.ode = ODEBlock(MLPDynamics(width, hidden), (0.0, t_end), grad=grad, method=method,
                            rtol=rtol, atol=atol, n_nodes=n_nodes)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ode(torch.tanh(self.encoder(x.flatten(1)))))
