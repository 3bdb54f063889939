"""What a dynamic capture takes from the static capture of the same step: its measured op
costs (:func:`carry_costs`) and, when the two graphs are the same op for op, its schedule
(:func:`carry_schedule`). See NOTE [ Static first ] in ``remat/module.py``.

NOTE [ Costs carried to the dynamic capture ]
A module is captured first with the example's static shapes (NOTE [ Static first ]) and again
with dynamic dimensions when a call of other sizes comes. The second graph does the same work as
the first at the example's sizes, so the op costs measured there are carried over instead of
measured again inside a training step (where running the unmodified step could pass the budget,
and where the sizes, hence the costs and the plan, would change from run to run). The two graphs
are not always op for op the same: a static trace drops slices that keep every element and the
dynamic one keeps them, with ``sym_size`` arithmetic beside (a 2-layer ViT: 381 ops static, 384
dynamic). Ops are matched in order by what they are and the bytes they read and write at the
example's sizes; an op left unmatched (such a slice or view) gets its modelled time and the
scratch memory lowering gave it; its output's bytes are a value of the graph, counted as every
value is. When more than _UNMATCHED_SHARE of the ops are unmatched, the graphs are not the same
step and nothing is carried: the dynamic graph is measured as any new graph is.

NOTE [ The static schedule serves the dynamic graph ]
Where every op matches, in order (the benchmark GPT: 338 ops in both), the dynamic graph at the
example's sizes is the static graph with the same costs: solving it again gives the problem
already solved, and took 2.4 s of that GPT's first step of another shape. Its schedule is the
static one, op for op, with each saved value the same output of the same op; it is simulated on
the dynamic graph and checked against the budget as a cached plan is (NOTE [ Plan cache ] in
``remat/cache.py``), and solved afresh when it does not fit.
"""
from __future__ import annotations

import difflib
from dataclasses import replace
from typing import Sequence

from .graph import RematGraph
from .schedule import Schedule

__all__ = ["carry_costs", "carry_schedule"]

_UNMATCHED_SHARE = 0.1


def _op_keys(graph: RematGraph) -> list[tuple]:
    """Per op: what it is, its phase, and the bytes it reads and writes (at the graph's sizes)."""
    nbytes = [v.nbytes for v in graph.values]
    # size scalars (0 bytes) are inputs of the dynamic graph's ops only
    return [(op.signature.split("(", 1)[0], op.phase,
             tuple(nbytes[v] for v in op.inputs if nbytes[v]),
             tuple(nbytes[v] for v in op.outputs)) for op in graph.ops]


def carry_costs(source: RematGraph, target: RematGraph, modelled: Sequence[float]
                ) -> RematGraph | None:
    """``target`` (the dynamic capture at the sizes ``source`` was measured at) with
    ``source``'s measured op costs, matched op by op (NOTE [ Costs carried to the dynamic
    capture ]); ``modelled`` gives the time of a ``target`` op no ``source`` op matches.
    ``None`` when the two are not the same step."""
    match: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, _op_keys(source), _op_keys(target), autojunk=False)
    for block in matcher.get_matching_blocks():
        match.update((block.b + k, block.a + k) for k in range(block.size))
    unmatched = [k for k in range(len(target.ops)) if k not in match]
    if len(unmatched) > _UNMATCHED_SHARE * len(target.ops):
        return None
    ops = []
    for k, op in enumerate(target.ops):
        if k in match:
            src = source.ops[match[k]]
            ops.append(replace(op, time=src.time, workspace=src.workspace,
                               rerun_time=src.rerun_time))
        else:
            ops.append(replace(op, time=float(modelled[k]), rerun_time=None))
    return replace(target, ops=tuple(ops))


def carry_schedule(source: RematGraph, schedule: Schedule, target: RematGraph
                   ) -> Schedule | None:
    """``schedule`` of ``source`` as a schedule of ``target`` when the two are the same step
    op for op, in order (NOTE [ The static schedule serves the dynamic graph ]); ``None``
    otherwise. ``target`` is taken at ``source``'s sizes."""
    if source.num_forward != target.num_forward or _op_keys(source) != _op_keys(target):
        return None
    saved = set()
    for value in schedule.saved:
        producer = source.values[value].producer
        if producer < 0:  # an input or tangent: nothing says which of target's it is
            return None
        outputs = source.ops[producer].outputs
        saved.add(target.ops[producer].outputs[outputs.index(value)])
    return Schedule(schedule.forward, frozenset(saved), schedule.backward)
