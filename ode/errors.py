"""Errors raised by :mod:`ode`: a failed solve, an interpolation that is not accurate enough, and
the internal-assert helper for our own invariants."""
from __future__ import annotations

import math

__all__ = ["ODESolveError", "InterpolationError", "internal_assert"]

_SOLVE_TIP = (
    "the dynamics probably blew up or are too stiff for an explicit solver; check the scale of the "
    "initial state and of the network's weights, loosen rtol/atol, or raise max_steps if the solve "
    "is merely long"
)


class ODESolveError(RuntimeError):
    """An ODE solve failed: the state became non-finite, the step size underflowed or the step
    budget ran out.

    Attributes:
        block: Name of the block (or ``"odeint"`` for a direct call) whose solve failed.
        phase: ``"forward"`` or ``"backward"``.
        t: Time (in the caller's time coordinate) at the start of the failing step.
        dt: Step size the solver was about to take (``nan`` if unknown).
        steps: Steps attempted in this phase before the failure.
        reason: What went wrong, in words.
    """

    def __init__(self, *, block: str, phase: str, t: float, dt: float, steps: int, reason: str):
        self.block = block
        self.phase = phase
        self.t = t
        self.dt = dt
        self.steps = steps
        self.reason = reason
        super().__init__(
            f"ODE solve failed in {block} during the {phase} pass at t={t:.6g} with step size "
            f"{dt:.3g} after {steps} steps: {reason}. Tip: {_SOLVE_TIP}."
        )

    def __reduce__(self):  # keep the keyword-only constructor picklable (DDP, multiprocessing)
        return (_rebuild_solve_error, (self.block, self.phase, self.t, self.dt, self.steps,
                                       self.reason))


def _rebuild_solve_error(block, phase, t, dt, steps, reason):
    return ODESolveError(block=block, phase=phase, t=t, dt=dt, steps=steps, reason=reason)


class InterpolationError(RuntimeError):
    """The nested-grid estimate says the stored nodes do not resolve the trajectory well enough
    (raised with ``on_interp_error="raise"``, or by ``"refine"`` when refinement runs out).

    Attributes:
        block: Name of the block (or ``"odeint"``).
        interval: ``(start, end)`` of the worst segment, in the caller's time coordinate.
        estimate: Its error estimate (relative error of the nested sub-grid interpolant, see
            :func:`ode.interp.nested_error`).
        interp_tol: The threshold it exceeded.
        n_nodes: Nodes stored per segment.
    """

    def __init__(self, *, block: str, interval: tuple[float, float], estimate: float,
                 interp_tol: float, n_nodes: int, detail: str = ""):
        self.block = block
        self.interval = interval
        self.estimate = estimate
        self.interp_tol = interp_tol
        self.n_nodes = n_nodes
        super().__init__(
            f"{block}: the interpolation error estimate on [{interval[0]:.6g}, {interval[1]:.6g}] "
            f"is {estimate:.3g} (relative error of the {(n_nodes + 1) // 2}-node sub-grid), above "
            f"interp_tol={interp_tol:.3g}{detail}; store more nodes (n_nodes={2 * n_nodes - 1} "
            f"instead of {n_nodes}), add output times to split the interval, pass "
            f'on_interp_error="refine" to bisect it automatically, or "fallback" to use the '
            f"adjoint method there"
        )

    def __reduce__(self):
        return (_rebuild_interp_error, (self.block, self.interval, self.estimate,
                                        self.interp_tol, self.n_nodes))


def _rebuild_interp_error(block, interval, estimate, interp_tol, n_nodes):
    return InterpolationError(block=block, interval=interval, estimate=estimate,
                              interp_tol=interp_tol, n_nodes=n_nodes)


def internal_assert(condition: bool, message: str) -> None:
    """Check one of this package's own invariants (never user input).

    Raises:
        RuntimeError: if ``condition`` is false; the message says it is a bug in hiremate.
    """
    if not condition:
        raise RuntimeError(
            f"internal error in hiremate's ode package (this is a bug, please report it): {message}"
        )


def _finite_or_nan(value) -> float:
    """A float for error messages, whatever the solver handed us."""
    try:
        out = float(value.detach()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError, RuntimeError):
        return math.nan
    return out
