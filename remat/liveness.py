"""Fixed liveness facts of a joint graph that every solver shares.

Backward ops always run once, in their usual order, so the backward-side memory at each backward
op (tangents, backward intermediates, gradients produced so far, model outputs) does not depend
on the schedule; neither do the values forward must hold for its own later ops. What varies is
which forward values are saved or recomputed, and that is what solvers decide.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .graph import RematGraph, ValueKind

__all__ = ["Liveness", "liveness", "peak_lower_bound"]


@dataclass(frozen=True)
class Liveness:
    """Schedule-independent memory facts.

    Attributes:
        backward_base: For each backward op (in order), bytes of backward-side storages alive
            while it runs (including its outputs, its workspace and the model outputs).
        needs: For each backward op, the forward activation values it reads (model outputs
            excluded: the caller keeps those), including the forward storage behind any
            backward-made alias it reads.
        forward_live: For each forward op, the storage roots forward itself must hold while it
            runs (its inputs and outputs, values later forward ops read, model outputs produced
            so far), as a frozenset of value indices.
        output_bytes: Bytes of the model outputs (alive from their creation to the end).
    """

    backward_base: tuple[int, ...]
    needs: tuple[tuple[int, ...], ...]
    forward_live: tuple[frozenset[int], ...]
    output_bytes: int


def _roots_bytes(graph: RematGraph, roots: set[int]) -> int:
    return sum(graph.values[r].nbytes for r in roots)


@lru_cache(maxsize=8)
def liveness(graph: RematGraph) -> Liveness:
    """Compute (and cache per graph) the :class:`Liveness` of ``graph``."""
    root = graph.storage_root
    values = graph.values
    nf = graph.num_forward
    outputs = set(graph.user_outputs)
    output_roots = {root[v] for v in outputs if values[root[v]].kind is ValueKind.ACTIVATION}
    output_bytes = _roots_bytes(graph, output_roots)

    # Backward side: storages born in backward (or tangents) and their last backward reader.
    bwd = list(graph.backward_ops)
    end = len(bwd)
    death: dict[int, int] = {}
    birth: dict[int, int] = {}
    for v, value in enumerate(values):
        if value.kind is ValueKind.TANGENT:
            birth[v], death[v] = 0, 0
    for k, b in enumerate(bwd):
        op = graph.ops[b]
        for v in op.inputs:
            r = root[v]
            if r in birth:
                death[r] = max(death[r], k)
        for v in op.outputs:
            r = root[v]
            if values[r].kind in (ValueKind.GRADIENT,):
                birth.setdefault(r, k)
                death[r] = max(death.get(r, k), k)
    for v in graph.backward_outputs:
        r = root[v]
        if r in birth:
            death[r] = end
    delta = [0] * (end + 2)
    for r, k in birth.items():
        delta[k] += values[r].nbytes
        delta[death[r] + 1] -= values[r].nbytes
    base: list[int] = []
    running = 0
    for k, b in enumerate(bwd):
        running += delta[k]
        base.append(running + output_bytes + graph.ops[b].workspace)

    def forward_reads(b: int) -> tuple[int, ...]:
        reads: dict[int, None] = {}
        for v in graph.ops[b].inputs:
            if 0 <= values[v].producer < nf:
                if v not in outputs:
                    reads[v] = None
            else:
                # A backward alias of a forward value (``detach``/``transpose`` of a saved
                # tensor) keeps the forward storage alive until its readers run.
                r = root[v]
                if 0 <= values[r].producer < nf and r not in outputs and values[r].nbytes:
                    reads[r] = None
        return tuple(reads)

    needs = tuple(forward_reads(b) for b in bwd)

    # Forward side: the unmodified forward's own liveness.
    last_fwd_use: dict[int, int] = {}
    for i in graph.forward_ops:
        for v in graph.ops[i].inputs:
            last_fwd_use[root[v]] = i
    pinned = output_roots | {root[v] for v in graph.forward_outputs
                             if values[root[v]].kind is ValueKind.ACTIVATION}
    forward_live: list[frozenset[int]] = []
    alive: set[int] = set()
    for i in graph.forward_ops:
        op = graph.ops[i]
        for v in op.outputs:
            if values[root[v]].kind is ValueKind.ACTIVATION:
                alive.add(root[v])
        here = {root[v] for v in op.inputs if values[root[v]].kind is ValueKind.ACTIVATION}
        forward_live.append(frozenset(alive | here))
        alive = {r for r in alive if last_fwd_use.get(r, -1) > i or r in pinned}
    return Liveness(tuple(base), needs, tuple(forward_live), output_bytes)


def peak_lower_bound(graph: RematGraph) -> int:
    """A peak no schedule can beat: at every op, what it reads and writes must be alive,
    together with the backward-side memory of its position (which no schedule changes)."""
    live = liveness(graph)
    root = graph.storage_root
    best = 0
    for i in graph.forward_ops:
        op = graph.ops[i]
        roots = {root[v] for v in (*op.inputs, *op.outputs)
                 if graph.values[root[v]].kind is ValueKind.ACTIVATION}
        best = max(best, _roots_bytes(graph, roots) + op.workspace)
    for k, b in enumerate(graph.backward_ops):
        roots = {root[v] for v in live.needs[k]}
        best = max(best, live.backward_base[k] + _roots_bytes(graph, roots))
    return best
