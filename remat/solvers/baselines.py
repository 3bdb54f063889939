"""Two reference solvers: keep everything (``"none"``) and per-block checkpointing
(``"checkpoint"``, what wrapping each block in ``torch.utils.checkpoint`` does); and the
least-memory schedule every solve can fall back on."""
from __future__ import annotations

import time
from typing import ClassVar

from ..graph import RematGraph
from ..hierarchy import checkpoint_blocks
from ..schedule import (Schedule, Simulation, on_demand_schedule, remake_views, save_all_schedule,
                        simulate, tidy)
from .base import Problem, SolveResult, finish

__all__ = ["SaveAllSolver", "CheckpointSolver", "least_memory_schedule", "least_memory_schedules"]


def _crossing(graph: RematGraph, block_of: dict[int, int]) -> set[int]:
    """Forward values read by a forward op of another block than their producer's (ops outside
    every block count as one more block)."""
    crossing = set()
    for i in graph.forward_ops:
        for v in graph.ops[i].inputs:
            p = graph.values[v].producer
            if 0 <= p < graph.num_forward and block_of.get(i, -1) != block_of.get(p, -1):
                crossing.add(v)
    return crossing


def least_memory_schedules(graph: RematGraph) -> list[tuple[str, Schedule, Simulation]]:
    """Schedules near the lowest peak, named, with their simulations: every value recomputed
    right before each read, keeping nothing, or keeping only the inputs of the blocks a person
    would checkpoint (where there are several).

    NOTE [ Least memory within blocks ]
    Keeping nothing is not the lowest peak where recomputing a late value reruns a long chain
    from the step's inputs, holding its intermediates meanwhile. Keeping each block's inputs
    (a layer's) cuts those chains for a few bytes: a 2-layer HF Mamba (B4xT32) peaks at
    3.78 MB keeping nothing and 3.33 MB keeping its 4 block inputs, where the hierarchy's
    lowest was 3.54 MB (eager's step 6.45 MB). On a plain chain the few bytes kept are the
    difference, and keeping nothing is lower. Both are slow (29x and 10x the unmodified step's
    time on that Mamba): rescues where nothing else fits, which the hierarchical solver polishes.
    """
    candidates = [("least memory", frozenset())]
    blocks = checkpoint_blocks(graph)
    if len(blocks) > 1:
        block_of = {i: b for b, block in enumerate(blocks) for i in block.ops}
        candidates.append((f"least memory, the inputs of {len(blocks)} blocks kept",
                           frozenset(_crossing(graph, block_of) - set(graph.user_outputs))))
    found = []
    for name, saved in candidates:
        schedule = tidy(graph, remake_views(graph, on_demand_schedule(graph, saved,
                                                                      keep_recomputed=False)))
        found.append((name, schedule, simulate(graph, schedule)))
    return found


def least_memory_schedule(graph: RematGraph) -> tuple[Schedule, Simulation]:
    """The lowest-peak schedule of :func:`least_memory_schedules` (then the faster), and its
    simulation: slow, but a real schedule near the lowest peak."""
    _, schedule, sim = min(least_memory_schedules(graph),
                           key=lambda f: (f[2].peak_bytes, f[2].time))
    return schedule, sim


class SaveAllSolver:
    """Save every activation backward reads: the unmodified step (no recomputation)."""

    name: ClassVar[str] = "none"

    def solve(self, problem: Problem) -> SolveResult:
        started = time.perf_counter()
        return finish(self.name, problem, save_all_schedule(problem.graph), started, proven=True)


class CheckpointSolver:
    """Recompute everything inside each block in backward, keeping only block boundaries.

    Blocks come from :func:`remat.hierarchy.checkpoint_blocks` (e.g. the layers of a
    transformer). Random ops keep their outputs (never re-drawn). The budget is not used to
    choose anything: the result is ``"infeasible"`` when its peak exceeds the budget.
    """

    name: ClassVar[str] = "checkpoint"

    def solve(self, problem: Problem) -> SolveResult:
        started = time.perf_counter()
        graph = problem.graph
        blocks = checkpoint_blocks(graph)
        block_of = {i: b for b, block in enumerate(blocks) for i in block.ops}
        default = save_all_schedule(graph).saved
        saved = {v for v in default if graph.values[v].producer not in block_of}
        # the block boundaries: read by an op outside their block
        saved |= {v for v in _crossing(graph, block_of) if graph.values[v].producer in block_of}
        for v in graph.user_outputs:
            saved.discard(v)
        schedule = on_demand_schedule(graph, saved, [list(b.ops) for b in blocks])
        return finish(self.name, problem, schedule, started, proven=False,
                      detail=f"{len(blocks)} blocks: " + ", ".join(b.path for b in blocks[:6])
                      + (" ..." if len(blocks) > 6 else ""))
