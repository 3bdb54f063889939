"""Setting up a MIP solver for the ILPs: HiGHS (through PuLP) when ``highspy`` is installed, else
PuLP's bundled CBC; gaps, node bounds, a quiet stdout, and cancelling a MIP running in another
thread. The models themselves are in :mod:`remat.solvers.ilp` and :mod:`remat.solvers.dag`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
import threading

import pulp

try:
    import highspy
except ImportError:  # PuLP's CBC is used instead (make_mip_solver)
    highspy = None

from ..graph import RematGraph
from .base import time_cut

__all__ = ["CANCEL_MIPS", "MIP_REL_GAP", "MIP_STEP_GAP", "SolveCancelled", "make_mip_solver",
           "quiet_stdout", "step_gap"]


# Relative MIP gap at which a solution counts as optimal: 0.5% of the recomputation time
# (the hierarchical solver is held to within 3% of this optimum).
MIP_REL_GAP = 5e-3
# NOTE [ The gap that matters ]: ... or within this share of the graph's whole step time (its
# ops' time, forward and backward). The objective is recomputation only, often a few percent of
# the step, so 0.5% of it asks the MIP to tell schedules apart by 0.01% of a step: HiGHS then
# spends most of its root node on cuts proving what it found early (a Mamba block's MIPs,
# 8.8 s -> 6.5 s; a GPT layer's, 2.9 s -> 2.0 s, with options equal within 0.2%). The step
# time is what the user pays, so that is what the gap is measured against: 1% of it, well
# inside the cost model's own error. From 0.5% to 1%, 16 solves (GPT-6 x2, GPT-24, a 2-layer
# GPT, ViT-4 x2, T5, U-Net, MLP, Mamba-style scan at 50% and 33%) gave the same schedules (GPT-24:
# +5.86% instead of +5.85%) in 0.1-0.9 s less (GPT-6 3.9 -> 3.35 s, GPT-24 5.4 -> 4.5 s, the
# GPT layer's peak-limited MIP 2.2-2.4 -> 1.8 s).
MIP_STEP_GAP = 1e-2


# NOTE [ Branching when nodes are few ]: HiGHS picks branching variables by pseudo-costs, each
# first made reliable by strong branching (``mip_pscost_minreliable``, 8 LP solves per candidate
# per direction). Under a bound of a few dozen nodes that initialisation is most of the work: a
# GPT layer's peak-limited MIP (50 nodes) took 2.4 s, half of it strong branching, for 1,052 us
# of recomputation where 107 nodes find 683. Branching on pseudo-costs from the first node, the
# same 50 nodes take 1.4 s and find 819. Over 258 MIPs of seven models' solves at 50%, the 20
# with a 50-node bound: 0.2-1.1 s less on the slow ones, none worse; GPT-6 solves 3.1-3.3 s ->
# 2.0-2.2 s (+7.03% -> +6.78% step time at 50%, the same at 70%/33%), GPT-12 3.4 -> 2.6 s. Not
# with larger bounds: a ViT's leaf MIPs (500 nodes) took up to 2x longer for the same answers,
# the block ILP's (solved at the root) were unchanged.
_FEW_NODES = 100


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface, with two fixes.

    * One more status: when ``mip_max_nodes`` stops the search HiGHS reports
      ``kSolutionLimit``, which PuLP 3.3 has no entry for (``KeyError`` after the variables were
      already filled in). Reported like PuLP reports a time limit.
    * Ctrl-C: HiGHS runs in C and Python sees a ``SIGINT`` only when it returns (up to the whole
      time limit: 88 s measured). It runs in highspy's solver thread instead, while this thread
      waits in short slices; on ``KeyboardInterrupt`` the solve is cancelled through HiGHS's
      interrupt callbacks and the interrupt is raised again once HiGHS has stopped.
    """

    def createAndConfigureSolver(self, lp):  # noqa: N802 - PuLP's name
        with quiet_stdout(not self.msg):
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp):  # noqa: N802 - PuLP's name
        model = lp.solverModel
        if not hasattr(model, "cancelSolve"):  # highspy < 1.7: no interrupt callbacks
            return super().callSolver(lp)
        cancel = CANCEL_MIPS.get()
        if cancel is not None and cancel.is_set():
            raise SolveCancelled
        # Our own thread, not highspy's startSolve: its locks are class attributes, so two
        # MIPs could not run at once (the exact ILP runs beside the hierarchy's MIPs).
        model.HandleUserInterrupt = True
        done = threading.Event()

        def run() -> None:
            try:
                model.run()
            finally:
                done.set()

        threading.Thread(target=run, name="remat-highs", daemon=True).start()
        try:
            while not done.wait(0.05):
                if cancel is not None and cancel.is_set():
                    raise SolveCancelled
        except (KeyboardInterrupt, SolveCancelled):
            model.cancelSolve()
            done.wait()
            raise
        if model.getModelStatus() == highspy.HighsModelStatus.kTimeLimit:
            time_cut("MIP stopped at its time limit")

    def findSolutionValues(self, lp):  # noqa: N802 - PuLP's name
        try:
            return super().findSolutionValues(lp)
        except KeyError:
            info = lp.solverModel.getInfo()
            if info.primal_solution_status == 2 and math.isfinite(info.objective_function_value):
                return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def make_mip_solver(time_limit: float, *, msg: bool = False, max_nodes: int | None = None,
                    gap_abs: float | None = None) -> pulp.LpSolver:
    """HiGHS when ``highspy`` is installed (much faster), else PuLP's bundled CBC.

    ``max_nodes`` bounds the branch-and-bound work (HiGHS only): unlike a time limit, the answer
    then does not depend on how busy the machine is; a bound of at most ``_FEW_NODES`` also
    turns strong branching off (NOTE [ Branching when nodes are few ]). ``gap_abs``: an
    absolute gap in objective units at which a solution is also optimal (beside the relative
    ``MIP_REL_GAP``).
    """
    limit = max(1.0, float(time_limit))
    extra = {"mip_max_nodes": int(max_nodes)} if max_nodes is not None else {}
    if max_nodes is not None and max_nodes <= _FEW_NODES:
        extra["mip_pscost_minreliable"] = 0  # NOTE [ Branching when nodes are few ]
    highs = _HiGHS(msg=msg, timeLimit=limit, threads=1, gapRel=MIP_REL_GAP, gapAbs=gap_abs,
                   **extra)
    if highs.available():
        return highs
    return pulp.PULP_CBC_CMD(msg=msg, timeLimit=int(limit) + 1, threads=1, gapRel=MIP_REL_GAP,
                             gapAbs=gap_abs)


def step_gap(graph: RematGraph, objective_scale: float, share: float = MIP_STEP_GAP) -> float:
    """NOTE [ The gap that matters ]: ``share`` of ``graph``'s step time (its ops' time, forward
    and backward), in the units of an objective that counts seconds times ``objective_scale``:
    the absolute gap at which a MIP's solution is good enough."""
    return objective_scale * share * sum(op.time for op in graph.ops)


_QUIET_LOCK = threading.Lock()
_quiet_depth = 0
_quiet_saved: int | None = None


@contextlib.contextmanager
def quiet_stdout(enabled: bool = True):
    """Silence C-level stdout (HiGHS prints a banner when it is created, before any option).

    File descriptor 1 is process-wide and MIPs may be created in two threads at once (the
    hierarchical solver runs the exact ILP beside the hierarchy), so the redirection is counted:
    the first block in saves and redirects, the last one out restores.
    """
    global _quiet_depth, _quiet_saved
    if not enabled:
        yield
        return
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            sys.stdout.flush()
            _quiet_saved = os.dup(1)
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 1)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                os.dup2(_quiet_saved, 1)
                os.close(_quiet_saved)
                _quiet_saved = None


# Set by a solve that runs MIPs in other threads: setting the event cancels them
# (their ``callSolver`` raises :class:`SolveCancelled`).
CANCEL_MIPS: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "remat_mip_cancel", default=None)


class SolveCancelled(Exception):
    """A MIP stopped because the solve that started it was interrupted (Ctrl-C)."""


def _binary_factory(prob: pulp.LpProblem):
    """Binary variables attached to ``prob`` (PuLP >= 3.3's API; older PuLP: free variables)."""
    if hasattr(prob, "add_variable"):
        return lambda name: prob.add_variable(name, 0, 1, cat=pulp.LpBinary)
    return lambda name: pulp.LpVariable(name, cat=pulp.LpBinary)
