"""Joint-graph rewrites applied before scheduling.

NOTE [ Dropout: save the mask, recompute the product ]
A random op can never be recomputed (its numbers would change), so whatever backward needs from
it must be saved. ``native_dropout(x, p, train)`` returns ``(x * mask * scale, mask)``; saving the
float output costs 4 bytes per element, the bool mask 1. We split the op into what is random and
what is not: ``mask = bernoulli(empty_like(x, dtype=bool), 1 - p)`` (the draw, the same numbers
from the same random stream as eager), ``keep = mask.to(x.dtype)`` and the output
``mul(mul(x, keep), scale)``; ``native_dropout_backward(grad, mask, scale)`` becomes
``mul(mul(grad, keep), scale)``. Everything after the draw is an ordinary recomputable op, so
the solver chooses per dropout: keep ``keep`` (4 bytes, as eager does) and run backward at
eager's speed, or keep ``mask`` (1 byte) and cast it again where backward needs it. Multiplying
by a bool tensor casts it inside the multiply, a slow unvectorized pass (a 393K-element mask:
~300 us vs ~100 us for the multiply itself, on CPU), which the old ``native_dropout_backward``
paid in every step. The random op runs once in forward, and nothing runs twice there:
rewriting only the output's readers (leaving ``native_dropout`` to compute a product nobody
read) cost a 6-layer GPT two extra passes over every dropout's tensor. This is bit-exact only
if it reproduces eager's draws and arithmetic, so for each (device, dtype, p) we check it once
on a probe tensor against eager ``torch.nn.functional.dropout`` (what models call, and what the
graph's ``native_dropout`` was decomposed from) and leave the op alone where it does not hold
(CUDA, whose fused kernel draws its own way: there ``native_dropout`` is eager's own kernel).

NOTE [ Eager dropout in half precision on CPU ]
On CPU, eager ``dropout`` is not ``native_dropout``: it draws ``noise = empty_like(x)
.bernoulli_(1 - p)``, divides it in place by ``1 - p`` *in x's dtype* and returns ``x * noise``
(backward: ``grad * noise``). In fp32 and fp64 that rounds as ``native_dropout``'s ``x * mask *
scale`` does, but in bf16 ``1 / 0.9`` rounds to 1.109375 and ``x * 1.109375`` is not
``x * 1.1111``: the traced graph's ``native_dropout`` (``torch.compile(backend="aot_eager")``
too) differed from eager by 0.16 on a bf16 GPT-2 block's output. So there the split builds
eager's form: ``keep = mask.to(dtype) / (1 - p)`` (the noise), ``output = x * keep``, gradient
``grad * keep``; the same draws, the same roundings, and still a recomputable ``keep``.

NOTE [ Dropout draws in memory order ]
``native_dropout`` fills its mask in place (``empty_like(x).bernoulli_(1 - p)``): the mask has
``x``'s strides and the random numbers land in *memory* order. The functional ``bernoulli.p``
that a graph can hold returns a contiguous tensor filled in *logical* order. For a contiguous
``x`` the two agree; for a transposed one (``nn.MultiheadAttention`` with ``batch_first=True``
hands its ``dropout1``/``dropout2`` a transposed output) every element got another element's
draw: an ``nn.TransformerEncoder`` with dropout 0.1 differed from eager by 0.7 in its output,
with nothing recomputed. So the draw is made on ``x`` permuted into its memory order (a
contiguous shape, filled in the order eager fills it) and permuted back; the order is that of
the mask ``empty_like`` makes for ``x`` (a strided slice gets dense strides in ``x``'s order).
The exactness probe checks a contiguous, a transposed and a strided input.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

__all__ = ["alias_clones", "bind_sizes", "split_dropout"]

aten = torch.ops.aten


def _replace(node: fx.Node, by: fx.Node) -> None:
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)


def _recompiled(joint: fx.GraphModule, changes: int) -> int:
    """Check and regenerate ``joint``'s code after a pass made ``changes`` (returned)."""
    if changes:
        joint.graph.lint()
        joint.recompile()
    return changes


# NOTE [ Dropout: save the mask, recompute the product ]'s forms: "product" multiplies by the
# 0/1 mask, then by the scale (``native_dropout``'s arithmetic); "noise" multiplies by the mask
# divided by ``1 - p`` in the input's dtype (NOTE [ Eager dropout in half precision on CPU ]).
_FORMS = ("product", "noise")


@functools.lru_cache(maxsize=64)
def _dropout_split_form(device: str, dtype: torch.dtype, p: float) -> str | None:
    """The form of NOTE [ Dropout: save the mask, recompute the product ]'s split that draws the
    same mask from the same random stream as eager ``dropout`` and equals its output and
    gradient bit for bit, or ``None`` (the op is left alone)."""
    if not 0.0 <= p < 1.0:
        return None
    x = torch.linspace(-3.0, 3.0, 4 * 1031, dtype=torch.float64).to(device=device, dtype=dtype)
    grad = torch.linspace(-1.0, 5.0, 4 * 1031, dtype=torch.float64).to(device=device, dtype=dtype)
    # NOTE [ Dropout draws in memory order ]: a contiguous, a transposed and a strided input.
    layouts = [(x, grad), (x.view(4, 1031).t(), grad.view(4, 1031).t()),
               (x.view(4, 1031)[:, ::2].t(), grad.view(4, 1031)[:, ::2].t())]
    return next((form for form in _FORMS
                 if all(_split_matches(x, grad, p, form) for x, grad in layouts)), None)


def _split_matches(x: torch.Tensor, grad: torch.Tensor, p: float, form: str) -> bool:
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    leaf = x.detach().requires_grad_()  # x's strides: eager fills its noise in x's memory order
    with torch.random.fork_rng(devices=devices), torch.enable_grad():  # the user's streams
        # are left as they were; a pass may run under no_grad
        _seed(x.device)
        out = torch.nn.functional.dropout(leaf, p, True)
        after = torch.rand(4, device=x.device)
        _seed(x.device)
        _, keep, split_out = _split_dropout(x, p, form=form)
        split_after = torch.rand(4, device=x.device)
    out.backward(grad)
    return bool(torch.equal(out, split_out) and torch.equal(after, split_after)
                and torch.equal(leaf.grad, _split_dropout_grad(grad, keep, p, form=form)))


def _seed(device: torch.device) -> None:
    """Seed the one random stream the probe draws from (other devices' are not forked)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(0)
    else:
        torch.random.default_generator.manual_seed(0)


def _eagerly(target, *args, **kwargs):
    return target(*args, **kwargs)


def _split_dropout(x, p: float, call=_eagerly, *, form: str):
    """``dropout(x, p, True)`` as its draw and a product: ``(mask, keep, output)``, with
    ``keep`` the mask as numbers of ``x``'s dtype (``form``: 0/1, or the noise, see
    ``_FORMS``). ``call`` applies each op (eagerly, or adding it to a graph)."""
    # The draw's output is the 1-byte mask itself: a random op's outputs can only be kept, never
    # recomputed, so a float draw cast to bool would have had a "keep nothing" forward keep
    # 4 bytes per element (the draws are the same: bernoulli fills a bool tensor from the
    # same numbers).
    val = x if isinstance(x, torch.Tensor) else x.meta["val"]
    order = _memory_order(val)  # NOTE [ Dropout draws in memory order ]
    if order is None:
        mask = call(aten.bernoulli.p, call(aten.empty_like.default, x, dtype=torch.bool), 1.0 - p)
    else:
        like = call(aten.empty_like.default, call(aten.permute.default, x, order),
                    dtype=torch.bool)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        mask = call(aten.permute.default, call(aten.bernoulli.p, like, 1.0 - p), inverse)
    keep = call(aten._to_copy.default, mask, dtype=val.dtype)
    if form == "noise":
        keep = call(aten.div.Scalar, keep, 1.0 - p)
        return mask, keep, call(aten.mul.Tensor, x, keep)
    kept = call(aten.mul.Tensor, x, keep)
    return mask, keep, call(aten.mul.Scalar, kept, 1.0 / (1.0 - p))


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The permutation of ``t``'s dimensions, outermost first, in which eager lays out (and
    fills) a mask like ``t``; ``None`` when that is the logical order (NOTE [ Dropout draws in
    memory order ]). Asks ``empty_like`` itself, which is dense by construction (a strided ``t``
    gets dense strides in ``t``'s order). Reads size hints, adds no guard."""
    from .symbolic import hint

    like = torch.empty_like(t, dtype=torch.bool)
    strides = [hint(n) for n in like.stride()]
    order = sorted(range(t.dim()), key=lambda d: -strides[d])  # stable: size-1 dims keep place
    return None if order == list(range(t.dim())) else order


def _split_dropout_grad(grad, keep, p: float, call=_eagerly, *, form: str):
    """``native_dropout_backward(grad, mask, 1 / (1 - p))`` from the mask as numbers, in
    ``form``'s arithmetic (``_FORMS``)."""
    if form == "noise":
        return call(aten.mul.Tensor, grad, keep)
    return call(aten.mul.Scalar, call(aten.mul.Tensor, grad, keep), 1.0 / (1.0 - p))


def split_dropout(joint: fx.GraphModule) -> int:
    """Apply NOTE [ Dropout: save the mask, recompute the product ] in place.

    Returns:
        How many dropout ops were rewritten.
    """
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    graph = joint.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default:
            continue
        x, p = node.args[0], float(node.args[1])
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if train is False or not isinstance(val, torch.Tensor):
            continue
        # the probe runs eager dropout as the user's model does: not under the tracer's Python
        # dispatcher, which decomposes it into native_dropout
        with unset_fake_temporarily(), no_python_dispatcher():
            form = _dropout_split_form(val.device.type, val.dtype, p)
        if form is None:
            continue
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if outs.get(0) is None or not outs[0].users or len(outs) != len(node.users):
            continue

        def call(target, *args, at=node, **kwargs):
            new = graph.call_function(target, args, kwargs)
            new.meta = {k: v for k, v in at.meta.items() if k != "val"}
            # Run on the fake values: each node's own shape and strides (a permuted draw).
            new.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                       for a in args], **kwargs)
            return new

        with graph.inserting_before(node):
            mask, keep, product = _split_dropout(x, p, call, form=form)
        _replace(outs[0], product)
        if 1 in outs:
            for user in list(outs[1].users):
                if (user.target is aten.native_dropout_backward.default
                        and user.args[1] is outs[1] and user.args[2] == 1.0 / (1.0 - p)):
                    with graph.inserting_before(user):
                        _replace(user, _split_dropout_grad(user.args[0], keep, p,
                                                           functools.partial(call, at=user),
                                                           form=form))
            _replace(outs[1], mask)
        graph.erase_node(node)
        rewritten += 1
    return _recompiled(joint, rewritten)


def _size_node(graph: fx.Graph, expr, bound: dict, made: dict, cursor: list[fx.Node]):
    """An fx node (or int) computing ``expr`` from the size placeholders, or ``None``.

    New nodes go right after ``cursor[0]`` (which then moves to them), so every node is placed
    after the ones it reads.
    """
    import sympy

    if expr in made:
        return made[expr]
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return bound.get(expr)
    if isinstance(expr, (sympy.Mul, sympy.Add)):
        parts = [_size_node(graph, a, bound, made, cursor) for a in expr.args]
    elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        parts = [_size_node(graph, expr.base, bound, made, cursor)] * int(expr.exp)
        expr = sympy.Mul(*([expr.base] * int(expr.exp)), evaluate=False)
    else:
        return None
    if any(p is None for p in parts):
        return None
    combine = operator.mul if isinstance(expr, (sympy.Mul, sympy.Pow)) else operator.add
    node = parts[0]
    for part in parts[1:]:
        with graph.inserting_after(cursor[0]):
            new = graph.call_function(combine, (node, part))
        new.meta["val"] = combine(node.meta["val"] if isinstance(node, fx.Node) else node,
                                  part.meta["val"] if isinstance(part, fx.Node) else part)
        cursor[0] = node = new
    made[expr] = node
    return node


def bind_sizes(joint: fx.GraphModule) -> int:
    """Compute every size of a dynamic-shape graph from its size inputs.

    NOTE [ Sizes come from the inputs ]
    A dynamic-shape joint graph reads sizes off tensors (``sym_size(view_3, 0)``) and passes
    them to the ops that need them (``view(x, [sym_size_int, 64])``). To a scheduler those are
    data edges from wherever the tensor was made, across blocks and phases, although a size is
    a function of the graph's size inputs alone. This rewrites each such size as arithmetic on
    the size placeholders (dynamo passes every symbol as one), so the only remaining edges are
    from the inputs, which every op may read at any time.

    Returns:
        How many size reads were rewritten.
    """
    graph = joint.graph
    placeholders = graph.find_nodes(op="placeholder")
    bound = {}
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            bound.setdefault(val.node.expr, node)
    if not bound:
        return 0
    made: dict = {}
    made_nodes: set[fx.Node] = set()
    cursor = [placeholders[-1]]
    rewritten = 0
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.SymInt) or not node.users:
            continue
        if all(a.op == "placeholder" or a in made_nodes for a in node.all_input_nodes):
            continue  # already arithmetic on size inputs
        expr = val.node.expr
        if expr.is_number or not expr.free_symbols <= set(bound):
            continue
        source = _size_node(graph, expr, bound, made, cursor)
        made_nodes = {n for n in made.values() if isinstance(n, fx.Node)}
        if source is None:
            continue
        _replace(node, source)
        rewritten += 1
    return _recompiled(joint, rewritten)



def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def alias_clones(joint: fx.GraphModule) -> int:
    """Read the source of every copy that nobody needs as a copy.

    NOTE [ Copies nobody mutates ]
    ``nn.Dropout(p=0.0)`` in training mode (the default of many configs: GPT-2 with zero
    dropout, Llama's attention dropout) decomposes to ``clone(x)``. In a functional graph a copy
    that neither it nor its source is ever written to is the same value: eager returns ``x``
    itself, while the joint graph saved both ``x`` (for the activation's backward) and the
    clone (for the next matmul's backward), two storages for one value (4 x 4 MiB on a
    4-layer TransformerEncoder, the whole excess of its saved bytes over eager's). We replace
    the clone's reads by reads of its source when the clone keeps the source's layout (no
    ``memory_format`` other than ``preserve_format``, equal strides), neither is mutated in
    place, and the clone is not a model output (AOTAutograd decided outputs' aliasing before
    the partition). Exact, and one copy faster.

    Returns:
        How many clones were removed.
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    graph = joint.graph
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.clone.default:
            continue
        source = node.args[0]
        layout = node.kwargs.get("memory_format", torch.preserve_format)
        if not isinstance(source, fx.Node) or layout is not torch.preserve_format:
            continue
        src_val, val = source.meta.get("val"), node.meta.get("val")
        if not isinstance(src_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        if src_val.dtype != val.dtype or not statically_known_true(
                sym_eq(tuple(src_val.stride()), tuple(val.stride()))):
            continue
        readers = [*node.users, *source.users]
        if any(u.op == "output" for u in node.users) or any(_mutates(u) for u in readers):
            continue
        _replace(node, source)
        removed += 1
    return _recompiled(joint, removed)
