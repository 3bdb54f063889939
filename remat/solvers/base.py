"""The solver interface: plain data in, a frozen result out.

A solver receives a :class:`Problem` (a :class:`~remat.graph.RematGraph` with measured times,
a budget in bytes and a time limit) and returns a :class:`SolveResult`. It never sees an fx
graph and never mutates its input, so every solver can be tested from a literal table.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from ..graph import RematGraph
from ..schedule import Schedule, Simulation, simulate

__all__ = ["Problem", "SolveResult", "Solver", "STATUSES", "describe_cuts", "finish", "time_cut",
           "watch_time_cuts"]

# "optimal": proven best for the solver's model; "feasible": within budget, not proven best;
# "time_limit": the time limit stopped the search, the best schedule found is returned;
# "infeasible": no schedule within the budget was found (``schedule`` is the lowest-memory
# schedule the solver knows, for the error message).
STATUSES = ("optimal", "feasible", "time_limit", "infeasible")


@dataclass(frozen=True)
class Problem:
    """What a solver is asked.

    Attributes:
        graph: The joint graph, with op times filled in.
        budget_bytes: Upper bound on the simulated activation peak.
        time_limit: Seconds the solver may spend (always honoured).
        options: Solver-specific knobs (documented by each solver).
    """

    graph: RematGraph
    budget_bytes: int
    time_limit: float = 60.0
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SolveResult:
    """A solver's answer.

    Attributes:
        solver: Name of the solver.
        status: One of :data:`STATUSES`.
        schedule: The schedule (``None`` only if the solver produced nothing at all).
        simulation: Its simulated peak and time.
        objective: Recomputation seconds the schedule adds.
        solve_time_s: Wall time of the solve.
        detail: Free text for humans (solver status, gap, fallbacks taken).
    """

    solver: str
    status: str
    schedule: Schedule | None
    simulation: Simulation | None
    objective: float
    solve_time_s: float
    detail: str = ""


class Solver(Protocol):
    """A scheduling algorithm. Implementations are registered in :data:`remat.solvers.SOLVERS`."""

    name: ClassVar[str]

    def solve(self, problem: Problem) -> SolveResult:  # pragma: no cover - protocol
        ...


def finish(name: str, problem: Problem, schedule: Schedule, started: float, *,
           proven: bool, detail: str = "", timed_out: bool = False,
           simulation: Simulation | None = None) -> SolveResult:
    """Simulate ``schedule`` (unless its ``simulation`` is given) and wrap it into a
    :class:`SolveResult` with the right status."""
    sim = simulation or simulate(problem.graph, schedule)
    if sim.peak_bytes > problem.budget_bytes:
        status = "infeasible"
    elif timed_out:
        status = "time_limit"
    else:
        status = "optimal" if proven else "feasible"
    return SolveResult(
        solver=name,
        status=status,
        schedule=schedule,
        simulation=sim,
        objective=sim.recompute_time,
        solve_time_s=time.perf_counter() - started,
        detail=detail,
    )


# NOTE [ Work bounds and the time cap ]
# Every part of a solve is bounded by work, not by the clock: MIPs by branch-and-bound nodes,
# polishing by trials, the hierarchy by its fixed list of runs. A solve that finishes within its
# time limit therefore gives the same schedule on an idle and on a busy machine, and the same
# schedule under any other time limit it also finishes within. ``time_limit`` stays a hard cap:
# where it stops work (a MIP at its time limit, a hierarchy or ILP not started, polishing cut
# short), the part reports it here, and the solve reports status ``"time_limit"`` with what was
# cut in its detail: its schedule may then differ from run to run.
_CUTS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("remat_time_cuts",
                                                                     default=None)


def time_cut(what: str) -> None:
    """Record that the time cap stopped ``what`` (see NOTE [ Work bounds and the time cap ])."""
    cuts = _CUTS.get()
    if cuts is not None:
        cuts[what] += 1


@contextlib.contextmanager
def watch_time_cuts():
    """Collect :func:`time_cut` records made in this block (a ``Counter``: what -> times)."""
    cuts: Counter = Counter()
    token = _CUTS.set(cuts)
    try:
        yield cuts
    finally:
        _CUTS.reset(token)


def describe_cuts(cuts: Counter) -> str:
    """``"cut by the time limit: 2 MIPs stopped, polishing"``, or ``""`` when nothing was."""
    if not cuts:
        return ""
    parts = [what if n == 1 else f"{what} (x{n})" for what, n in sorted(cuts.items())]
    return "cut by the time limit: " + ", ".join(parts)
