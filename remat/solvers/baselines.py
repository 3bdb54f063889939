"""Two reference solvers: keep everything (``"none"``) and per-block checkpointing
(``"checkpoint"``, what wrapping each block in ``torch.utils.checkpoint`` does)."""
from __future__ import annotations

import time
from typing import ClassVar

from ..hierarchy import checkpoint_blocks
from ..schedule import on_demand_schedule, save_all_schedule
from .base import Problem, SolveResult, finish

__all__ = ["SaveAllSolver", "CheckpointSolver"]


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
        for i in graph.forward_ops:
            for v in graph.ops[i].inputs:
                p = graph.values[v].producer
                if p in block_of and block_of.get(i) != block_of[p]:
                    saved.add(v)  # a block boundary: read by an op outside its block
        for v in graph.user_outputs:
            saved.discard(v)
        schedule = on_demand_schedule(graph, saved, [list(b.ops) for b in blocks])
        return finish(self.name, problem, schedule, started, proven=False,
                      detail=f"{len(blocks)} blocks: " + ", ".join(b.path for b in blocks[:6])
                      + (" ..." if len(blocks) > 6 else ""))
