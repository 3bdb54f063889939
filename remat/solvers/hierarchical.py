"""The hierarchical solver (HiRemate, Gusak et al., ICML 2025; Rockmate, Zhao et al., ICML 2023).

NOTE [ Hierarchical solving ]
1. *Structure* (:mod:`remat.segments`): the forward is cut into a chain of segments along the
   module tree (a transformer's layers, a ResNet's blocks), splitting any segment too big for the
   exact ILP into its child modules or, for flat graphs, at the cheapest cuts in forward order.
   Each segment gets the backward ops that differentiate it (its *region*).
2. *Options*: each distinct segment (identical layers share one solve) gets a Pareto set of
   options from the exact ILP under a grid of limits on bytes kept
   (:mod:`remat.solvers.options`; which blocks are leaves: :mod:`remat.solvers.blocks`).
3. *Upper level*: the chain DP (:mod:`remat.solvers.chain`) picks each segment's option and
   which segment inputs to store or recompute, for every memory capacity at once. Where
   storages cross several segments (skip connections), the block ILP
   (:mod:`remat.solvers.dag`, HiRemate's formulation over the same options) also solves the
   level (for the region rule whose chain DP did best, NOTE [ Block ILPs in the background ]),
   and the faster of the two schedules that fit is kept.
4. *Merge and check*: the DP's actions become one schedule (each region's backward with the
   recomputations it needs before it); what must be saved is what backward reads before
   recomputing it. The simulator is the judge: we search the DP capacity for the fastest
   schedule whose simulated peak fits the budget, since the DP's memory model is approximate.
5. *Polish* (:mod:`remat.solvers.polish`): the memory the coarse upper level leaves unused is
   spent greedily on keeping recomputed values, each change checked by the simulator.

The solve runs a fixed list of hierarchies (two region rules; for small graphs a second, fine
top level, NOTE [ Fine and coarse top levels ]; keep/recompute-only options), and for graphs
whose whole ILP is small, that ILP where no hierarchy fits (NOTE [ The exact ILP beside the
hierarchy ]); block ILPs run in the background (NOTE [ Block ILPs in the background ]). Where
none of those fits, the least-memory schedules (NOTE [ Least memory within blocks ]) are
polished as candidates. The fastest schedule that fits wins. Every part is bounded by work, so
an uncut solve's schedule does not depend on the machine's load
(NOTE [ Work bounds and the time cap ]).
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Callable, ClassVar

from ..graph import RematGraph
from ..schedule import save_all_schedule
from ..segments import REGION_RULES, chain_structure
from ..subgraph import extract_subgraph
from .baselines import CheckpointSolver, least_memory_schedules
from .base import Problem, SolveResult, describe_cuts, finish, time_cut, watch_time_cuts
from .blocks import BlockContext, SharedCaches
from .chain import solve_chain
from .dag import block_dag, solve_block_dag
from .ilp import ILPSolver, _Model
from .pool import submit_cancellable, thread_pool, wait_cancellable
from .polish import polish
from .progress import SolveProgress
from .upper import chain_stages, search_capacity

__all__ = ["HierarchicalSolver", "DPSolver"]

_SLOTS = 600
# Graphs whose whole ILP is this small are also solved exactly, where no hierarchy fits (NOTE
# [ The exact ILP beside the hierarchy ]). Above it the exact solve costs
# more than it finds: a 2-layer GPT (3,919 binaries) took 16-19 s for +8.0%/+18.6% step time at
# 70%/50% where the fine hierarchy (below) finds +7.2%/+17.4% in 4 s; a 1-layer GPT (1,364
# binaries) takes 2.7 s and beats the hierarchies (+9.0% vs +13.3% at 70%).
_TOP_ILP_VARIABLES = 2_500
_TOP_ILP_SHARE = 0.25  # of the time limit, for that exact solve (it finds its optimum early)
# ... and a bound on its work, so that the same graph gets the same schedule on a busy machine
# (the time cap remains a safety net; DDP ranks share rank 0's plan through the cache anyway).
_TOP_ILP_NODES = 300
# NOTE [ Fine and coarse top levels ]: a small graph is also solved with its top level cut at
# leaf size (every segment at most ``leaf_ops`` forward ops, each with exact ILP options): the
# chain DP then weighs every trade-off across a transformer layer's attention and MLP at full
# resolution, which composed options only approximate (2-layer GPT at 50%: +17.4% step time vs
# +27.9% for the coarse hierarchy with mid-block ILPs, +18.6% for the whole-graph ILP after
# 19 s). Past this many segments the chain DP's slots are too coarse for the fine level (24-layer
# GPT: 197 segments, +13.1% vs +7.5%, and 3x the time), so large graphs keep the coarse one.
_FINE_MAX_SEGMENTS = 32
_HEADROOM = 1.6  # the DP table covers capacities up to this multiple of the budget
_DAG_MAX_BLOCKS = 40  # the block ILP (NOTE [ The block ILP ]) has O(blocks^2 * options) binaries
# ... about blocks * (options + crossing storages) of them: 1,108 for a U-Net (13 blocks, est.
# 936), where one MIP takes 0.1-2 s; 16,256 for a Mamba-style scan (37 blocks, 380 storages
# crossing them: est. 20,572), where each MIP hit its 10 s limit and found +235% step time.
_DAG_MAX_VARIABLES = 6_000
# Trials of the greedy polish (NOTE [ Polishing a schedule ]): a count, not a time, so the same
# graph gets the same schedule on a busy machine. Each trial simulates the whole graph, so the
# count shrinks as graphs grow (a bound on simulated ops, not trials): 300 up to ~1,700 ops,
# 146 at GPT-24's 3,419, 73 at GPT-48's 6,803, 50 beyond. 300 trials were half the solve on
# GPT-48 (30 of 60 s); GPT-24 finds the same schedules with 146 as with 292 (50%, 33%).
_POLISH_TRIALS = 300
_POLISH_OPS = 500_000
# NOTE [ Polishing the finalists ]: polishing cost up to ~300 simulations (5-8 s on a 3,400-op
# graph, before the simulator got 2.5x faster and polishing learnt to stop after a run of
# misses: now 40-60 simulations, 0.3-1 s) and moved no candidate past another on the large
# benchmark models (GPT-24 at 50%/33%: +0.01-0.4% each), so only the best schedule and a
# runner-up within 1% of it are polished: GPT-24's solve 40 s -> 20 s, same schedule. Where a
# polish is cheap (its trials are not cut by ``_POLISH_OPS``: graphs below ~1,700 ops) the
# three fastest schedules are polished, however far behind the best: on a small Mamba-style
# scan at 50% the raw chain DP (+360%) polished to +110% while the best raw one (+333%)
# polished to +327%, and on a U-Net at 45% of its peak a raw +93.8% (20% behind the best raw
# +68.3%, outside the 10% window this rule used to have) polished to +10.2% where the best
# polished to +37.8%. Near the lower bound the raw schedules keep much less than fits, so how
# fast they are says little about how fast they polish. No time seen on the MLP, U-Net, ViT,
# GPTs or the T5-small config at 70/50/33%, same schedules.
_POLISH_RUNNER_UP = 1.01
_POLISH_CHEAP_FINALISTS = 3


class HierarchicalSolver:
    """Recursive chain DP over the module tree, with exact ILP options for small leaf blocks.

    See NOTE [ Hierarchical solving ]. Options (``Problem.options``):
        leaf_ops: blocks with at most this many forward ops are leaves (default 40).
        max_block_ops: largest segment kept whole when cutting a level (default 120).
        option_time_limit: seconds per leaf ILP solve (default: a share of ``time_limit``).
        progress: show one progress bar per solve over its phases (default ``True``).
        block_ilp: where storages cross several top-level blocks (a U-Net's skips), also solve
            the upper level with the block ILP (NOTE [ The block ILP ]; default ``True``).
        exact_top: also solve the whole graph with the exact ILP (NOTE [ The exact ILP beside
            the hierarchy ]): ``"auto"`` (default) where no hierarchy finds a schedule that fits
            and its model has at most 2,500 binaries; ``True`` always, beside the hierarchy,
            keeping the faster schedule; ``False`` never.
    """

    name: ClassVar[str] = "hierarchical"
    use_ilp: ClassVar[bool] = True

    def solve(self, problem: Problem) -> SolveResult:
        started = time.perf_counter()
        deadline = started + problem.time_limit
        graph = problem.graph
        exact_top = problem.options.get("exact_top", "auto")
        if exact_top not in ("auto", True, False):
            raise ValueError(f"exact_top={exact_top!r}: expected 'auto', True or False")
        exact_top = exact_top if self.use_ilp else False
        tops = (_top_levels(graph, problem.options) if self.use_ilp
                else [int(problem.options.get("max_block_ops", 120))])
        runs = [(top, rule, self.use_ilp) for top in tops for rule in REGION_RULES]
        if self.use_ilp:
            # The coarse hierarchies with keep-all/keep-nothing options only: cheap, and their
            # DP model is sometimes the more accurate one at very low budgets.
            runs += [(tops[0], rule, False) for rule in REGION_RULES]
        bar = SolveProgress(bool(problem.options.get("progress", True)),
                            len(runs) + int(exact_top is True), problem.time_limit)
        with watch_time_cuts() as cuts:
            try:
                found = self._candidates(problem, runs, tops, exact_top, deadline, bar)
            finally:
                bar.close()
            if not any(map(_fits, found)):
                # Below the hierarchies' floor: the least-memory schedules, polished as theirs
                # are (NOTE [ Least memory within blocks ]).
                found += [finish(name, problem, schedule, time.perf_counter(), proven=False,
                                 simulation=sim, detail="every value recomputed before each read")
                          for name, schedule, sim in least_memory_schedules(graph)]
            feasible = sorted(filter(_fits, found), key=lambda r: r.simulation.time)
            if not feasible:
                lowest = min((r for r in found if r.schedule is not None),
                             key=lambda r: r.simulation.peak_bytes)
                cut = describe_cuts(cuts)
                return finish(self.name, problem, lowest.schedule, started, proven=False,
                              detail=f"{lowest.solver}: {lowest.detail}" + (f"; {cut}" if cut else ""))
            finalists = _finalists(feasible, graph)
            polished = [(r, polish(graph, r.schedule, problem.budget_bytes, deadline=deadline,
                                   max_trials=_polish_trials(graph), simulation=r.simulation))
                        for r in finalists]
        best, (schedule, _) = min(polished, key=lambda item: item[1][1].time)
        cut = describe_cuts(cuts)
        return finish(self.name, problem, schedule, started, proven=False,
                      detail=f"{best.solver}: {best.detail}" + (f"; {cut}" if cut else ""),
                      timed_out=bool(cuts) or time.perf_counter() > deadline)

    def _candidates(self, problem: Problem, runs: list[tuple[int, str, bool]], tops: list[int],
                    exact_top: bool | str, deadline: float, bar: "SolveProgress"
                    ) -> list[SolveResult]:
        """Every hierarchy's schedules, and the exact ILP's where it is used, unpolished.

        NOTE [ The exact ILP beside the hierarchy ]: by default (``exact_top="auto"``) the
        whole-graph ILP is solved only where no hierarchy (nor per-block checkpointing) fits
        the budget, near the lower bound, after them, and only if its model is small
        (``_TOP_ILP_VARIABLES``; counting them is quadratic in the graph, so it is done only
        then). Started beside the hierarchies from the start, it took the second core from
        their MIPs (a 1-layer GPT's solve 1.5 s -> 2.4 s) for an ILP rarely used.
        ``exact_top=True`` runs it in a second thread from the start and keeps the faster
        schedule (``hier+ilp`` in ``python -m benchmarks.remat_solvers quality``): it cost
        7-15 s on graphs the hierarchy solves in 0.4-3.5 s and found at most 1.1 points less
        overhead (U-Net at 70%: +5.0% vs +6.1%; 2-layer GPT: +6.2% vs +6.7%; 12-layer MLP:
        +4.3% vs +4.6%; nothing on a ViT, a 1-layer GPT or any 50%/30% budget). With it
        beside, the hierarchy used to skip its mid-block ILP options and could end slower than
        the hierarchy alone (MLP at 30%: +32.5% vs +29.5%).
        Both are bounded by work, and whether the ILP is used depends only on the hierarchy's
        schedules, so which one wins does not depend on timing.
        """
        found: list[SolveResult] = []
        caches = SharedCaches()
        cancel = threading.Event()
        later: list[concurrent.futures.Future] = []  # NOTE [ Block ILPs in the background ]
        pending: list[tuple[list[SolveResult], Callable[[], list[SolveResult]]]] = []

        def start_block_ilps() -> None:
            for solve_level in _block_ilps_to_run(pending):
                later.append(submit_cancellable(thread_pool("remat-block-ilp", 2), cancel,
                                                solve_level))
            pending.clear()

        def exact_ilp() -> concurrent.futures.Future:
            limit = min(0.8, _TOP_ILP_SHARE) * problem.time_limit
            return submit_cancellable(
                thread_pool("remat-exact-ilp", 1), cancel, ILPSolver().solve,  # own thread
                Problem(problem.graph, problem.budget_bytes, time_limit=limit,
                        options={"max_nodes": _TOP_ILP_NODES}))

        exact = exact_ilp() if exact_top is True else None
        try:
            # Both rules for placing backward ops in regions (NOTE [ Segments and regions ]):
            # neither wins everywhere, and the simulator tells which schedule is faster.
            # Past the deadline no further hierarchy starts: time_limit caps the solve, and
            # the first hierarchy always gives a schedule.
            for top, rule, use_ilp in runs:
                if not use_ilp:  # the hierarchies that may have a block ILP are done
                    start_block_ilps()
                if found and time.perf_counter() >= deadline:
                    time_cut("hierarchies not run")
                    continue
                found += self._hierarchical(
                    problem, use_ilp, deadline, rule, bar, top_ops=top,
                    # Mid-block ILP options only where no finer level subsumes them, and the
                    # block ILP only over the coarse level (over the fine one a transformer's
                    # residuals cross every segment: 10 s more for nothing on a 1-layer GPT).
                    mid_ilp=len(tops) == 1, block_ilp=top == tops[0],
                    caches=caches, later=pending)
            start_block_ilps()
            # A floor: per-block checkpointing, when it fits, polished like the others. The
            # hierarchy should beat it, and does on transformers and CNNs; where it does not
            # (a Mamba-style scan at 70%: +85% step time vs +68% at a lower peak, values of
            # one block read by every segment of the next), the user still gets the better.
            found.append(CheckpointSolver().solve(problem))
            if later:
                wait_cancellable(later, cancel)
                for future in later:  # in the order they were started
                    found += future.result()
            if exact is None and exact_top == "auto" and not any(map(_fits, found)) and (
                    _Model(problem.graph, problem.budget_bytes).num_variables
                    <= _TOP_ILP_VARIABLES):
                bar.add_phase()  # the rescue: NOTE [ The exact ILP beside the hierarchy ]
                exact = exact_ilp()
            if exact is not None:
                bar.phase("exact ILP of the whole graph")
                wait_cancellable([exact], cancel)
                found.append(exact.result())
        except BaseException:
            cancel.set()
            concurrent.futures.wait(later + ([exact] if exact is not None else []), timeout=5.0)
            raise
        return found

    def _hierarchical(self, problem: Problem, use_ilp: bool, deadline: float, regions: str,
                      bar: "SolveProgress | None" = None, *, top_ops: int | None = None,
                      mid_ilp: bool = False, block_ilp: bool = True,
                      caches: SharedCaches | None = None,
                      later: list | None = None) -> list[SolveResult]:
        """One hierarchy's schedules, unpolished: one per upper level that found one (the chain
        DP, the block ILP), else the lowest-peak schedule it saw. ``top_ops`` bounds the top
        level's segments (default: the ``max_block_ops`` option); ``caches`` is what the solve's
        hierarchies share (block options; the hierarchies solved: a repeat returns none). With
        ``later`` (a list), the block ILP is not solved here: this returns the chain DP's
        schedules and appends them to ``later`` with a function that solves the block ILP and
        gives its schedules (NOTE [ Block ILPs in the background ])."""
        started = time.perf_counter()
        graph = problem.graph
        bar = bar or SolveProgress(False, 1, problem.time_limit)
        ctx = BlockContext(use_ilp, problem, deadline, regions, mid_ilp=mid_ilp, bar=bar,
                       caches=caches)
        top_ops = top_ops or ctx.max_block_ops
        bar.phase(f"{'block options' if use_ilp else 'keep/recompute blocks'}, "
                  f"{'fine top level, ' if top_ops < ctx.max_block_ops else ''}"
                  f"regions by {regions}")
        chain = chain_structure(graph, max_block_ops=top_ops, regions=regions)
        if caches is not None:
            # Both region rules often agree (a scan: every backward op reads its own segment's
            # values); the same hierarchy again would give the same schedules.
            if (use_ilp, mid_ilp, block_ilp, chain) in caches.hierarchies:
                return []
            caches.hierarchies.add((use_ilp, mid_ilp, block_ilp, chain))
        subs = [extract_subgraph(graph, seg, reg) for seg, reg in zip(chain.segments, chain.regions)]
        if use_ilp:
            ctx.prefetch([sub.graph for sub in subs], depth=1)
        options = [ctx.options_of(sub.graph, depth=1) for sub in subs]
        table = solve_chain(chain_stages(chain, options), chain.cut_bytes[-1],
                            max(1, int(_HEADROOM * problem.budget_bytes) - chain.fixed_bytes),
                            slots=_SLOTS)
        best, lowest = search_capacity(graph, subs, options, table, problem.budget_bytes,
                                       None if caches is None else caches.simulations)
        dag = (block_dag(graph, chain, subs, options)
               if use_ilp and block_ilp and problem.options.get("block_ilp", True)
               and len(subs) <= _DAG_MAX_BLOCKS
               else None)
        if dag is not None and len(subs) * (sum(len(o.options) for o in options)
                                            + len(dag.storages)) > _DAG_MAX_VARIABLES:
            dag = None  # too big to solve within its node bound: see _DAG_MAX_VARIABLES
        crossing = dag is not None and not dag.is_chain  # storages cross several blocks
        name = "hierarchical" if use_ilp else "dp"
        detail = (f"{len(chain.segments)} top-level segments, {ctx.solved} distinct blocks solved "
                  f"({ctx.reused} reused, {ctx.repriced} from blocks of other sizes); regions by "
                  f"{regions}; upper level: ")

        def block_ilp_results() -> list[SolveResult]:
            if time.perf_counter() >= deadline:
                time_cut("block ILP not solved")
                return []
            # The block ILP models each storage crossing blocks once.
            found = solve_block_dag(graph, dag, subs, options, problem.budget_bytes,
                                    deadline=deadline)
            return ([] if found is None else
                    [finish(name, problem, found[0], started, proven=False,
                            detail=detail + "block ILP")])

        if best is not None:
            chain_results = [finish(name, problem, best[0], started, proven=False,
                                    detail=detail + "chain DP", simulation=best[1])]
        else:
            schedule, sim = lowest or (save_all_schedule(graph), None)
            chain_results = [finish(name, problem, schedule, started, proven=False,
                                    detail=detail + "chain DP; no schedule within the budget",
                                    simulation=sim)]
        if not crossing:
            return chain_results
        if later is None:
            return chain_results + block_ilp_results()
        later.append((chain_results, block_ilp_results))
        return chain_results


def _block_ilps_to_run(pending: list[tuple[list[SolveResult], Callable[[], list[SolveResult]]]]
                       ) -> list[Callable[[], list[SolveResult]]]:
    """Which deferred block ILPs to solve.

    NOTE [ Block ILPs in the background ]: a block ILP is a few MIPs in a row (its capacity
    search), 1-7 s each on a U-Net, which HiGHS solves without the GIL. Each hierarchy whose top
    level has storages crossing several blocks defers one. Once the hierarchies that can have
    one are done, only the one whose chain DP found the fastest schedule that fits is solved:
    the block ILP over the same blocks and options wins then too (U-Net at 70%/50%: the rule
    whose chain DP is faster, +12.3%/+51.4% vs +13.8%/+52.5%, gives the better block ILP,
    +6.8%/+16.4% vs +7.7%/+22.3%; the other's six MIPs were 18 s of a 20 s solve). Where no
    chain DP fits, all are solved. They run in a thread pool while the remaining hierarchies
    (keep/recompute options) and per-block checkpointing run, and are collected in the order
    started before the winner is chosen, so the schedule does not depend on timing.
    """
    fitting = [(min(r.simulation.time for r in results if _fits(r)), k)
               for k, (results, _) in enumerate(pending) if any(map(_fits, results))]
    if not fitting:
        return [solve_level for _, solve_level in pending]
    return [pending[min(fitting)[1]][1]]


def _fits(result: SolveResult) -> bool:
    """A schedule within the budget."""
    return result.schedule is not None and result.status != "infeasible"


def _finalists(feasible: list[SolveResult], graph: RematGraph) -> list[SolveResult]:
    """The schedules to polish, from the fitting ones sorted by time (NOTE [ Polishing the
    finalists ])."""
    cheap = _polish_trials(graph) == _POLISH_TRIALS  # not cut by _POLISH_OPS
    window, count = (math.inf, _POLISH_CHEAP_FINALISTS) if cheap else (_POLISH_RUNNER_UP, 2)

    def pick(results: list[SolveResult], into: list[SolveResult]) -> None:
        chosen: list[SolveResult] = []
        for r in results:
            if len(chosen) == count or r.simulation.time > window * results[0].simulation.time:
                break
            if all(r.schedule != f.schedule for f in chosen):
                chosen.append(r)
        into += [r for r in chosen if all(r.schedule != f.schedule for f in into)]

    finalists: list[SolveResult] = []
    pick(feasible, finalists)
    if cheap:
        # Each solver's own finalists too, so that the solve is never slower than "dp" (its
        # keep/recompute-only hierarchies): on a 1-layer GPT at 70% three ILP-option
        # schedules (+10.3% to +16.6%) came before the dp's +16.9%, which alone polished to
        # +8.2% (the three to +8.8% at best); a 4-block ViT at 70% +6.4% -> +5.1%. The other
        # benchmark models at 70/50/33% kept their schedules, solved 0.02-0.3 s slower (the
        # T5-small config, 1,417 ops: 0.4-1 s).
        for name in dict.fromkeys(r.solver for r in feasible):
            pick([r for r in feasible if r.solver == name], finalists)
    return finalists


def _polish_trials(graph: RematGraph) -> int:
    return max(50, min(_POLISH_TRIALS, _POLISH_OPS // max(1, len(graph.ops))))


def _top_levels(graph: RematGraph, options: dict) -> list[int]:
    """Bounds on the top level's segment size to solve with: the coarse one (``max_block_ops``)
    and, for small graphs, a fine one (NOTE [ Fine and coarse top levels ])."""
    coarse = int(options.get("max_block_ops", 120))
    fine = int(options.get("leaf_ops", 40))
    if fine >= coarse:
        return [coarse]
    cut = chain_structure(graph, max_block_ops=fine).segments
    if len(cut) > _FINE_MAX_SEGMENTS or cut == chain_structure(graph, max_block_ops=coarse).segments:
        return [coarse]
    return [coarse, fine]


class DPSolver(HierarchicalSolver):
    """The chain DP with two options per block, keep everything or keep nothing: Rotor-style
    checkpointing over the module blocks, without the ILP. Fast, and never better than
    ``"hierarchical"``."""

    name: ClassVar[str] = "dp"
    use_ilp: ClassVar[bool] = False
