"""Cut a piece out of a :class:`RematGraph`, as a graph of its own.

A block's forward ops and the backward ops that differentiate them form a sub-problem that any
solver can handle. Values the piece reads from outside become graph inputs (always available,
charged to the parent); values it produces that the outside reads become its outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from .graph import Op, RematGraph, Value, ValueKind

__all__ = ["Subgraph", "extract_subgraph"]


@dataclass(frozen=True)
class Subgraph:
    """A piece of a graph and the maps back to it.

    Attributes:
        graph: The piece as a graph of its own (forward ops first, then backward ops).
        ops: Global op index of each local op.
        values: Global value index of each local value.
    """

    graph: RematGraph
    ops: tuple[int, ...]
    values: tuple[int, ...]

    def to_global_ops(self, local_ops: Iterable[int]) -> list[int]:
        return [self.ops[i] for i in local_ops]

    def to_global_values(self, local_values: Iterable[int]) -> set[int]:
        return {self.values[v] for v in local_values}


def extract_subgraph(graph: RematGraph, forward_ops: Iterable[int], backward_ops: Iterable[int]
                     ) -> Subgraph:
    """The sub-problem made of ``forward_ops`` and ``backward_ops`` (each kept in graph order).

    Args:
        graph: The whole graph.
        forward_ops: Forward ops of the piece.
        backward_ops: Backward ops of the piece.

    Returns:
        A :class:`Subgraph`. Its outputs are the values read outside the piece (plus the
        global outputs it produces); everything it reads from outside is an input.
    """
    fwd = sorted(set(forward_ops))
    bwd = sorted(set(backward_ops))
    members = fwd + bwd
    inside = set(members)
    local: dict[int, int] = {}
    values: list[Value] = []
    origin: list[int] = []

    def add(v: int, value: Value) -> int:
        local[v] = len(values)
        values.append(value)
        origin.append(v)
        return local[v]

    ops: list[Op] = []
    for k, i in enumerate(members):
        op = graph.ops[i]
        for v in op.inputs:
            if v not in local:
                src = graph.values[v]
                add(v, Value(src.name, ValueKind.INPUT, -1, 0, None))
        for v in op.outputs:
            src = graph.values[v]
            alias = local.get(src.alias_of) if src.alias_of is not None else None
            add(v, replace(src, producer=k, alias_of=alias))  # kind, size, scalar as they are
        # every other field (times, flags, module, signature) as the op has it
        ops.append(replace(op, inputs=tuple(local[v] for v in op.inputs),
                           outputs=tuple(local[v] for v in op.outputs)))

    users = graph.users
    global_fwd_out = set(graph.forward_outputs)
    global_bwd_out = set(graph.backward_outputs)
    user_out = set(graph.user_outputs)
    nf_local = len(fwd)
    fwd_outputs, bwd_outputs, pinned = [], [], []
    for lv, v in enumerate(origin):
        producer = values[lv].producer
        if producer < 0:
            continue
        read_outside = any(u not in inside for u in users[v])
        if producer < nf_local:
            if read_outside or v in global_fwd_out:
                fwd_outputs.append(lv)
            if v in user_out:
                pinned.append(lv)
        elif read_outside or v in global_bwd_out:
            bwd_outputs.append(lv)
    sub = RematGraph(
        ops=tuple(ops),
        values=tuple(values),
        num_forward=nf_local,
        forward_outputs=tuple(fwd_outputs),
        backward_outputs=tuple(bwd_outputs),
        user_outputs=tuple(pinned),
    )
    return Subgraph(sub, tuple(members), tuple(origin))
