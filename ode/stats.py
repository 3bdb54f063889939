"""Per-call statistics, and the wrapper that counts function evaluations and checks every step.

NOTE [ Statistics without side effects inside autograd ]
    The custom autograd.Function of the interpolated adjoint keeps no counters of its own. Each
    call of :func:`ode.odeint` creates one :class:`ODEStats` (or fills the one the caller passes)
    and one :class:`MonitoredFunc` around the user's dynamics that writes into it; the forward
    figures are filled by plain code after the forward solve, and the backward pass's evaluations
    land in the same container when (and if) backward runs, because the backward solve calls the
    dynamics through the same wrapper. Nothing is stored on the user's modules: an
    :class:`~ode.ODEBlock` merely keeps a reference to the last call's container
    (``block.last_stats``), which is assigned outside the Function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import ODESolveError, _finite_or_nan

__all__ = ["ODEStats", "MonitoredFunc"]


@dataclass
class ODEStats:
    """What one ODE call did. Forward fields are set when the call returns; backward fields
    grow when its backward pass runs.

    Attributes:
        grad: Gradient method used (``"backprop"``, ``"adjoint"`` or ``"interpolated"``).
        method: torchdiffeq solver.
        forward_nfe: Evaluations of the dynamics in the forward pass (refinement included).
        backward_nfe: Evaluations of the dynamics in the backward pass (0 for backprop, which
            differentiates the recorded solver graph instead; 0 until backward runs).
        forward_steps: Solver steps attempted in the forward pass (accepted and rejected).
        backward_steps: Solver steps attempted in the backward pass.
        interp_error: Largest nested-grid error estimate over the interpolated segments, a
            relative error (:func:`ode.interp.nested_error`); ``None`` unless
            ``grad="interpolated"`` stored a trajectory.
        segments: Number of stored segments (output intervals, plus any bisections).
        refined: Segments bisected by ``on_interp_error="refine"``.
        fallback_segments: Segments whose backward pass re-integrates the state
            (``on_interp_error="fallback"``).
        stored_bytes: Bytes of forward state kept for the backward pass by the ODE method itself
            (interpolated: the node values; adjoint: the outputs). ``None`` for backprop, whose
            storage is the solver's autograd graph (measure it with saved-tensor hooks).
    """

    grad: str
    method: str
    forward_nfe: int = 0
    backward_nfe: int = 0
    forward_steps: int = 0
    backward_steps: int = 0
    interp_error: float | None = None
    segments: int | None = None
    refined: int = 0
    fallback_segments: int = 0
    stored_bytes: int | None = None


class MonitoredFunc:
    """Wraps the user's dynamics for one call: counts evaluations per phase and checks each step.

    torchdiffeq calls ``callback_step(t0, y0, dt)`` before every step attempt (and
    ``callback_step_adjoint`` in its adjoint's backward solve); we raise :class:`ODESolveError`
    there when the state is non-finite, the step size underflowed or the step budget is spent —
    before torchdiffeq's own bare ``assert``s, which vanish under ``python -O``.

    Args:
        func: The dynamics ``func(t, y) -> dy/dt``.
        stats: Container the counts go into.
        block: Name used in error messages.
        max_steps: Step budget of each phase.
    """

    def __init__(self, func: Callable, stats: ODEStats, *, block: str, max_steps: int):
        self.func = func
        self.stats = stats
        self.block = block
        self.max_steps = max_steps
        self.phase = "forward"

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.phase == "forward":
            self.stats.forward_nfe += 1
        else:
            self.stats.backward_nfe += 1
        return self.func(t, y)

    def start_backward(self) -> None:
        """Count every later evaluation and step as backward-pass work."""
        self.phase = "backward"

    def callback_step(self, t0, y0, dt) -> None:
        """Called by torchdiffeq before each step attempt; raises on a failing solve."""
        if self.phase == "forward":
            self.stats.forward_steps += 1
            steps = self.stats.forward_steps
        else:
            self.stats.backward_steps += 1
            steps = self.stats.backward_steps
        t_f, dt_f = _finite_or_nan(t0), _finite_or_nan(dt)
        reason = None
        if steps > self.max_steps:
            reason = (f"the step budget is spent (max_steps={self.max_steps} per pass); "
                      "raise max_steps if the solve is just long")
        elif not (dt_f > 0) or t_f + dt_f == t_f:
            reason = "the step size underflowed (the solver cannot make progress)"
        elif not _all_finite(y0):
            reason = "the state is not finite (NaN or Inf)"
        if reason is not None:
            raise ODESolveError(block=self.block, phase=self.phase, t=t_f, dt=dt_f, steps=steps,
                                reason=reason)

    # torchdiffeq's adjoint looks the backward solve's callbacks up under these names
    callback_step_adjoint = callback_step


class RecordingFunc(MonitoredFunc):
    """A :class:`MonitoredFunc` that also records the accepted steps ``(t0, dt)`` of the forward
    solve, from which the interpolated adjoint picks the first step of each backward solve."""

    def __init__(self, func: Callable, stats: ODEStats, *, block: str, max_steps: int):
        super().__init__(func, stats, block=block, max_steps=max_steps)
        self.accepted: list[tuple[float, float]] = []

    def callback_accept_step(self, t0, y0, dt) -> None:
        if self.phase == "forward":
            self.accepted.append((float(t0), float(dt)))


def _all_finite(y) -> bool:
    if isinstance(y, torch.Tensor):
        return bool(torch.isfinite(y).all())
    return all(_all_finite(part) for part in y)
