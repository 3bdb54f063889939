"""Solvers: each one turns a :class:`Problem` into a :class:`SolveResult`.

``SOLVERS`` maps the names users pass as ``solver=...`` to solver classes; error messages list
its keys, so they never go stale.
"""
from __future__ import annotations

from .base import STATUSES, Problem, SolveResult, Solver
from .baselines import CheckpointSolver, SaveAllSolver
from .hierarchical import DPSolver, HierarchicalSolver
from .ilp import ILPSolver

__all__ = ["SOLVERS", "STATUSES", "Problem", "SolveResult", "Solver", "get_solver"]

SOLVERS: dict[str, type] = {
    cls.name: cls
    for cls in (HierarchicalSolver, ILPSolver, DPSolver, CheckpointSolver, SaveAllSolver)
}


def get_solver(name: str) -> Solver:
    """Instantiate the solver registered as ``name``.

    Raises:
        ValueError: naming the unknown solver and the registered ones.
    """
    if not isinstance(name, str) or name not in SOLVERS:
        raise ValueError(
            f"solver={name!r} is not a known solver; choose one of {sorted(SOLVERS)} "
            f"(e.g. solver={next(iter(SOLVERS))!r})"
        )
    return SOLVERS[name]()
