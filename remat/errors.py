"""Exceptions raised by :mod:`remat`, and the internal-invariant helper."""
from __future__ import annotations

import math

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
        lower_bound_bytes: A proven bound: no schedule can peak lower (it need not be reachable).
        baseline_bytes: The peak of the unmodified (save-everything) step.
        solver: Name of the solver that gave up.
        best_bytes: The lowest peak of a schedule actually found (reachable), or ``None``.
        advised_budget: A budget that works, as the user would write it (``"44%"``, at most
            ``"100%"``), or ``None`` when no schedule found is below the step's peak.
    """

    def __init__(
        self,
        *,
        budget_bytes: int,
        lower_bound_bytes: int,
        baseline_bytes: int,
        solver: str,
        best_bytes: int | None = None,
        detail: str = "",
        step_bytes: float | None = None,
        outside_bytes: float = 0,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.baseline_bytes = baseline_bytes
        self.solver = solver
        self.best_bytes = best_bytes
        # Percentages are of what the user measures: the whole eager step (NOTE [ A budget is
        # what the user measures ]); without a measurement, of the unmodified captured step.
        measured = step_bytes is not None
        whole = max(step_bytes if measured else baseline_bytes, 1)
        what = "the eager step's measured" if measured else "the unmodified step's"

        def percent(module_bytes: float) -> float:
            return 100 * (module_bytes + outside_bytes) / whole

        bound = (f"no schedule can go below {format_bytes(lower_bound_bytes)} "
                 f"({percent(lower_bound_bytes):.0f}% of {what} {format_bytes(whole)}; a proven "
                 "bound, not always reachable)")
        if outside_bytes:
            bound += (f"; the step spends {format_bytes(outside_bytes)} outside the module, "
                      "charged against the budget")
        pct = None if best_bytes is None else math.ceil(percent(best_bytes) - 1e-9)
        reachable = best_bytes is not None and best_bytes < baseline_bytes
        if reachable and pct <= 100:
            self.advised_budget: str | None = f"{pct}%"
            advice = (f"the lowest peak reached is {format_bytes(best_bytes)}: raise the budget "
                      f'to "{pct}%" (or "{int(best_bytes + outside_bytes)}B"), or shrink the '
                      "batch")
        else:
            self.advised_budget = None
            advice = (f"no schedule found peaks below {what} peak: remat cannot save memory on "
                      'this model at this size; use budget="100%" or shrink the batch')
        if budget_bytes < lower_bound_bytes:
            message = f"budget {format_bytes(budget_bytes)} is below what any schedule can reach: {bound}; {advice}."
        else:
            message = (f"solver {solver!r} found no schedule within the budget "
                       f"{format_bytes(budget_bytes)} ({bound}); {advice}.")
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
