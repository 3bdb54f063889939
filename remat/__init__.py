"""remat: hierarchical rematerialization for PyTorch training steps.

Keep the activation memory of a training step under a budget at the least recomputation, with
exact gradients::

    import remat
    net = remat.rematerialize(net, batch, budget="50%")       # an equivalent nn.Module
    compiled = torch.compile(model, backend=remat.backend(budget="50%"))

Papers: HiRemate (Gusak et al., ICML 2025), Rockmate (Zhao et al., ICML 2023), Checkmate (Jain
et al., MLSys 2020), Rotor (Beaumont et al., 2019).
"""
from __future__ import annotations

from .dynamo_backend import DEFAULT_SOLVER, RematBackend, backend
from .budget import Budget, Reference, format_bytes, parse_budget
from .cache import PlanCache
from .estimate import MemoryReport, estimate
from .errors import CaptureError, InfeasibleBudgetError, RematError, ScheduleError, SolverError
from .graph import Op, Phase, RematGraph, Value, ValueKind
from .memory import MemoryTracker, track_memory
from .eager_step import measure_eager_step
from .module import RematModule, rematerialize
from .plan import Plan
from .schedule import Schedule, Simulation, simulate
from .settings import check_time_limit
from .solvers import SOLVERS

__all__ = [
    "Budget",
    "DEFAULT_SOLVER",
    "CaptureError",
    "InfeasibleBudgetError",
    "MemoryReport",
    "MemoryTracker",
    "Op",
    "Phase",
    "Plan",
    "PlanCache",
    "RematBackend",
    "RematError",
    "RematGraph",
    "RematModule",
    "Reference",
    "SOLVERS",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "SolverError",
    "Value",
    "ValueKind",
    "backend",
    "check_time_limit",
    "estimate",
    "format_bytes",
    "measure_eager_step",
    "parse_budget",
    "rematerialize",
    "simulate",
    "track_memory",
]
