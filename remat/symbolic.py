"""Symbolic sizes: what a dynamic-shape joint graph says about bytes, and its value on a batch.

NOTE [ Dynamic shapes ]
Once a second shape comes, ``rematerialize`` captures with dynamic dimensions (NOTE [ Static
first ] in remat/module.py; ``torch.compile(dynamic=True)``), so one joint graph stands for
every batch size and sequence length: tensor shapes in it are sympy
expressions of a few size symbols (``s27*s52*512``). Lowering evaluates them at the captured
batch (its *hint*) for the solvers, which only ever see plain integers, and keeps the
expressions so that a schedule can be re-priced at any other size without tracing again
(:mod:`remat.sizes`). Nothing here adds a guard: hints are read with
``optimization_hint``, never by comparing symbolic values.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["hint", "size_expr", "is_symbolic_scalar", "free_symbol_names", "symbol_values",
           "input_dims", "fixed_dims"]


def is_symbolic_scalar(val: Any) -> bool:
    """Whether ``val`` is a symbolic (or plain Python) scalar rather than a tensor."""
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def hint(val: Any) -> int:
    """The concrete value of an int or ``SymInt`` on the captured example (adds no guard)."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    if isinstance(val, torch.SymInt):
        return int(optimization_hint(val))
    return int(val)


def size_expr(val: Any) -> Any:
    """A sympy expression for an int or ``SymInt`` (a plain ``int`` when it is static)."""
    if isinstance(val, torch.SymInt):
        expr = val.node.expr
        return int(expr) if expr.is_number else expr
    return int(val)


def free_symbol_names(expr: Any) -> set[str]:
    """Names of the size symbols in an expression (empty for an ``int``)."""
    return {s.name for s in getattr(expr, "free_symbols", ())}


def _shape_env(nodes):
    for node in nodes:
        val = node.meta.get("val", node.meta.get("example_value"))
        for s in (getattr(val, "shape", None) or ()) if isinstance(val, torch.Tensor) else (val,):
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


def symbol_values(graph: "torch.fx.Graph") -> dict[str, int]:
    """Each size symbol of a dynamic-shape graph and its value on the captured example."""
    env = _shape_env(graph.find_nodes(op="placeholder"))
    if env is None:
        return {}
    table = getattr(env, "backed_var_to_val", None) or env.var_to_val
    return {str(k): int(v) for k, v in table.items()}


def input_dims(graph: "torch.fx.Graph", example_inputs, leaves) -> dict[str, tuple[int, int]]:
    """For each size symbol that is a dimension of a call's input: (leaf index, dimension).

    ``graph`` is dynamo's graph, ``example_inputs`` what dynamo passed for its placeholders,
    ``leaves`` the flattened tensors of the user's call (matched by identity). A symbol several
    inputs share (``input_ids`` and ``labels``) is read from the one the call passes first, the
    name a person reads it by (NOTE [ Naming sizes ] in ``remat/calls.py``).
    """
    position: dict[int, int] = {}  # a tensor passed twice (input_ids=ids, labels=ids): the first
    for k, t in enumerate(leaves):
        if isinstance(t, torch.Tensor):
            position.setdefault(id(t), k)
    found: dict[str, tuple[int, int]] = {}
    for node, real in zip(graph.find_nodes(op="placeholder"), example_inputs):
        fake = node.meta.get("example_value")
        if not isinstance(fake, torch.Tensor) or id(real) not in position:
            continue
        for dim, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbol, where = str(size.node.expr), (position[id(real)], dim)
                found[symbol] = min(found.get(symbol, where), where)
    return found


def fixed_dims(graph: "torch.fx.Graph", example_inputs, leaves
               ) -> tuple[tuple[int | None, ...] | None, ...]:
    """Per leaf of a call (as for :func:`input_dims`), the sizes the capture fixed: for a
    tensor dynamo took as an input, its shape with ``None`` at every symbolic dimension; ``None``
    for any other leaf.

    NOTE [ A graph serves the sizes it did not fix ]
    A graph captured with dynamic dimensions stands for every value of its symbols, and for no
    other value of the dimensions dynamo specialised: a batch of 1 is traced as a graph of its
    own, whose batch dimension is the constant 1. Its schedules were still chosen for batches of
    8, priced as if of 1: a tiny GPT-2 at "50%" ran a batch of (8, 50) eagerly after (1, 100)
    and (1, 50), at 1.36x the budget. A call is served by a family whose fixed sizes all match, else by one whose
    sizes fixed at 1 match (:meth:`remat.sizes.ShapePlans.family_for`), else captured. A size
    fixed at another value is dynamo keeping a dimension static that it could have made
    dynamic: a stamp an earlier ``torch.compile`` left on the user's input tensor (NOTE [ The
    user's tensors leave as they came ] in remat/calls.py) made a GPT's targets static in
    every capture of ``benchmarks.remat_shapes``, and requiring those to match captured and
    solved every one of its 24 shapes (9 solves before). Such a graph still serves the other
    sizes: a compiled choice is guarded by dynamo, and an eager one is priced on the graph,
    off only by what depends on that dimension alone (the targets, not the logits)."""
    shapes: dict[int, tuple[int | None, ...]] = {}  # id of an input tensor -> its fixed sizes
    for node, real in zip(graph.find_nodes(op="placeholder"), example_inputs):
        fake = node.meta.get("example_value")
        if isinstance(fake, torch.Tensor):
            shapes[id(real)] = tuple(None if isinstance(d, torch.SymInt) else int(d)
                                     for d in fake.shape)
    # every leaf that is one of them (``input_ids=ids, labels=ids``: both)
    return tuple(shapes.get(id(t)) if isinstance(t, torch.Tensor) else None for t in leaves)

