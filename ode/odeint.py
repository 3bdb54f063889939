"""``odeint``: solve an ODE with torchdiffeq and differentiate it by one of three methods.

* ``"backprop"`` — autograd through the solver's operations (torchdiffeq ``odeint``). Fastest
  backward for small models, but stores every stage of every step.
* ``"adjoint"`` — the reverse dynamic method (Chen et al., NeurIPS 2018; torchdiffeq
  ``odeint_adjoint``): re-solves the state backwards together with the adjoint. Stores only the
  outputs; unstable and slow when the forward flow contracts.
* ``"interpolated"`` — the interpolated reverse dynamic method (Daulbaev et al., "Interpolation
  Technique to Speed Up Gradients Propagation in Neural ODEs", NeurIPS 2020): stores the state at
  Chebyshev–Lobatto nodes and integrates only the adjoint and parameter gradients backwards.
  See :mod:`ode.interpolated`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn

from .config import (DEFAULT_MAX_REFINE, DEFAULT_MAX_STEPS, DEFAULT_N_NODES, GRAD_METHOD_NAMES,
                     SolveConfig, check_t, check_y0, require_torchdiffeq)
from .stats import MonitoredFunc, ODEStats

__all__ = ["odeint", "GRAD_METHODS", "solve"]


def _solve_backprop(func: MonitoredFunc, y0: torch.Tensor, t: torch.Tensor,
                    params: tuple[torch.Tensor, ...], config: SolveConfig,
                    stats: ODEStats) -> torch.Tensor:
    torchdiffeq = require_torchdiffeq()
    ys = torchdiffeq.odeint(func, y0, t, rtol=config.rtol, atol=config.atol, method=config.method,
                            options=dict(config.options))
    func.start_backward()
    return ys


def _solve_adjoint(func: MonitoredFunc, y0: torch.Tensor, t: torch.Tensor,
                   params: tuple[torch.Tensor, ...], config: SolveConfig,
                   stats: ODEStats) -> torch.Tensor:
    torchdiffeq = require_torchdiffeq()
    ys = torchdiffeq.odeint_adjoint(
        func, y0, t, rtol=config.rtol, atol=config.atol, method=config.method,
        options=dict(config.options), adjoint_rtol=config.backward_rtol,
        adjoint_atol=config.backward_atol, adjoint_params=params)
    func.start_backward()
    stats.stored_bytes = ys.numel() * ys.element_size() if ys.requires_grad else 0
    return ys


def _solve_interpolated(func, y0, t, params, config, stats):
    from .interpolated import solve_interpolated

    return solve_interpolated(func, y0, t, params, config, stats)


# name -> solve(func, y0, t, params, config, stats) -> (len(t), *y0.shape) tensor
GRAD_METHODS: dict[str, Callable[..., torch.Tensor]] = {
    "backprop": _solve_backprop,
    "adjoint": _solve_adjoint,
    "interpolated": _solve_interpolated,
}
if tuple(GRAD_METHODS) != GRAD_METHOD_NAMES:  # the names SolveConfig accepts
    raise ImportError(f"ode.odeint.GRAD_METHODS {tuple(GRAD_METHODS)} differs from "
                      f"ode.config.GRAD_METHOD_NAMES {GRAD_METHOD_NAMES}")


def _resolve_params(func: Callable, adjoint_params: Iterable[torch.Tensor] | None,
                    grad: str) -> tuple[torch.Tensor, ...]:
    if adjoint_params is None:
        if isinstance(func, nn.Module):
            return tuple(p for p in func.parameters() if p.requires_grad)
        if grad == "backprop":
            return ()
        raise ValueError(
            f"adjoint_params=None with grad={grad!r} and a func of type {type(func).__name__}: "
            "the backward pass can only find the parameters of an nn.Module; pass "
            "adjoint_params=[...] with every tensor func uses that needs a gradient (or () if "
            "none), or make func an nn.Module")
    params = tuple(adjoint_params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"adjoint_params[{i}] is a {type(p).__name__}: must be a tensor")
    return tuple(p for p in params if p.requires_grad)


def solve(func: Callable, y0: torch.Tensor, t: torch.Tensor, *, config: SolveConfig,
          adjoint_params: Iterable[torch.Tensor] | None = None, stats: ODEStats | None = None,
          name: str = "odeint") -> torch.Tensor:
    """:func:`odeint` with its settings already in a :class:`~ode.config.SolveConfig`."""
    if not callable(func):
        raise TypeError(f"func={func!r}: must be callable as func(t, y) -> dy/dt")
    check_y0(y0)
    check_t(t)
    if t.device != y0.device:
        t = t.to(y0.device)
    params = _resolve_params(func, adjoint_params, config.grad)
    if stats is None:
        stats = ODEStats(grad=config.grad, method=config.method)
    monitored = _monitor(func, stats, config, name)
    return GRAD_METHODS[config.grad](monitored, y0, t, params, config, stats)


def _monitor(func, stats, config, name):
    from .stats import RecordingFunc

    cls = RecordingFunc if config.grad == "interpolated" else MonitoredFunc
    return cls(func, stats, block=name, max_steps=config.max_steps)


def odeint(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    grad: str = "interpolated",
    method: str = "dopri5",
    rtol: float = 1e-7,
    atol: float = 1e-9,
    n_nodes: int = DEFAULT_N_NODES,
    adjoint_params: Iterable[torch.Tensor] | None = None,
    on_interp_error: str = "warn",
    interp_tol: float | None = None,
    max_refine: int = DEFAULT_MAX_REFINE,
    adjoint_rtol: float | None = None,
    adjoint_atol: float | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
    options: Mapping[str, Any] | None = None,
    stats: ODEStats | None = None,
    name: str = "odeint",
) -> torch.Tensor:
    """Solve ``dy/dt = func(t, y)``, ``y(t[0]) = y0`` at the times ``t``, differentiably.

    Implements the interpolated reverse dynamic method of Daulbaev, Katrutsa, Markeeva, Gusak,
    Cichocki and Oseledets, "Interpolation Technique to Speed Up Gradients Propagation in Neural
    ODEs" (NeurIPS 2020), next to direct backpropagation and the adjoint method, all on
    torchdiffeq's solvers.

    Args:
        func: Dynamics ``func(t, y)``; ``t`` a scalar tensor, ``y`` shaped like ``y0``; returns a
            tensor shaped like ``y``. Usually an ``nn.Module``.
        y0: Initial state, any shape, real floating dtype; must be finite.
        t: 1-D tensor of >= 2 output times, strictly increasing or strictly decreasing;
            ``t[0]`` is the initial time.
        grad: ``"backprop"``, ``"adjoint"`` or ``"interpolated"`` (see :mod:`ode.odeint`).
        method: torchdiffeq solver name. ``"interpolated"`` needs one with adaptive steps and
            dense output (``"dopri5"``, ``"dopri8"``, ``"bosh3"``, ``"fehlberg2"``,
            ``"adaptive_heun"``).
        rtol: Relative tolerance of the solver.
        atol: Absolute tolerance of the solver.
        n_nodes: Nodes stored per output interval by ``"interpolated"``: an odd integer in
            [3, 129]. Memory is ``n_nodes * (len(t) - 1)`` states.
        adjoint_params: Tensors ``func`` uses that need gradients, for ``"adjoint"`` and
            ``"interpolated"`` (default: ``func.parameters()``; required when ``func`` is not an
            ``nn.Module``). Tensors used by ``func`` but missing here get no gradient.
        on_interp_error: What ``"interpolated"`` does when the nested-grid error estimate of a
            segment exceeds ``interp_tol``: ``"warn"`` (warn and go on), ``"raise"``
            (:class:`~ode.errors.InterpolationError`), ``"refine"`` (bisect the segment and
            re-solve it, up to ``max_refine`` times; forward evaluations grow) or ``"fallback"``
            (re-integrate the state backwards on that segment, as the adjoint method does).
        interp_tol: Threshold of the estimate, a relative error: the ``(n_nodes+1)/2``-node
            sub-grid interpolant's largest error over the largest state entry of the segment
            (:func:`ode.interp.nested_error`). Default ``rtol**(1/3)``, calibrated so that the
            ``n_nodes`` interpolant's share of the gradient error stays below the solver's (see
            NOTE [ Default interp_tol ] in :mod:`ode.config`).
        max_refine: Bisections allowed per output interval by ``"refine"``.
        adjoint_rtol: Relative tolerance of the backward solve (default ``rtol``).
        adjoint_atol: Absolute tolerance of the backward solve (default ``atol``).
        max_steps: Step budget of each pass (forward, backward) of this call.
        options: Extra torchdiffeq solver options (e.g. ``{"max_step": 0.1}``).
        stats: An :class:`~ode.ODEStats` to fill with this call's function evaluations and
            error estimate (backward figures arrive when backward runs).
        name: Name of the caller in error messages (an ``ODEBlock`` passes its own).

    Returns:
        Tensor of shape ``(len(t), *y0.shape)``, the state at each time in ``t``. Gradients flow
        to ``y0``, ``t`` and ``adjoint_params``.

    Raises:
        TypeError: ``y0`` or ``t`` is not a floating-point tensor, or ``func`` is not callable.
        ValueError: bad settings, or ``t`` not strictly monotone / repeated, NaN/Inf in ``y0``,
            or output times too close to hold ``n_nodes`` distinct nodes (before any solve).
        ODESolveError: the solve blew up, its step size underflowed or it ran out of steps
            (forward or backward).
        InterpolationError: with ``on_interp_error="raise"``, a segment's estimate exceeded
            ``interp_tol``.

    Example:
        >>> func = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        >>> ode_func = lambda t, y: func(y)
        >>> y0 = torch.randn(8, 2, requires_grad=True)
        >>> ys = odeint(ode_func, y0, torch.tensor([0.0, 1.0]), rtol=1e-5, atol=1e-7,
        ...             adjoint_params=tuple(func.parameters()))
        >>> ys[-1].square().sum().backward()
    """
    config = SolveConfig(
        grad=grad, method=method, rtol=rtol, atol=atol, n_nodes=n_nodes,
        on_interp_error=on_interp_error, interp_tol=interp_tol, max_refine=max_refine,
        adjoint_rtol=adjoint_rtol, adjoint_atol=adjoint_atol, max_steps=max_steps,
        options={} if options is None else options)
    return solve(func, y0, t, config=config, adjoint_params=adjoint_params, stats=stats,
                 name=name)
