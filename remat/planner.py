"""From a joint graph with costs to a checked schedule and its :class:`Plan`."""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import replace
from typing import Sequence

from .budget import Budget, Reference, format_bytes
from .errors import InfeasibleBudgetError, internal_assert
from .experts import one_op_note
from .graph import RematGraph
from .liveness import peak_lower_bound
from .plan import Plan
from .schedule import (Schedule, on_demand_schedule, remake_views, save_all_schedule, simulate,
                       tidy)
from .solvers import Problem, get_solver
from .solvers.baselines import least_memory_schedule

__all__ = ["checkpoint_schedule", "crawls", "describe", "faster_at_that_peak",
           "least_memory_schedule", "plan_graph"]

log = logging.getLogger(__name__)


def _best_of(result, offered, budget_bytes: int):
    """The solver's result, or a fitting candidate schedule that is faster (or found where the
    solver found nothing)."""
    solved = result.schedule is not None and result.status != "infeasible"
    best_time = result.simulation.time if solved else float("inf")
    winner = None
    for schedule, sim, name in offered:
        if sim.peak_bytes <= budget_bytes and sim.time < best_time:
            best_time, winner = sim.time, (schedule, sim, name)
    if winner is None:
        return result
    schedule, sim, name = winner
    why = "faster than the solver's schedule" if solved else "the solver found none"
    return replace(result, schedule=schedule, simulation=sim, status="feasible",
                   detail=(result.detail + "; " if result.detail else "") + f"{name}: {why}")


# A rescue schedule this many times slower than the unmodified step is worth a warning, and
# where it is the lowest peak, one more solve (NOTE [ The fastest at the lowest peak ]).
_CRAWL = 2.0


def crawls(time_s: float, baseline_time_s: float) -> bool:
    """Whether a schedule taking ``time_s`` crawls next to the unmodified step's time."""
    return time_s >= _CRAWL * baseline_time_s



def _warn_if_crawling(result, offered, baseline) -> None:
    """Warn when only the least-memory rescue fits (NOTE [ Advice that can be followed ]) and
    it is much slower than the unmodified step: on a Mamba-style scan at 50% it takes 105x the
    step time, while per-block checkpointing needs 5% more memory at 1.7x. Say both."""
    if not result.detail.endswith("least-memory fallback: the solver found none"):
        return
    ratio = result.simulation.time / baseline.time
    if not crawls(result.simulation.time, baseline.time):
        return
    message = (f"remat: only the least-memory schedule fits the budget; each step will take "
               f"{ratio:.1f}x the unmodified step's time")
    faster = [(sim.peak_bytes, sim.time, name) for _, sim, name in offered
              if sim.time < _CRAWL * baseline.time]
    if faster:
        peak, time_, name = min(faster)
        message += (f"; {name.replace(' fallback', '')} needs {format_bytes(peak)} at "
                    f"{time_ / baseline.time:.2f}x: a budget of at least that is far faster")
    warnings.warn(message, stacklevel=3)


def _block_checkpointing(graph: RematGraph, solver: str) -> list:
    """Checkpointing every block (``solver="checkpoint"``) as a fallback schedule."""
    if solver == "checkpoint":
        return []
    result = get_solver("checkpoint").solve(Problem(graph, 0, time_limit=1.0))
    if result.schedule is None:
        return []
    return [(result.schedule, simulate(graph, result.schedule), "block checkpointing fallback")]


def _lowest(graph: RematGraph, result, offered, baseline):
    """NOTE [ Nothing fits: the lowest peak ]
    Where no schedule fits (a later size family, after the example fitted), the step runs the
    lowest-peak schedule of all it was offered: the solver's, the unmodified step, the user's
    own checkpointing and the rescues (least memory, per-block checkpointing), fastest first at
    equal peak, as :class:`~remat.sizes.ShapePlans` does for later sizes of a family. Only the
    solver's lowest and the unmodified step were compared before: HF Mamba at T=48 under
    "3.7MiB" (after an example at T=32 that fitted) ran 9.86 MiB where the least-memory
    schedule peaks at 5.36 MiB, under a warning calling it the lowest-peak schedule found."""
    options = [(save_all_schedule(graph), baseline, "the unmodified step"), *offered]
    if result.schedule is not None and result.simulation is not None:
        options.append((result.schedule, result.simulation, f"solver {result.solver!r}"))
    schedule, sim, name = min(options, key=lambda o: (o[1].peak_bytes, o[1].time))
    return replace(result, schedule=schedule, simulation=sim, status="over_budget",
                   detail=(result.detail + "; " if result.detail else "") +
                   f"over budget: {name.replace(' fallback', ' schedule')}, the lowest peak")


def faster_at_that_peak(graph: RematGraph, sim, baseline_time: float, *, solver: str,
                        time_limit: float, options: dict | None = None):
    """NOTE [ The fastest at the lowest peak ]
    Where nothing fits and the lowest peak is a rescue that crawls (the least-memory schedule
    recomputes every value before each read), the solver is asked once more, for that peak:
    its own schedules rarely reach it from a budget they cannot meet, but at the peak itself
    they often do, at a fraction of the time. HF Mamba at T=48 under "3.7MiB" (bound 3.74 MiB):
    the least-memory schedule peaks at 5.36 MiB at 41x the step's time; the hierarchy at that
    peak finds 5.35 MiB at 1.63x, in one more solve of ~8 s. Returns the faster schedule and
    its simulation, or ``None`` where the solver found none at that peak or none faster
    (``sim`` is the lowest schedule's simulation)."""
    if solver == "none" or not crawls(sim.time, baseline_time):
        return None
    again = get_solver(solver).solve(Problem(graph, sim.peak_bytes, time_limit=time_limit,
                                             options=dict(options or {})))
    found = again.simulation
    if again.schedule is None or again.status == "infeasible" or found is None or \
            found.peak_bytes > sim.peak_bytes or found.time >= sim.time:
        return None
    return again.schedule, found


def checkpoint_schedule(graph: RematGraph, tags: Sequence[object]) -> Schedule | None:
    """The schedule the model's own ``torch.utils.checkpoint`` calls ask for, or ``None``.

    NOTE [ The user's checkpointing is a candidate ]
    A model whose blocks call ``torch.utils.checkpoint`` already runs a schedule in eager: the
    joint graph marks the forward ops inside each checkpointed region (``tags[i]``: the region's
    id, ``None`` outside any). That schedule saves everything but those ops' outputs and reruns
    a whole region when backward first needs one of its values, as eager does. Its peak is the
    user's eager peak (the budget's reference), so it is always offered next to the solver's
    answer: the faster one that fits wins, and a budget the user's own step meets never fails.
    """
    regions: dict[object, list[int]] = {}
    for i in graph.forward_ops:
        if tags[i] is not None and graph.ops[i].recomputable:
            regions.setdefault(tags[i], []).append(i)
    if not regions:
        return None
    inside = {v for ops in regions.values() for i in ops for v in graph.ops[i].outputs}
    everything = save_all_schedule(graph)
    saved = frozenset(everything.saved - inside)
    return tidy(graph, remake_views(graph, on_demand_schedule(graph, saved,
                                                              list(regions.values()))))


def describe(graph: RematGraph, schedule: Schedule, sim, baseline, *, budget_bytes: int,
             solver: str, status: str, solve_time_s: float = 0.0,
             lower_bound_bytes: int | None = None, detail: str = "",
             cache_hit: bool = False, reference: Reference | None = None) -> Plan:
    """The :class:`Plan` of ``schedule`` on ``graph``: every number from the simulations given."""
    base_time = baseline.time or 1e-12
    step, outside = reference.at(baseline.peak_bytes) if reference is not None else (0, 0)
    one_op = one_op_note([op.signature for op in graph.ops])
    if one_op and one_op not in detail:
        detail = f"{detail}; {one_op}" if detail else one_op
    return Plan(
        baseline_bytes=baseline.peak_bytes,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_overhead=max(0.0, (sim.time - baseline.time) / base_time),
        solver=solver,
        status=status,
        solve_time_s=solve_time_s,
        lower_bound_bytes=peak_lower_bound(graph) if lower_bound_bytes is None
        else lower_bound_bytes,
        baseline_time_s=baseline.time,
        saved_bytes=sim.saved_bytes,
        num_ops=len(graph.ops),
        num_recomputed=schedule.recompute_count(graph),
        cache_hit=cache_hit,
        detail=detail,
        eager_bytes=int(round(step - outside)),
        outside_bytes=int(round(outside)),
        fingerprint=schedule.fingerprint(),
    )


def plan_graph(
    graph: RematGraph,
    budget: Budget,
    *,
    solver: str,
    time_limit: float,
    options: dict | None = None,
    over_budget: str = "raise",
    reference: Reference | None = None,
    candidates: Sequence[tuple[Schedule, str]] = (),
) -> tuple[Plan, Schedule]:
    """Solve ``graph`` under ``budget`` and check the result with the simulator.

    Returns:
        The :class:`Plan` and the schedule to generate code for.

    Args:
        over_budget: ``"raise"`` an :class:`InfeasibleBudgetError` when nothing fits, or use the
            ``"lowest"``-peak schedule found (status ``"over_budget"``, with a warning).
        reference: What the user measures (NOTE [ A budget is what the user measures ]); the
            budget applies to the captured step's own unmodified peak without one.
        candidates: Other schedules and their names (NOTE [ The user's checkpointing is a
            candidate ]): the fastest of these and the solver's answer that fits is used.

    Raises:
        InfeasibleBudgetError: if the budget is below what any schedule can reach, or the solver
            found no schedule within it (with ``over_budget="raise"``).
    """
    started = time.perf_counter()
    baseline = simulate(graph, save_all_schedule(graph))
    budget_bytes = budget.resolve(baseline.peak_bytes, reference)
    lower = peak_lower_bound(graph)
    step, outside = reference.at(baseline.peak_bytes) if reference is not None else (None, 0)
    offered = [(schedule, simulate(graph, schedule), name) for schedule, name in candidates]
    if budget_bytes < lower and over_budget == "raise":
        raise InfeasibleBudgetError(budget_bytes=budget_bytes, lower_bound_bytes=lower,
                                    baseline_bytes=baseline.peak_bytes, solver=solver,
                                    best_bytes=min([least_memory_schedule(graph)[1].peak_bytes,
                                                    *(sim.peak_bytes for _, sim, _ in offered)]),
                                    step_bytes=step, outside_bytes=outside)
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
        result = _best_of(result, offered, budget_bytes)
        if result.status == "infeasible" or result.schedule is None:
            # NOTE [ Advice that can be followed ]: the least-memory schedule (recompute every
            # value right before it is read) is a real schedule; when it fits, it is an answer,
            # so a budget advised from its peak always works. Block checkpointing is tried too:
            # where the solver gave up in its time (HF GPT-2 at 50%), it fits at a fraction of
            # the least-memory schedule's recomputation (+31% vs +990% step time).
            fallback, fallback_sim = least_memory_schedule(graph)
            rescue = [(fallback, fallback_sim, "least-memory fallback"),
                      *_block_checkpointing(graph, solver)]
            offered = [*offered, *rescue]
            result = _best_of(result, rescue, budget_bytes)
        if (result.status == "infeasible" or result.schedule is None) and over_budget != "raise":
            result = _lowest(graph, result, offered, baseline)
            faster = faster_at_that_peak(graph, result.simulation, baseline.time,
                                         solver=solver, time_limit=time_limit, options=options)
            if faster is not None:
                result = replace(result, schedule=faster[0], simulation=faster[1],
                                 detail=result.detail + f"; solver {solver!r} at that peak: "
                                 "faster")
            slower = result.simulation.time / baseline.time if baseline.time > 0 else 1.0
            warnings.warn(
                f"remat: no schedule fits {format_bytes(budget_bytes)} for this input shape; "
                f"running the lowest-peak schedule found, "
                f"{format_bytes(result.simulation.peak_bytes)}, predicted at {slower:.1f}x the "
                f"unmodified step's time (the unmodified step needs "
                f"{format_bytes(baseline.peak_bytes)}). Use a smaller batch or a larger budget "
                "for this shape.",
                stacklevel=2,
            )
        elif result.status == "infeasible" or result.schedule is None:
            best = min(sim.peak_bytes for _, sim, _ in offered)
            if result.schedule is not None and result.simulation is not None:
                best = min(best, result.simulation.peak_bytes)
            raise InfeasibleBudgetError(
                budget_bytes=budget_bytes, lower_bound_bytes=lower,
                baseline_bytes=baseline.peak_bytes, solver=solver, best_bytes=best,
                detail=f"({result.detail})" if result.detail else "",
                step_bytes=step, outside_bytes=outside,
            )
        schedule, sim, status, name, detail = (result.schedule, result.simulation, result.status,
                                               result.solver, result.detail)
        solve_time = result.solve_time_s
        _warn_if_crawling(result, offered, baseline)
    internal_assert(sim.peak_bytes <= budget_bytes or status == "over_budget",
                    "solver returned a schedule over budget")
    plan = describe(graph, schedule, sim, baseline, budget_bytes=budget_bytes, solver=name,
                    status=status, solve_time_s=solve_time, lower_bound_bytes=lower,
                    detail=detail, reference=reference)
    log.debug("remat plan:\n%s", plan.summary())
    return plan, schedule
