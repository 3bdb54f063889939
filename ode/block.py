"""``ODEBlock``: a neural-ODE layer ``x -> y(t_end)``, ``dy/dt = func(t, y)``, ``y(t_0) = x``."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .config import (DEFAULT_MAX_REFINE, DEFAULT_MAX_STEPS, DEFAULT_N_NODES,
                     SolveConfig)
from .odeint import solve
from .stats import ODEStats

__all__ = ["ODEBlock"]


class ODEBlock(nn.Module):
    """A neural-ODE block trained with the interpolated adjoint by default.

    Maps ``x`` to the solution at ``t_span[-1]`` of ``dy/dt = func(t, y)``, ``y(t_span[0]) = x``
    (Chen et al., NeurIPS 2018), differentiated by the interpolated reverse dynamic method of
    Daulbaev et al., "Interpolation Technique to Speed Up Gradients Propagation in Neural ODEs"
    (NeurIPS 2020), or by backprop / the adjoint method (see :func:`ode.odeint`).

    Args:
        func: Dynamics, an ``nn.Module`` called as ``func(t, y)`` (``t`` a scalar tensor) and
            returning a tensor shaped like ``y``. Its parameters get gradients.
        t_span: Output times (>= 2, strictly monotone); the state starts at ``t_span[0]``.
        grad: ``"interpolated"``, ``"adjoint"`` or ``"backprop"``.
        method, rtol, atol, n_nodes, on_interp_error, interp_tol, max_refine, adjoint_rtol,
            adjoint_atol, max_steps, options: As in :func:`ode.odeint`.
        adjoint_params: Extra tensors (besides ``func``'s parameters) the dynamics use that need
            gradients; default none.
        return_trajectory: Return the states at all of ``t_span`` (shape
            ``(len(t_span), *x.shape)``) instead of only the last one.
        name: Name in error messages (default ``"ODEBlock(<func class>)"``; the Lightning
            callback sets the module path).

    Attributes:
        config: The :class:`~ode.config.SolveConfig` in use. Assign a changed copy to switch
            methods, e.g. ``block.config = block.config.replace(grad="adjoint")``.
        last_stats: :class:`~ode.ODEStats` of the latest forward call (function evaluations of
            forward and, once it has run, backward; interpolation error estimate), or ``None``.

    Example:
        >>> class Dynamics(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        ...     def forward(self, t, y):
        ...         return self.net(y)
        >>> block = ODEBlock(Dynamics(), (0.0, 1.0), rtol=1e-4, atol=1e-6, n_nodes=17)
        >>> y = block(torch.randn(32, 64))
        >>> y.sum().backward()
        >>> block.last_stats.forward_nfe, block.last_stats.backward_nfe
    """

    def __init__(
        self,
        func: nn.Module,
        t_span: Sequence[float] = (0.0, 1.0),
        *,
        grad: str = "interpolated",
        method: str = "dopri5",
        rtol: float = 1e-7,
        atol: float = 1e-9,
        n_nodes: int = DEFAULT_N_NODES,
        on_interp_error: str = "warn",
        interp_tol: float | None = None,
        max_refine: int = DEFAULT_MAX_REFINE,
        adjoint_rtol: float | None = None,
        adjoint_atol: float | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        options: Mapping[str, Any] | None = None,
        adjoint_params: Iterable[torch.Tensor] = (),
        return_trajectory: bool = False,
        name: str | None = None,
    ):
        super().__init__()
        if not isinstance(func, nn.Module):
            raise TypeError(f"func ({type(func).__name__}): must be an nn.Module called as "
                            "func(t, y); wrap a function in a module, or call ode.odeint directly")
        self.func = func
        self.t_span = _check_t_span(t_span)
        self.config = SolveConfig(
            grad=grad, method=method, rtol=rtol, atol=atol, n_nodes=n_nodes,
            on_interp_error=on_interp_error, interp_tol=interp_tol, max_refine=max_refine,
            adjoint_rtol=adjoint_rtol, adjoint_atol=adjoint_atol, max_steps=max_steps,
            options={} if options is None else options)
        self.extra_params = tuple(adjoint_params)
        self.return_trajectory = bool(return_trajectory)
        self.name = name
        self.last_stats: ODEStats | None = None

    @property
    def block_name(self) -> str:
        return self.name or f"ODEBlock({type(self.func).__name__})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Solve from ``x`` at ``t_span[0]``; returns the state at ``t_span[-1]`` (or at every
        time of ``t_span`` with ``return_trajectory=True``)."""
        dtype = torch.float32 if x.device.type == "mps" else torch.float64  # MPS has no float64
        t = torch.tensor(self.t_span, dtype=dtype, device=x.device)
        stats = ODEStats(grad=self.config.grad, method=self.config.method)
        params = tuple(p for p in self.func.parameters() if p.requires_grad) + self.extra_params
        ys = solve(self.func, x, t, config=self.config, adjoint_params=params, stats=stats,
                   name=self.block_name)
        self.last_stats = stats
        return ys if self.return_trajectory else ys[-1]

    def extra_repr(self) -> str:
        c = self.config
        extra = f", n_nodes={c.n_nodes}" if c.grad == "interpolated" else ""
        return (f"t_span={self.t_span}, grad={c.grad!r}, method={c.method!r}, rtol={c.rtol:g}, "
                f"atol={c.atol:g}{extra}")


def _check_t_span(t_span: Any) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in t_span)
    except (TypeError, ValueError) as e:
        raise ValueError(f"t_span={t_span!r}: must be a sequence of >= 2 numbers such as "
                         "(0.0, 1.0)") from e
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"t_span={t_span!r}: must hold >= 2 finite times such as (0.0, 1.0)")
    steps = [b - a for a, b in zip(values[:-1], values[1:])]
    if not (all(s > 0 for s in steps) or all(s < 0 for s in steps)):
        raise ValueError(f"t_span={t_span!r}: times must be strictly increasing or strictly "
                         "decreasing, without repeats")
    return values
