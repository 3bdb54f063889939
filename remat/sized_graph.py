"""A captured graph whose byte sizes and op times are functions of its size symbols.

A joint graph captured with dynamic dimensions (NOTE [ Dynamic shapes ]) holds each value's
bytes as an expression of a few size symbols (batch size, sequence length). :class:`SizedGraph`
evaluates the graph at other sizes (exact bytes; op times scaled by the bytes they touch), and
:func:`structure_key` names what a schedule's validity depends on, so that
:class:`~remat.sizes.ShapePlans` can serve every size from one capture.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Sequence

from .graph import RematGraph
from .symbolic import free_symbol_names

__all__ = ["SizedGraph", "bucket", "size_evaluator", "structure_key"]

_SYMBOL = re.compile(r"\bs\d+\b")


def structure_key(graph: RematGraph, size_exprs: Sequence[object] = ()) -> tuple[str, tuple[str, ...]]:
    """What a schedule's validity depends on, and the graph's size symbols in a canonical order.

    Size symbols are renamed by first appearance (two captures of one model name their symbols
    independently), so two graphs with one key list corresponding symbols at the same places.
    """
    import hashlib

    names: dict[str, str] = {}

    def canon(text: str) -> str:
        return _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"S{len(names)}"), text)

    h = hashlib.sha256()
    for op in graph.ops:
        h.update(f"{op.phase.value}|{canon(op.signature)}|{op.inputs}|{op.outputs}|"
                 f"{op.recomputable}|{op.module}".encode())
    for v in graph.values:
        h.update(f"{v.kind.value}|{v.alias_of}|{v.producer}|{v.scalar}".encode())
    h.update(f"{graph.forward_outputs}|{graph.backward_outputs}|{graph.user_outputs}".encode())
    for expr in size_exprs:  # symbols only in sizes (a gradient nobody reads), sorted
        for name in sorted(free_symbol_names(expr)):
            names.setdefault(name, f"S{len(names)}")
    return h.hexdigest()[:32], tuple(names)


def bucket(sizes: Sequence[int]) -> tuple[int, ...]:
    """Every size rounded up to a power of two (see NOTE [ Shape-generic plans ])."""
    return tuple(1 << max(0, math.ceil(math.log2(max(s, 1)))) for s in sizes)


# The integer functions of PyTorch's size expressions (``torch.utils._sympy.functions``), as
# Python computes them: a Llama layer's sizes hold ``FloorDiv`` (half the rotary dimension), and
# without them evaluating its bytes at a new batch length raised ``NameError: FloorDiv`` inside
# the training step.
_INTEGER_FUNCTIONS = {
    "FloorDiv": lambda a, b: a // b, "CleanDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b), "ModularIndexing": lambda x, d, m: (x // d) % m,
    "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
    "IntTrueDiv": lambda a, b: a / b, "FloatTrueDiv": lambda a, b: a / b,
    "FloorToInt": math.floor, "CeilToInt": math.ceil, "TruncToInt": math.trunc,
    "RoundToInt": round, "PowByNatural": lambda a, b: a ** b, "FloatPow": lambda a, b: a ** b,
    "Identity": lambda x: x, "ToFloat": float, "Max": max, "Min": min,
    "LShift": lambda a, b: a << b, "RShift": lambda a, b: a >> b,
}


def size_evaluator(symbols: Sequence[str], exprs: Sequence[object]):
    """A function of the symbols' values (in ``symbols``' order) returning every size
    expression's value, PyTorch's integer functions included (``FloorDiv``...)."""
    import sympy

    syms = [sympy.Symbol(s, integer=True, positive=True) for s in symbols]
    by_name = {s.name: s for s in syms}
    exprs = [e.xreplace({f: by_name[f.name] for f in e.free_symbols}) for e in exprs]
    if not exprs:
        return lambda *values: []
    return sympy.lambdify(syms, exprs, modules=[_INTEGER_FUNCTIONS, "math"])


class SizedGraph:
    """A profiled graph whose byte sizes and times can be evaluated at other sizes.

    Args:
        graph: The graph with the times and workspaces measured at ``sizes``.
        size_exprs: Bytes of each value's storage as a size expression (or ``int``).
        symbols: Names of the size symbols, in the order ``sizes`` gives their values.
        sizes: The symbol values the graph was profiled at.
    """

    def __init__(self, graph: RematGraph, size_exprs: Sequence[object], symbols: Sequence[str],
                 sizes: Sequence[int]) -> None:
        self.graph = graph
        self.symbols = tuple(symbols)
        self.sizes = tuple(int(s) for s in sizes)
        dynamic = [(i, e) for i, e in enumerate(size_exprs) if not isinstance(e, int)]
        unique = list(dict.fromkeys(e for _, e in dynamic))
        self._slots = [(i, unique.index(e)) for i, e in dynamic]
        self._evaluate = size_evaluator(self.symbols, unique)
        self._cache: dict[tuple[int, ...], RematGraph] = {self.sizes: graph}

    def nbytes_at(self, sizes: Sequence[int]) -> list[int]:
        """Bytes of every value's storage at ``sizes``."""
        nbytes = [v.nbytes for v in self.graph.values]
        unique = self._evaluate(*sizes)
        for index, slot in self._slots:
            nbytes[index] = int(unique[slot])
        return nbytes

    def at(self, sizes: Sequence[int]) -> RematGraph:
        """The graph at ``sizes``: exact bytes; each op's time and workspace scaled from the
        profiled ones by the bytes it reads and writes there."""
        sizes = tuple(int(s) for s in sizes)
        found = self._cache.get(sizes)
        if found is not None:
            return found
        graph = self.graph
        nbytes = self.nbytes_at(sizes)
        root = graph.storage_root

        def touched(op, table) -> int:
            return sum(table[root[v]] for v in (*op.inputs, *op.outputs))

        old = [v.nbytes for v in graph.values]
        ops = []
        for op in graph.ops:
            before, after = touched(op, old), touched(op, nbytes)
            scale = after / before if before > 0 else 1.0
            ops.append(replace(op, time=op.time * scale, workspace=int(op.workspace * scale),
                               rerun_time=None if op.rerun_time is None
                               else op.rerun_time * scale))
        values = tuple(replace(v, nbytes=n) if v.nbytes != n else v
                       for v, n in zip(graph.values, nbytes))
        result = replace(graph, ops=tuple(ops), values=values)
        if len(self._cache) < 256:
            self._cache[sizes] = result
        return result
