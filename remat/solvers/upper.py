"""The upper level of a hierarchy (NOTE [ Hierarchical solving ], steps 3 and 4).

The chain DP's stages from the blocks' options, the search of the DP's capacity for the
fastest schedule that simulates within the budget, and the merge of block actions (the chain
DP's or the block ILP's) into one schedule of the whole graph.
"""
from __future__ import annotations

import logging

from ..errors import ScheduleError
from ..graph import RematGraph
from ..schedule import Schedule, Simulation, forward_ops_needed, remake_views, simulate, tidy
from ..segments import Chain
from ..subgraph import Subgraph
from .chain import ChainTable, Stage, StageOption
from .options import BlockOptions

__all__ = ["assemble", "capacity_grid", "chain_stages", "search_capacity"]

log = logging.getLogger(__name__)


def capacity_grid(table: ChainTable, points: int = 16) -> list[int]:
    """Capacities (slots) where the DP has a schedule, spread from the smallest to the largest."""
    finite = [m for m in range(table.slots + 1) if table.best_time(m) < float("inf")]
    if not finite:
        return []
    lo, hi = finite[0], finite[-1]
    return sorted({lo + round(k * (hi - lo) / (points - 1)) for k in range(points)})


def chain_stages(chain: Chain, options: list[BlockOptions]) -> list[Stage]:
    return [
        Stage(
            input_bytes=chain.cut_bytes[k],
            grad_bytes=chain.grad_bytes[k],
            nosave_time=opts.nosave_time,
            nosave_peak=opts.nosave_peak,
            options=tuple(StageOption(o.saved_bytes, o.forward_peak, o.backward_peak,
                                      opts.forward_time, o.backward_time) for o in opts.options),
        )
        for k, opts in enumerate(options)
    ]


def search_capacity(graph: RematGraph, subs: list[Subgraph], options: list[BlockOptions],
                    table: ChainTable, budget: int,
                    simulations: dict[Schedule, Simulation] | None = None,
                    ) -> tuple[tuple[Schedule, Simulation] | None, tuple[Schedule, Simulation] | None]:
    """Largest DP capacity whose schedule simulates within ``budget`` (binary search), keeping
    the fastest feasible schedule and the lowest-peak one seen, each with its simulation.

    ``simulations``: schedules simulated before (by other hierarchies of the same solve, whose
    capacities often give the same schedules: 130 simulations for 57 schedules on a 6-layer
    GPT); read and added to."""
    cache: dict[int, tuple[Schedule, Simulation] | None] = {}
    known = {} if simulations is None else simulations

    def at(slot: int) -> tuple[Schedule, Simulation] | None:
        if slot not in cache:
            cache[slot] = None
            if table.best_time(slot) < float("inf"):
                try:
                    schedule = assemble(graph, subs, options, table.actions(slot))
                    if schedule not in known:
                        known[schedule] = simulate(graph, schedule)
                    cache[slot] = (schedule, known[schedule])
                except ScheduleError as exc:
                    log.debug("capacity slot %d gives an invalid schedule: %s", slot, exc)
        return cache[slot]

    finite = [m for m in range(table.slots + 1) if table.best_time(m) < float("inf")]
    if finite:
        lo, hi = finite[0], finite[-1]
        if (found := at(hi)) is not None and found[1].peak_bytes <= budget:
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = at(mid)
            if found is not None and found[1].peak_bytes <= budget:
                lo = mid
            else:
                hi = mid - 1
        for slot in (lo - 2, lo - 1, lo, lo + 1):  # the boundary is not always monotone
            if 0 <= slot <= table.slots:
                at(slot)
        # ... and the DP's model is only approximate: more capacities, as many as the graph's
        # size allows (each is one simulation of the whole graph; 24 up to ~4,000 ops).
        for slot in capacity_grid(table, points=max(8, min(24, 100_000 // max(1, len(graph.ops))))):
            at(slot)
    done = [item for item in cache.values() if item]
    feasible = [item for item in done if item[1].peak_bytes <= budget]
    lowest = min(done, key=lambda it: it[1].peak_bytes, default=None)
    best = min(feasible, key=lambda it: it[1].time, default=None)
    return best, lowest


def assemble(graph: RematGraph, subs: list[Subgraph], options: list[BlockOptions],
             actions: list[tuple], *, backward_only: bool = False) -> Schedule:
    """Turn block actions into one schedule of ``graph`` (see NOTE [ Hierarchical solving ]).

    ``actions`` are the DP's (the first forward, then backward from the first ``"B"``), or,
    with ``backward_only``, only what runs in backward (the block ILP's).
    """
    first_backward = 0 if backward_only else next(k for k, a in enumerate(actions) if a[0] == "B")
    backward: list[int] = []
    for action in actions[first_backward:]:
        sub, opts = subs[action[1]], options[action[1]]
        if action[0] == "B":
            backward.extend(sub.to_global_ops(opts.options[action[2]].backward))
            continue
        local = opts.nosave_forward if action[0] == "F0" else opts.options[action[2]].forward
        backward.extend(sub.ops[i] for i in local if sub.graph.ops[i].recomputable)
    nf = graph.num_forward
    saved: set[int] = set()
    produced: set[int] = set()
    for i in backward:
        for v in graph.ops[i].inputs:
            if v not in produced and 0 <= graph.values[v].producer < nf:
                saved.add(v)
        produced.update(graph.ops[i].outputs)
    saved -= set(graph.user_outputs)
    frozen = frozenset(saved)
    draft = Schedule(forward_ops_needed(graph, frozen), frozen, tuple(backward))
    return tidy(graph, remake_views(graph, draft))
