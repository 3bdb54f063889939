"""From a joint graph with costs to a checked schedule and its :class:`Plan`."""
from __future__ import annotations

import logging
import time
import warnings

from .budget import Budget, format_bytes
from .errors import InfeasibleBudgetError, internal_assert
from .graph import RematGraph
from .liveness import peak_lower_bound
from .plan import Plan
from .schedule import Schedule, save_all_schedule, simulate
from .solvers import Problem, get_solver

__all__ = ["plan_graph"]

log = logging.getLogger(__name__)


def _lowest(graph: RematGraph, result):
    """The solver's lowest-peak schedule, or the unmodified one if that is lower."""
    from dataclasses import replace

    everything = save_all_schedule(graph)
    sim = simulate(graph, everything)
    if result.schedule is None or sim.peak_bytes <= result.simulation.peak_bytes:
        return replace(result, schedule=everything, simulation=sim, status="over_budget")
    return replace(result, status="over_budget")


def plan_graph(
    graph: RematGraph,
    budget: Budget,
    *,
    solver: str,
    time_limit: float,
    options: dict | None = None,
    over_budget: str = "raise",
) -> tuple[Plan, Schedule]:
    """Solve ``graph`` under ``budget`` and check the result with the simulator.

    Returns:
        The :class:`Plan` and the schedule to generate code for.

    Args:
        over_budget: ``"raise"`` an :class:`InfeasibleBudgetError` when nothing fits, or use the
            ``"lowest"``-peak schedule found (status ``"over_budget"``, with a warning).

    Raises:
        InfeasibleBudgetError: if the budget is below what any schedule can reach, or the solver
            found no schedule within it (with ``over_budget="raise"``).
    """
    started = time.perf_counter()
    baseline = simulate(graph, save_all_schedule(graph))
    budget_bytes = budget.resolve(baseline.peak_bytes)
    lower = peak_lower_bound(graph)
    if budget_bytes < lower and over_budget == "raise":
        raise InfeasibleBudgetError(budget_bytes=budget_bytes, lower_bound_bytes=lower,
                                    baseline_bytes=baseline.peak_bytes, solver=solver)
    if budget_bytes >= baseline.peak_bytes:
        # Nothing to save: the unmodified step already fits.
        schedule, sim, status, name, detail = save_all_schedule(graph), baseline, "optimal", solver, \
            "the unmodified step fits the budget"
        solve_time = time.perf_counter() - started
    else:
        try:
            result = get_solver(solver).solve(
                Problem(graph, budget_bytes, time_limit=time_limit, options=dict(options or {})))
        except Exception:
            log.debug("graph that made solver %r fail: %s", solver, graph.summary())
            raise
        if (result.status == "infeasible" or result.schedule is None) and over_budget != "raise":
            result = _lowest(graph, result)
            warnings.warn(
                f"remat: no schedule fits {format_bytes(budget_bytes)} for this input shape; "
                f"running the lowest-peak schedule found ({format_bytes(result.simulation.peak_bytes)}"
                f", the unmodified step needs {format_bytes(baseline.peak_bytes)})",
                stacklevel=2,
            )
        elif result.status == "infeasible" or result.schedule is None:
            best = result.simulation.peak_bytes if result.simulation else lower
            raise InfeasibleBudgetError(
                budget_bytes=budget_bytes, lower_bound_bytes=lower,
                baseline_bytes=baseline.peak_bytes, solver=solver,
                detail=f"Its best schedule peaks at {format_bytes(best)} ({result.detail}).",
            )
        schedule, sim, status, name, detail = (result.schedule, result.simulation, result.status,
                                               result.solver, result.detail)
        solve_time = result.solve_time_s
    internal_assert(sim.peak_bytes <= budget_bytes or status == "over_budget",
                    "solver returned a schedule over budget")
    base_time = baseline.time or 1e-12
    plan = Plan(
        baseline_bytes=baseline.peak_bytes,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_overhead=max(0.0, (sim.time - baseline.time) / base_time),
        solver=name,
        status=status,
        solve_time_s=solve_time,
        lower_bound_bytes=lower,
        baseline_time_s=baseline.time,
        saved_bytes=sim.saved_bytes,
        num_ops=len(graph.ops),
        num_recomputed=schedule.recompute_count(graph),
        detail=detail,
    )
    log.debug("remat plan:\n%s", plan.summary())
    return plan, schedule
