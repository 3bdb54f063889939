"""Exact scheduling by integer linear programming (Checkmate, Jain et al., MLSys 2020).

NOTE [ The ILP ]
Backward ops run once each in their usual order; the decisions are which forward values to save
(``s[v]``), and, before each backward op that reads forward values (a *stage* t), which forward
ops to recompute (``R[t, i]``) and which forward values are still alive (``K[t, v]``):

* ``K[0, v] <= s[v]``; ``K[t+1, v] <= K[t, v] + R[t, producer(v)]`` (nothing appears from nowhere);
* every forward value stage t reads: ``K[t, v] + R[t, producer(v)] >= 1``;
* every input u of a recomputed op: ``K[t, u] + R[t, producer(u)] >= R[t, i]`` (recomputations
  within a stage run in forward order, which is topological);
* views are not variables: a view made from one activation (``view``, ``transpose``, ``detach``,
  ``getitem`` of ``split``...) is *anchored* at its base and remade for free right before it is
  read; views of parameters are always available (:func:`anchors`);
* memory at each stage: storages kept or recomputed there plus the schedule-independent backward
  memory at that op (:mod:`remat.liveness`) <= budget; between stages, what is kept for the next
  stage plus the backward memory there <= budget; at each forward op, the saved values produced
  so far plus forward's own live values <= budget.

The objective is the recomputation time. Values recomputed within a stage are counted as alive
for the whole stage, so the model is conservative: the simulated peak of the extracted schedule
is never above what the ILP accounted for. Random and impure ops are never recomputed
(``R`` is fixed to 0), so their outputs are saved when backward needs them.
Variables are created only where they can matter (a value can be kept at stage t only if some
stage at or after t may read it), which keeps one transformer layer in a few thousand binaries.
Beyond ``max_variables`` the ILP is refused with a message pointing to ``"hierarchical"``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import ClassVar

import pulp

from ..errors import SolverError
from ..graph import RematGraph, ValueKind
from ..liveness import liveness
from ..schedule import Schedule, forward_ops_needed, remake_views, save_all_schedule, tidy
from .base import Problem, SolveResult, finish, time_cut
from .mip import _binary_factory, make_mip_solver, step_gap
from .pool import submit_cancellable, thread_pool, wait_cancellable, workers

__all__ = ["ILPSolver", "solve_many"]

log = logging.getLogger(__name__)

_DEFAULT_MAX_VARIABLES = 60_000


def anchors(graph: RematGraph) -> list[int | None]:
    """For each value, the value the ILP reasons about instead (see NOTE [ The ILP ]).

    A view made by a recomputable op from one activation (and sizes: a ``view`` of a
    dynamic-shape graph reads ``SymInt``s) is anchored at its base (it can be remade for free
    whenever the base is alive, and keeping it keeps the base's storage); a view of a graph
    input anchors at ``None`` (always available); any other activation is its own anchor.
    Non-activations: ``None``. (A view reading a size was its own anchor, of 0 bytes, until
    the 4-block ViT showed it: the model saw 0.77 of the step's peak kept where the schedule
    kept 0.95, the whole ``addmm`` each such view pins, and every ILP schedule broke the
    budget.)
    """
    values, ops, nf = graph.values, graph.ops, graph.num_forward
    anchor: list[int | None] = [None] * len(values)
    for v, value in enumerate(values):
        if value.kind is not ValueKind.ACTIVATION or not 0 <= value.producer < nf:
            continue
        op = ops[value.producer]
        base = value.alias_of
        if base is not None and op.recomputable and all(
            u == base or values[u].kind is ValueKind.INPUT or values[u].scalar
            for u in op.inputs
        ):
            anchor[v] = anchor[base] if values[base].kind is ValueKind.ACTIVATION else None
        else:
            anchor[v] = v
    return anchor


class _Model:
    """The ILP of NOTE [ The ILP ] for one graph and budget."""

    objective_scale = 1e6  # the objective counts microseconds of recomputation

    def __init__(self, graph: RematGraph, budget: int, save_budget: int | None = None) -> None:
        self.graph = graph
        self.save_budget = save_budget
        live = liveness(graph)
        values, ops = graph.values, graph.ops
        bwd = list(graph.backward_ops)
        self.anchor = anchor = anchors(graph)

        def deps(i: int) -> set[int]:
            return {anchor[u] for u in ops[i].inputs if anchor[u] is not None}

        needs = [{anchor[v] for v in live.needs[k] if anchor[v] is not None} for k in range(len(bwd))]
        self.stages = [k for k in range(len(bwd)) if needs[k]]
        self.needs = needs
        # Ancestors of what each stage reads; suffix unions give the candidate variables.
        ancestors: list[set[int]] = []
        for k in self.stages:
            seen: set[int] = set()
            stack = [values[v].producer for v in needs[k]]
            while stack:
                i = stack.pop()
                if i in seen:
                    continue
                seen.add(i)
                stack.extend(values[u].producer for u in deps(i))
            ancestors.append(seen)
        n = len(self.stages)
        cand_ops: list[set[int]] = [set() for _ in range(n)]
        cand_vals: list[set[int]] = [set() for _ in range(n)]
        acc_ops: set[int] = set()
        acc_vals: set[int] = set()
        for t in reversed(range(n)):
            acc_ops |= {i for i in ancestors[t] if ops[i].recomputable}
            acc_vals |= needs[self.stages[t]]
            for i in ancestors[t]:
                acc_vals |= deps(i)
                acc_vals.update(v for v in ops[i].outputs if anchor[v] == v)
            cand_ops[t] = set(acc_ops)
            cand_vals[t] = set(acc_vals)
        self.num_variables = sum(len(c) for c in cand_ops) + sum(len(c) for c in cand_vals) + (
            len(cand_vals[0]) if n else 0)
        self.cand_ops, self.cand_vals, self.deps = cand_ops, cand_vals, deps
        self.live, self.budget = live, budget
        self.bwd = bwd

    def build(self) -> pulp.LpProblem:
        graph, live, budget = self.graph, self.live, self.budget
        values, ops = graph.values, graph.ops
        n = len(self.stages)
        prob = pulp.LpProblem("remat", pulp.LpMinimize)
        w0 = sorted(self.cand_vals[0]) if n else []
        binary = _binary_factory(prob)
        self.s = s = {v: binary(f"s_{v}") for v in w0}
        self.K = K = [{v: binary(f"K_{t}_{v}") for v in sorted(self.cand_vals[t])} for t in range(n)]
        self.R = R = [{i: binary(f"R_{t}_{i}") for i in sorted(self.cand_ops[t])} for t in range(n)]

        # Numerics: times in microseconds, bytes in units of budget/1e7 rounded up (right-hand
        # sides rounded down), so the MIP's coefficients stay in a range its tolerances handle;
        # the rounding only makes the model more conservative (by < 0.1% of the budget).
        unit = max(1, budget // 10_000_000)

        def kib(nbytes: int) -> int:
            return -(-int(nbytes) // unit)

        def cap(nbytes: int) -> int:
            return int(nbytes) // unit

        def made(t: int, v: int):
            """R[t, producer(v)] if that variable exists, else None."""
            return R[t].get(values[v].producer)

        def either(t: int, v: int):
            r = made(t, v)
            return K[t][v] + r if r is not None else K[t][v]

        scale = self.objective_scale
        prob += pulp.lpSum(scale * ops[i].recompute_cost * var for t in range(n) for i, var in R[t].items())
        for v, var in s.items():
            prob += K[0][v] <= var
        for t in range(n):
            for v, var in K[t].items():
                if t + 1 < n and v in K[t + 1]:
                    prev = made(t, v)
                    prob += K[t + 1][v] <= (var + prev if prev is not None else var)
            for v in self.needs[self.stages[t]]:
                prob += either(t, v) >= 1
            for i, var in R[t].items():
                for u in self.deps(i):
                    prob += either(t, u) >= var
            kept = [(var, kib(values[v].nbytes)) for v, var in K[t].items() if values[v].nbytes]
            remade = [(var, kib(sum(values[v].nbytes for v in ops[i].outputs)))
                      for i, var in R[t].items()]
            prob += pulp.LpAffineExpression(kept + [(x, c) for x, c in remade if c]) <= cap(
                budget - live.backward_base[self.stages[t]])
        # Gaps between stages: what is kept for the next stage + backward memory there.
        previous = -1
        for t, k in enumerate(self.stages):
            gap = [live.backward_base[j] for j in range(previous + 1, k)]
            if gap:
                kept = [(var, kib(values[v].nbytes)) for v, var in K[t].items() if values[v].nbytes]
                prob += pulp.LpAffineExpression(kept) <= cap(budget - max(gap))
            previous = k
        if self.save_budget is not None:  # bytes kept from forward to backward
            prob += pulp.LpAffineExpression(
                [(var, kib(values[v].nbytes)) for v, var in s.items() if values[v].nbytes]
            ) <= cap(self.save_budget)
        # Forward: saved values produced so far + forward's own live values.
        root = graph.storage_root
        produced: list[int] = []
        for i in graph.forward_ops:
            live_here = live.forward_live[i]
            fixed = sum(values[r].nbytes for r in live_here)
            terms = [(s[v], kib(values[v].nbytes)) for v in produced if root[v] not in live_here]
            if terms or fixed + ops[i].workspace > budget:
                prob += pulp.LpAffineExpression(terms) <= cap(budget - fixed - ops[i].workspace)
            produced.extend(v for v in ops[i].outputs if v in s and values[v].nbytes)
        return prob

    def extract(self) -> Schedule:
        graph = self.graph
        saved = frozenset(v for v, var in self.s.items() if (var.value() or 0) > 0.5)
        stage_of = {k: t for t, k in enumerate(self.stages)}
        backward: list[int] = []
        for k, b in enumerate(self.bwd):
            t = stage_of.get(k)
            if t is not None:
                backward.extend(sorted(i for i, var in self.R[t].items() if (var.value() or 0) > 0.5))
            backward.append(b)
        draft = Schedule(forward_ops_needed(graph, saved), saved, tuple(backward))
        return tidy(graph, remake_views(graph, draft))


class ILPSolver:
    """Optimal schedule by ILP (PuLP; HiGHS when installed, else CBC). See NOTE [ The ILP ].

    Options (``Problem.options``):
        max_variables: refuse graphs whose model would exceed this many binaries
            (default 60,000); use the hierarchical solver for those.
        save_budget: also bound the bytes kept from forward to backward (used to build the
            options of a block, see :mod:`remat.solvers.options`).
        max_nodes: bound the MIP's branch-and-bound nodes (HiGHS), for results that do not
            depend on machine load.
        msg: print the MIP solver's log (default ``False``).
    """

    name: ClassVar[str] = "ilp"

    def solve(self, problem: Problem) -> SolveResult:
        started = time.perf_counter()
        graph = problem.graph
        model = _Model(graph, problem.budget_bytes, problem.options.get("save_budget"))
        limit = int(problem.options.get("max_variables", _DEFAULT_MAX_VARIABLES))
        if model.num_variables > limit:
            # A limit the user can act on, not a crash: raised as such, not as "a bug"
            raise SolverError(
                f"this graph needs {model.num_variables} binary variables for the whole-graph "
                f"ILP, more than max_variables={limit}; use solver='hierarchical' (built for "
                "large graphs) or raise options={'max_variables': ...}",
                solver="ilp", status="too_large")
        if not model.stages:  # backward reads no activation: nothing to decide
            return finish(self.name, problem, save_all_schedule(graph), started, proven=True)
        prob = model.build()
        remaining = problem.time_limit - (time.perf_counter() - started)
        mip = make_mip_solver(remaining, msg=bool(problem.options.get("msg", False)),
                              max_nodes=problem.options.get("max_nodes"),
                              gap_abs=step_gap(graph, model.objective_scale))
        prob.solve(mip)
        status = pulp.LpStatus[prob.status]
        solution = pulp.constants.LpSolution.get(prob.sol_status, str(prob.sol_status))
        backend = "HiGHS" if isinstance(mip, pulp.HiGHS) else "CBC"
        detail = f"{backend}: {status} / {solution}; {model.num_variables} binaries"
        has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        if not has_solution:
            fallback = save_all_schedule(graph)
            result = finish(self.name, problem, fallback, started, proven=False,
                            detail=detail + "; no ILP solution, fell back to save-all")
            if result.status != "infeasible" and prob.status != pulp.LpStatusInfeasible:
                return result
            return finish(self.name, problem, fallback, started, proven=False,
                          detail=detail + "; no schedule within the budget")
        schedule = model.extract()
        proven = prob.sol_status == pulp.LpSolutionOptimal
        return finish(self.name, problem, schedule, started, proven=proven, detail=detail,
                      timed_out=not proven)


def solve_many(problems: list[Problem], *, deadline: float | None = None
               ) -> list[SolveResult | None]:
    """:class:`ILPSolver` on each of ``problems``, at once (NOTE [ Independent MIPs at once ]).

    A problem's time limit is capped by ``deadline`` when it starts; one that would start past
    it is not solved (``None``, reported with :func:`~remat.solvers.base.time_cut`). Ctrl-C
    cancels them all and is raised here.
    """
    count = workers()
    if len(problems) <= 1 or count == 1:
        return [_solve_before(p, deadline) for p in problems]
    pool = thread_pool("remat-mip", count)
    cancel = threading.Event()
    futures = [submit_cancellable(pool, cancel, _solve_before, p, deadline) for p in problems]
    wait_cancellable(futures, cancel)
    return [f.result() for f in futures]


def _solve_before(problem: Problem, deadline: float | None) -> SolveResult | None:
    limit = problem.time_limit
    if deadline is not None:
        limit = min(limit, deadline - time.perf_counter())
        if limit < 0.05:
            time_cut("block options not computed")
            return None
    return ILPSolver().solve(dataclasses.replace(problem, time_limit=limit))
