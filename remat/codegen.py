"""Turn a :class:`Schedule` into the forward and backward ``fx.GraphModule`` pair AOTAutograd runs.

NOTE [ Code generation ]
AOTAutograd's runtime expects a fixed interface: the forward returns the forward outputs
followed by the saved values, and the backward takes the saved values and the tangents and
returns one gradient per input (:func:`_interface`). We build it ourselves rather than through
PyTorch's ``_extract_fwd_bwd_modules``, which drops any saved value its own backward would not
read: ours may drop a saved value and recompute it later, so it reads inputs PyTorch's would not.
The bodies are emitted in schedule order. Every recomputation is a fresh copy of the forward node placed
right before its first use (PyTorch's extractor hoists recomputations to the top of the
backward, which keeps them alive far too long); later readers bind to the newest copy, and FX
frees each value after its last use, so the generated graphs allocate exactly what
:func:`remat.schedule.simulate` predicts. Saved tensors are matched to backward placeholders by
position only, which is why the interface comes from the same call for both graphs.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

from .errors import internal_assert
from .graph import ValueKind
from .lowering import Lowered
from .schedule import Schedule, save_storages
from .symbolic import is_symbolic_scalar

__all__ = ["generate_modules", "backward_reads", "direct_calls"]


def backward_reads(lowered: Lowered, schedule: Schedule) -> list[int]:
    """Values the backward graph must receive: saved activations read before any
    recomputation of them, and graph inputs (parameters, user inputs) read in backward."""
    graph = lowered.graph
    produced: set[int] = set()
    reads: dict[int, None] = {}
    for i in schedule.backward:
        op = graph.ops[i]
        for v in op.inputs:
            kind = graph.values[v].kind
            if v in produced or kind is ValueKind.TANGENT:
                continue
            if kind is ValueKind.INPUT or v in schedule.saved or v in graph.user_outputs:
                reads[v] = None
        produced.update(op.outputs)
    return list(reads)


def _copy_op(
    new_graph: fx.Graph, lowered: Lowered, op_index: int, env: dict[fx.Node, fx.Node]
) -> None:
    """Emit one op (and the ``getitem``s of its outputs), reading the newest instances."""
    node = lowered.op_nodes[op_index]
    copy = new_graph.node_copy(node, lambda n: env[n])
    env[node] = copy
    for v in lowered.graph.ops[op_index].outputs:
        out = lowered.value_nodes[v]
        if out is node:
            continue
        internal_assert(out.target is operator.getitem, f"{out.name} should be a getitem")
        env[out] = new_graph.node_copy(out, lambda n: env[n])


def _interface(joint: fx.GraphModule, saved: list[fx.Node], num_fwd_outputs: int):
    """AOTAutograd's calling convention for the two graphs.

    Forward: ``(primals...) -> (forward outputs..., saved...)``; backward:
    ``(saved..., tangents...) -> (gradients...)``. Saved tensors that skip autograd's version
    check go after the others, and saved sizes after all tensors in forward's outputs but first
    in backward's inputs (PyTorch's convention, so the runtime slices them correctly).
    """
    from torch._functorch._aot_autograd.descriptors import (
        SavedForBackwardsAOTOutput,
        SavedForBackwardsNoVcCheckAOTOutput,
    )
    from torch._functorch.partitioners import _extract_fwd_bwd_outputs

    fwd_out, bwd_out, fwd_descs, bwd_descs = _extract_fwd_bwd_outputs(
        joint, num_fwd_outputs=num_fwd_outputs)
    sizes = [n for n in saved if is_symbolic_scalar(n.meta.get("val"))]
    tensors = [n for n in saved if n not in set(sizes)]
    checked = [n for n in tensors if not n.meta.get("saved_tensor_with_no_vc_check", False)]
    unchecked = [n for n in tensors if n.meta.get("saved_tensor_with_no_vc_check", False)]
    tensors = checked + unchecked
    saved_descs = [SavedForBackwardsAOTOutput(i) if i < len(checked) or i >= len(tensors)
                   else SavedForBackwardsNoVcCheckAOTOutput(i)
                   for i in range(len(tensors) + len(sizes))]
    placeholders = joint.graph.find_nodes(op="placeholder")
    primals = [n for n in placeholders if not n.name.startswith("tangents")]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    # Saved sizes (SymInts) come after the saved tensors in forward's outputs and before them
    # in backward's inputs (see NOTE [ Dynamic shapes ]).
    return (primals, list(fwd_out) + tensors + sizes, list(fwd_descs) + saved_descs,
            sizes + tensors + tangents, list(bwd_out), list(bwd_descs))


def _emit(inputs: list[fx.Node], ops: tuple[int, ...], outputs: list, descs: list,
          lowered: Lowered) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        new = graph.placeholder(node.name)
        new.meta = node.meta
        env[node] = new
    for node in lowered.value_nodes:
        if node.op == "get_attr":
            env[node] = graph.node_copy(node)
    for node in lowered.size_nodes:  # backward receives the ones it reads as inputs
        if node not in env and all(a in env for a in node.all_input_nodes):
            env[node] = graph.node_copy(node, lambda n: env[n])
    for i in ops:
        _copy_op(graph, lowered, i, env)
    out = graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    out.meta["desc"] = descs
    graph.lint()
    return graph


def generate_modules(lowered: Lowered, schedule: Schedule, joint: fx.GraphModule
                     ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graph modules that execute ``schedule``.

    Args:
        lowered: The lowered joint graph.
        schedule: A schedule that :func:`remat.schedule.simulate` accepts.
        joint: The joint graph module (owner of any constants the graphs read).

    Returns:
        ``(forward, backward)`` graph modules with AOTAutograd's calling convention.
    """
    schedule = save_storages(lowered.graph, schedule)  # NOTE [ Save storages, not views ]
    saved = [lowered.value_nodes[v] for v in backward_reads(lowered, schedule)]
    primals, fw_out, fw_descs, bw_in, bw_out, bw_descs = _interface(
        joint, saved, lowered.num_fwd_outputs)
    forward = _emit(primals, schedule.forward, fw_out, fw_descs, lowered)
    backward = _emit(bw_in, schedule.backward, bw_out, bw_descs, lowered)
    return fx.GraphModule(joint, forward), fx.GraphModule(joint, backward)


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm`` call each ATen op's C++ entry point directly, without a Python frame.

    NOTE [ Ops called without a Python frame ]: FX emits ``torch.ops.aten.mm.default(x, y)``,
    which runs ``OpOverload.__call__``, a one-line Python function, so every op of a step pushes
    and pops a Python frame. CPython 3.11 keeps frames in 16 KiB chunks and frees a chunk as
    soon as the frame that opened it returns: when the graph's own (large) frame ends just short
    of a chunk's end, every op call maps a fresh chunk and unmaps it again. Whether that happens
    depends only on how deep the caller's stack is: on a 12-layer GPT at 50% the same module's
    step took 260 ms instead of 197 ms (1,353 page faults a step instead of 7) when called with
    a 15 KiB deeper stack, and ``python -m benchmarks.remat_solvers`` measured +12-30% where a
    script importing it measured +4-9%. Calling ``OpOverload._op`` (what ``__call__`` calls,
    a builtin) through a :func:`functools.partial` (called in C) leaves no Python frame per op.
    """
    calls: dict[torch._ops.OpOverload, functools.partial] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target not in calls:
            entry = getattr(target, "_op", None)
            if not callable(entry):  # another PyTorch: keep the op as FX prints it
                continue
            call = calls[target] = functools.partial(entry)
            # FX binds it to a global of this name (not a torch.* path: it is not from torch)
            call.__name__ = f"{target.namespace}_{target.__name__.replace('.', '_')}"
            call.__module__ = __name__
        node.target = calls[target]
    return gm


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """Switch a graph module to the boxed calling convention: it receives its inputs as one list
    and clears it, so saved tensors are freed at their last use instead of at the end."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()  # GraphModule._boxed_call now reads True: AOTAutograd passes a list
    return gm
