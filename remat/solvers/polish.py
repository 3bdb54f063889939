"""Use the memory a schedule leaves unused: turn recomputations back into saves, greedily.

NOTE [ Polishing a schedule ]
The hierarchical solver's upper levels see blocks through a handful of options and a coarse
memory model, so its schedules often stay well under the budget while still recomputing things
that would fit. Polishing walks the forward ops the schedule recomputes, most recomputation
seconds per byte first, and for each one tries the schedule that keeps its outputs from the
first forward instead (all its recomputations dropped, then any recomputation nobody reads any
more). The simulator is the judge: a change is kept only if the exact peak stays within the
budget and the step gets faster. The result is never worse than the input; the work is bounded
by a deadline and a number of trials, so large graphs pay at most that.

It also stops after ``stall`` trials in a row that kept nothing: the candidates come most
promising first, so a long run of misses means the memory left is used up. On the benchmark
models (MLP, ViT, U-Net, ResNet, GPTs of 2 and 6 layers, a small Mamba-style scan at 70/50/30%)
the longest run of misses before a change that was kept was 35 trials; on a 24-layer GPT at
50% all 146 trials missed (3.2 s of each 16 s solve, twice) and at 33% they gained 0.1 points.
A count, not a time, so the same schedule comes out on a busy machine.
"""
from __future__ import annotations

import time
from collections import Counter

from ..errors import ScheduleError
from ..graph import RematGraph, ValueKind
from .base import time_cut
from ..schedule import Schedule, Simulation, forward_ops_needed, remake_views, simulate, tidy

__all__ = ["polish"]


def _is_view(graph: RematGraph, i: int) -> bool:
    return all(graph.values[v].alias_of is not None for v in graph.ops[i].outputs)


def polish(graph: RematGraph, schedule: Schedule, budget_bytes: int, *,
           deadline: float | None = None, max_trials: int = 400, stall: int = 40,
           simulation: Simulation | None = None) -> tuple[Schedule, Simulation]:
    """Greedily keep recomputed values while the simulated peak fits. See NOTE [ Polishing a schedule ].

    Args:
        graph: The joint graph.
        schedule: A valid schedule.
        budget_bytes: The peak the result must stay within.
        deadline: ``time.perf_counter()`` value after which no new trial starts.
        max_trials: Most candidate changes simulated.
        stall: Stop after this many trials in a row kept nothing.
        simulation: ``simulate(graph, schedule)`` if the caller has it.

    Returns:
        The polished schedule and its simulation (the input itself when nothing helps or the
        input is over the budget).
    """
    best_sim = simulation or simulate(graph, schedule)
    if best_sim.peak_bytes > budget_bytes:
        return schedule, best_sim
    nf, values, ops = graph.num_forward, graph.values, graph.ops
    root = graph.storage_root
    counts = Counter(i for i in schedule.backward if i < nf)

    def own_bytes(i: int) -> int:
        return sum(values[v].nbytes for v in ops[i].outputs if root[v] == v)

    candidates = [i for i, n in counts.items() if ops[i].time > 0 and not _is_view(graph, i)]
    candidates.sort(key=lambda i: (-counts[i] * ops[i].recompute_cost / max(1, own_bytes(i)), i))
    best = schedule
    last_kept = 0
    for trials, i in enumerate(candidates):
        if trials >= max_trials or trials - last_kept >= stall:
            break
        if deadline is not None and time.perf_counter() > deadline:
            time_cut("polishing")
            break
        if i not in best.backward:  # an earlier change already made it unnecessary
            continue
        keep = {v for v in ops[i].outputs if values[v].kind is ValueKind.ACTIVATION}
        saved = frozenset(best.saved | keep)
        draft = Schedule(forward_ops_needed(graph, saved), saved,
                         tuple(b for b in best.backward if b != i))
        try:
            trial = tidy(graph, remake_views(graph, draft))
            sim = simulate(graph, trial)
        except ScheduleError:
            continue
        if sim.peak_bytes <= budget_bytes and sim.time < best_sim.time:
            best, best_sim = trial, sim
            last_kept = trials + 1
    return best, best_sim
