"""Exceptions raised by :mod:`remat`, and the internal-invariant helper."""
from __future__ import annotations

from .budget import format_bytes

__all__ = [
    "RematError",
    "CaptureError",
    "InfeasibleBudgetError",
    "SolverError",
    "ScheduleError",
    "internal_assert",
]

_DEBUG_TIP = (
    "Debug tip: `remat.estimate(module, *example_args)` prints the baseline and the lowest "
    "feasible activation peak without solving."
)


class RematError(RuntimeError):
    """Base class of every error :mod:`remat` raises about a model, a budget or a schedule."""


class CaptureError(RematError):
    """The model could not be captured as one joint forward+backward graph.

    Attributes:
        reason: Short machine-readable reason (``"graph_break"``, ``"data_dependent"``,
            ``"unsupported_op"``, ``"no_grad"``, ``"other"``).
    """

    def __init__(self, message: str, *, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


class InfeasibleBudgetError(RematError):
    """No schedule keeps the step's activation peak under the budget.

    Attributes:
        budget_bytes: The budget asked for, in bytes.
        lower_bound_bytes: The lowest activation peak any schedule can reach (the peak that
            remains when everything that can be recomputed is recomputed).
        baseline_bytes: The peak of the unmodified (save-everything) step.
        solver: Name of the solver that gave up.
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        lower_bound_bytes: int,
        baseline_bytes: int,
        solver: str,
        detail: str = "",
    ) -> None:
        self.budget_bytes = budget_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.baseline_bytes = baseline_bytes
        self.solver = solver
        pct = 100.0 * lower_bound_bytes / max(baseline_bytes, 1)
        if budget_bytes < lower_bound_bytes:
            message = (
                f"budget {format_bytes(budget_bytes)} is below the lowest activation peak any "
                f"schedule can reach, {format_bytes(lower_bound_bytes)} ({pct:.0f}% of the "
                f"unmodified step's {format_bytes(baseline_bytes)}). Raise the budget to at least "
                f'"{int(pct) + 1}%", or shrink the batch.'
            )
        else:
            message = (
                f"solver {solver!r} found no schedule within the budget "
                f"{format_bytes(budget_bytes)} (the unmodified step peaks at "
                f"{format_bytes(baseline_bytes)}; no schedule can go below "
                f"{format_bytes(lower_bound_bytes)}). Try another solver "
                f"({', '.join(repr(s) for s in ('hierarchical', 'ilp', 'dp') if s != solver)}), a "
                "longer time_limit, or a higher budget."
            )
        if detail:
            message += f" {detail}"
        super().__init__(message + " " + _DEBUG_TIP)


class SolverError(RematError):
    """A solver failed for a reason other than an infeasible budget.

    Attributes:
        solver: Solver name.
        status: The solver's own status string (e.g. PuLP's ``"Not Solved"``).
    """

    def __init__(self, message: str, *, solver: str, status: str) -> None:
        super().__init__(f"{message} (solver {solver!r}, status {status!r}). {_DEBUG_TIP}")
        self.solver = solver
        self.status = status


class ScheduleError(RematError):
    """A schedule is invalid: an op would read a value that is not available at that point."""


def internal_assert(condition: bool, message: str) -> None:
    """Check an invariant of this project; failing it is a bug in hiremate, not user error."""
    if not condition:
        raise AssertionError(
            f"hiremate internal error: {message}. This is a bug in hiremate; please report it "
            "with the model and the remat call that triggered it."
        )
