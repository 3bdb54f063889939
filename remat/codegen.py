"""Turn a :class:`Schedule` into the forward and backward ``fx.GraphModule`` pair AOTAutograd runs.

NOTE [ Code generation ]
AOTAutograd's runtime expects a fixed interface: the forward returns the forward outputs
followed by the saved values (in its own order), and the backward takes the saved values and the
tangents and returns one gradient per input. We let PyTorch's own
``_extract_fwd_bwd_modules`` build that interface from our saved set (so its ordering
conventions stay PyTorch's), keep only its placeholders and outputs, and emit the bodies
ourselves in schedule order. Every recomputation is a fresh copy of the forward node placed
right before its first use (PyTorch's extractor hoists recomputations to the top of the
backward, which keeps them alive far too long); later readers bind to the newest copy, and FX
frees each value after its last use, so the generated graphs allocate exactly what
:func:`remat.schedule.simulate` predicts. Saved tensors are matched to backward placeholders by
position only, which is why the interface comes from the same call for both graphs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._functorch.partitioners import _extract_fwd_bwd_modules

from .errors import internal_assert
from .graph import ValueKind
from .lowering import Lowered
from .schedule import Schedule

__all__ = ["generate_modules", "backward_reads"]


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


def _placeholders(new_graph: fx.Graph, template: fx.GraphModule, by_name: dict[str, fx.Node],
                  env: dict[fx.Node, fx.Node]) -> None:
    for ph in template.graph.find_nodes(op="placeholder"):
        new = new_graph.placeholder(ph.name)
        new.meta = ph.meta
        env[by_name[ph.name]] = new


def _output(new_graph: fx.Graph, template: fx.GraphModule, by_name: dict[str, fx.Node],
            env: dict[fx.Node, fx.Node]) -> None:
    out = template.graph.find_nodes(op="output")[0]
    args = fx.map_arg(out.args, lambda n: env[by_name[n.name]])
    new_out = new_graph.output(args[0])
    new_out.meta = dict(out.meta)


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
    by_name = {n.name: n for n in joint.graph.nodes}
    saved_nodes = [lowered.value_nodes[v] for v in backward_reads(lowered, schedule)]
    fw_template, bw_template = _extract_fwd_bwd_modules(
        joint, saved_nodes, [], num_fwd_outputs=lowered.num_fwd_outputs
    )

    fw_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    _placeholders(fw_graph, fw_template, by_name, env)
    for node in lowered.value_nodes:
        if node.op == "get_attr":
            env[node] = fw_graph.node_copy(node)
    for i in schedule.forward:
        _copy_op(fw_graph, lowered, i, env)
    _output(fw_graph, fw_template, by_name, env)

    bw_graph = fx.Graph()
    env = {}
    _placeholders(bw_graph, bw_template, by_name, env)
    for node in lowered.value_nodes:
        if node.op == "get_attr":
            env[node] = bw_graph.node_copy(node)
    for i in schedule.backward:
        _copy_op(bw_graph, lowered, i, env)
    _output(bw_graph, bw_template, by_name, env)

    fw_graph.lint()
    bw_graph.lint()
    return fx.GraphModule(joint, fw_graph), fx.GraphModule(joint, bw_graph)


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """Switch a graph module to the boxed calling convention: it receives its inputs as one list
    and clears it, so saved tensors are freed at their last use instead of at the end."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()  # GraphModule._boxed_call now reads True: AOTAutograd passes a list
    return gm
