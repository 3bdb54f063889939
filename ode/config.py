"""Solver settings shared by :func:`ode.odeint` and :class:`ode.ODEBlock`, and the input checks
that run before any solve."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

import torch

from .nodes import MAX_NODES, MIN_NODES

__all__ = ["SolveConfig", "require_torchdiffeq", "check_t", "check_y0", "DEFAULT_N_NODES",
           "GRAD_METHOD_NAMES", "INTERP_ERROR_POLICY_NAMES"]

# The values ``grad`` and ``on_interp_error`` may take. The functions behind them live where they
# run (``ode.odeint.GRAD_METHODS``, ``ode.interpolated.INTERP_ERROR_POLICIES``), which check at
# import that they cover exactly these names; the settings are checked here, without importing
# the solvers (which import this module).
GRAD_METHOD_NAMES = ("backprop", "adjoint", "interpolated")
INTERP_ERROR_POLICY_NAMES = ("warn", "raise", "refine", "fallback")

# 17 stored nodes = a 9-node nested estimate. The prototype measured the interpolated gradient
# error reaching the adjoint's and backprop's at 12-16 nodes on MLP dynamics (dim 64, tol 1e-6);
# the count must be odd for the nested grid (NOTE [ Nested nodes ] in ode.nodes).
DEFAULT_N_NODES = 17
# NOTE [ Default interp_tol ]
#     The nested estimate c (ode.interp.nested_error) is the relative error of the
#     (n+1)/2-node sub-grid interpolant; the backward pass uses all n nodes, whose error is far
#     smaller. What matters is the share of the gradient error due to interpolation, g. Measured
#     on the benchmark's MLP dynamics (dim 64; benign, and contracting with lambda=20, T=1 and 2;
#     rtol 1e-3 and 1e-6; n = 5..65; g = relative distance to the n=129 gradient), g depended on
#     c alone, not on the tolerance: c = 0.011 -> g ~ 1e-8, 0.075 -> 3.4e-6, 0.19 -> 2.1e-4,
#     0.41 -> 1.1e-3, 0.55 -> 1.5e-2, i.e. g ~ c^3..c^4, while the solver's own gradient error
#     is ~rtol (7e-6..3e-5 at rtol=1e-3, 1e-8..1e-7 at rtol=1e-6). Keeping g <= rtol thus needs
#     c <= rtol^(1/3): the default threshold. It flagged every case above where g exceeded the
#     solver's error and none where g stayed well below it.
DEFAULT_INTERP_TOL_EXPONENT = 1.0 / 3.0
# How many times "refine" may halve a segment (up to 2**4 = 16 pieces per output interval).
DEFAULT_MAX_REFINE = 4
# Step budget per pass (forward, backward) of one call; torchdiffeq's own is 2**31 - 1, which in
# practice means "hang". A neural ODE needing more than this is diverging or stiff.
DEFAULT_MAX_STEPS = 100_000

# Solver options that would break the interpolated backward (it sets them itself, see
# NOTE [ Landing on segment ends ] in ode.interpolated).
_RESERVED_INTERP_OPTIONS = ("step_t", "jump_t", "first_step", "norm")


def require_torchdiffeq():
    """Import torchdiffeq, or fail with the install command."""
    try:
        import torchdiffeq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'ode needs torchdiffeq for its solvers; install it with pip install "hiremate[ode]"'
        ) from e
    return torchdiffeq


def _solver_registry() -> dict:
    from torchdiffeq._impl.odeint import SOLVERS

    return SOLVERS


def dense_output_methods() -> tuple[str, ...]:
    """torchdiffeq methods with adaptive steps and a dense-output interpolant (the ones the
    interpolated adjoint can record nodes from at no extra cost and land exactly with)."""
    require_torchdiffeq()
    from torchdiffeq._impl.rk_common import RKAdaptiveStepsizeODESolver

    return tuple(name for name, cls in _solver_registry().items()
                 if isinstance(cls, type) and issubclass(cls, RKAdaptiveStepsizeODESolver))


def _positive_float(name: str, value: Any, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite positive number; {hint}")
    return float(value)


def _positive_int(name: str, value: Any, hint: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}; {hint}")
    return int(value)


@dataclass(frozen=True)
class SolveConfig:
    """Validated settings of an ODE solve and its gradient method.

    See :func:`ode.odeint` for the meaning of each field. Build a changed copy with
    ``dataclasses.replace(config, grad="adjoint")`` (it is validated again).
    """

    grad: str = "interpolated"
    method: str = "dopri5"
    rtol: float = 1e-7
    atol: float = 1e-9
    n_nodes: int = DEFAULT_N_NODES
    on_interp_error: str = "warn"
    interp_tol: float | None = None
    max_refine: int = DEFAULT_MAX_REFINE
    adjoint_rtol: float | None = None
    adjoint_atol: float | None = None
    max_steps: int = DEFAULT_MAX_STEPS
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.grad not in GRAD_METHOD_NAMES:
            raise ValueError(f"grad={self.grad!r}: unknown gradient method; choose one of "
                             f"{', '.join(map(repr, GRAD_METHOD_NAMES))}")
        require_torchdiffeq()
        solvers = _solver_registry()
        if self.method not in solvers:
            raise ValueError(f"method={self.method!r}: not a torchdiffeq solver; choose one of "
                             f"{', '.join(map(repr, solvers))}")
        if self.grad == "interpolated" and self.method not in dense_output_methods():
            raise ValueError(
                f"method={self.method!r} with grad='interpolated': the interpolated adjoint needs "
                "an adaptive Runge-Kutta solver with dense output to record its nodes; choose one "
                f"of {', '.join(map(repr, dense_output_methods()))}, or grad='adjoint'")
        tol_hint = "pass e.g. rtol=1e-6, atol=1e-8"
        object.__setattr__(self, "rtol", _positive_float("rtol", self.rtol, tol_hint))
        object.__setattr__(self, "atol", _positive_float("atol", self.atol, tol_hint))
        for name in ("adjoint_rtol", "adjoint_atol"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _positive_float(
                    name, value, f"pass e.g. {name}=1e-6, or None to reuse {name[8:]}"))
        n = self.n_nodes
        if isinstance(n, bool) or not isinstance(n, Integral) or n < MIN_NODES or n > MAX_NODES \
                or n % 2 == 0:
            raise ValueError(
                f"n_nodes={n!r}: must be an odd integer in [{MIN_NODES}, {MAX_NODES}] (the "
                f"(n_nodes+1)/2 nested sub-grid gives the error estimate); pass e.g. "
                f"n_nodes={DEFAULT_N_NODES}, or add output times to split a long interval")
        object.__setattr__(self, "n_nodes", int(n))
        if self.on_interp_error not in INTERP_ERROR_POLICY_NAMES:
            raise ValueError(f"on_interp_error={self.on_interp_error!r}: choose one of "
                             f"{', '.join(map(repr, INTERP_ERROR_POLICY_NAMES))}")
        if self.interp_tol is not None:
            object.__setattr__(self, "interp_tol", _positive_float(
                "interp_tol", self.interp_tol,
                "it bounds a relative error; pass e.g. interp_tol=1e-2, or None for rtol**(1/3)"))
        object.__setattr__(self, "max_refine", _positive_int(
            "max_refine", self.max_refine, f"pass e.g. max_refine={DEFAULT_MAX_REFINE}",
            minimum=0))
        object.__setattr__(self, "max_steps", _positive_int(
            "max_steps", self.max_steps, f"pass e.g. max_steps={DEFAULT_MAX_STEPS}"))
        if self.options is None:
            object.__setattr__(self, "options", {})
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options={self.options!r}: must be a dict of torchdiffeq solver "
                             "options such as {'max_step': 0.1}, or None")
        if self.grad == "interpolated":
            reserved = sorted(set(self.options) & set(_RESERVED_INTERP_OPTIONS))
            if reserved:
                raise ValueError(
                    f"options has {reserved} with grad='interpolated': the interpolated backward "
                    "sets these itself; to respect a discontinuity of the dynamics, add its time "
                    "to t (segments never interpolate across an output time)")
        object.__setattr__(self, "options", dict(self.options))

    def replace(self, **changes: Any) -> "SolveConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def resolved_interp_tol(self) -> float:
        """``interp_tol``, or ``rtol**(1/3)`` when it is None (NOTE [ Default interp_tol ])."""
        if self.interp_tol is not None:
            return self.interp_tol
        return self.rtol ** DEFAULT_INTERP_TOL_EXPONENT

    @property
    def backward_rtol(self) -> float:
        return self.rtol if self.adjoint_rtol is None else self.adjoint_rtol

    @property
    def backward_atol(self) -> float:
        return self.atol if self.adjoint_atol is None else self.adjoint_atol


def check_t(t: Any) -> torch.Tensor:
    """Check the output times; returns them unchanged.

    Raises:
        TypeError: ``t`` is not a floating-point tensor.
        ValueError: ``t`` is not 1-D with >= 2 entries, has NaN/Inf, or is not strictly monotone.
    """
    if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t):
        raise TypeError(f"t={t!r}: must be a 1-D floating-point tensor of output times, e.g. "
                        "torch.tensor([0.0, 1.0])")
    if t.ndim != 1 or t.numel() < 2:
        raise ValueError(f"t has shape {tuple(t.shape)}: must be 1-D with at least 2 times (start "
                         "and end), e.g. torch.tensor([0.0, 1.0])")
    td = t.detach()
    if not bool(torch.isfinite(td).all()):
        raise ValueError(f"t={td.tolist()}: contains NaN or Inf; pass finite times")
    step = td[1:] - td[:-1]
    increasing = bool((step > 0).all())
    if not increasing and not bool((step < 0).all()):
        zero = (step == 0).nonzero()
        if zero.numel():
            i = int(zero[0])
            raise ValueError(f"t={td.tolist()}: t[{i}] == t[{i + 1}] == {float(td[i])!r} is "
                             "repeated; output times must be strictly increasing or strictly "
                             "decreasing, so drop the duplicate")
        raise ValueError(f"t={td.tolist()}: not monotone; output times must be strictly increasing "
                         "or strictly decreasing (sort them, e.g. t.sort().values)")
    return t


def check_y0(y0: Any) -> torch.Tensor:
    """Check the initial state; returns it unchanged.

    Raises:
        TypeError: ``y0`` is not a real floating-point tensor.
        ValueError: ``y0`` has NaN or Inf.
    """
    if not isinstance(y0, torch.Tensor) or not torch.is_floating_point(y0):
        kind = type(y0).__name__ if not isinstance(y0, torch.Tensor) else f"tensor of {y0.dtype}"
        raise TypeError(f"y0 ({kind}): must be a real floating-point tensor; for a tuple state, "
                        "concatenate the parts (torch.cat([a.flatten(), b.flatten()]))")
    bad = ~torch.isfinite(y0.detach())
    if bool(bad.any()):
        raise ValueError(f"y0 has {int(bad.sum())} NaN/Inf entries of {y0.numel()} (first at flat "
                         f"index {int(bad.flatten().nonzero()[0])}); the initial state must be "
                         "finite: check the layer before the ODE block")
    return y0
