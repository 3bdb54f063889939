"""Translate an AOTAutograd joint graph (``torch.fx``) into a plain-data :class:`RematGraph`.

The :class:`Lowered` result keeps the links back to fx nodes for code generation; solvers get
only ``lowered.graph``.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import CaptureError
from .graph import Op, Phase, RematGraph, Value, ValueKind
from .symbolic import hint, is_symbolic_scalar, size_expr

__all__ = ["Lowered", "lower_joint_graph", "module_path"]


@dataclass(frozen=True)
class Lowered:
    """A joint graph and its plain-data view.

    Attributes:
        graph: The :class:`RematGraph` solvers work on.
        op_nodes: fx node of each op.
        value_nodes: fx node of each value (the op node itself, a ``getitem`` or a placeholder).
        num_fwd_outputs: How many entries of the joint output belong to forward.
        size_exprs: Bytes of each value's storage as a size expression (``int`` when static;
            see NOTE [ Dynamic shapes ]); ``graph.values[i].nbytes`` is its value on the
            captured example.
        size_nodes: Size arithmetic on the size inputs (NOTE [ Sizes come from the inputs ]),
            in graph order: inputs to the solvers, emitted at the top of forward.
    """

    graph: RematGraph
    op_nodes: tuple[fx.Node, ...]
    value_nodes: tuple[fx.Node, ...]
    num_fwd_outputs: int
    size_exprs: tuple[object, ...] = ()
    size_nodes: tuple[fx.Node, ...] = ()


_ROOT = re.compile(r"^L\['[^']*'\]\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_path(qualified: str) -> str:
    """Normalise a dynamo module path: ``"L['self'].layers[0].attn"`` -> ``"layers.0.attn"``."""
    path = _ROOT.sub("", qualified)
    path = _INDEX.sub(r".\1", path).replace("._modules.", ".").replace("_modules.", "")
    return path.strip(".")


def _node_module(node: fx.Node) -> str:
    """The path of the module whose forward ran ``node``'s op, under the captured model.

    NOTE [ Modules held in globals ]
    A module the model reaches through a global rather than an attribute (Hugging Face's
    kernel-hub functions are module instances: Llama's, Qwen2's and Mistral's
    ``apply_rotary_pos_emb``, Mamba's ``mamba_selective_scan``) appears in dynamo's stack as
    ``G['...'].name``, one path for every layer that calls it. A 2-layer HF Mamba then had both
    layers' scans (880 of its 912 forward ops) under one path outside ``backbone.layers``, so
    the hierarchy's blocks cut across layers and its lowest schedule was 55% of eager's step,
    where keeping each layer's inputs reaches 52%. Such a module is placed under the module that
    called it (``backbone.layers.0.mixer.mamba_selective_scan``), as its code runs there.
    """
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = ""
    for qualified, _ in stack.values():
        qualified = str(qualified)
        if _ROOT.match(qualified) or not path:
            path = module_path(qualified)
        else:  # reached through a global: under its caller, by its own name
            path = f"{path}.{module_path(qualified).rpartition('.')[2]}"
    return path


def _is_tensor(val: object) -> bool:
    return isinstance(val, torch.Tensor)


def _storage_nbytes(val: torch.Tensor) -> tuple[int, object]:
    """Bytes of ``val``'s storage on the captured example, and as a size expression
    (see NOTE [ Dynamic shapes ])."""
    try:
        nbytes = val.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - some fake/subclass tensors have no storage
        nbytes = val.numel() * val.element_size()
    return hint(nbytes), size_expr(nbytes)


def _alias_sources(node: fx.Node) -> tuple[int | None, bool]:
    """(index of the argument the output aliases, whether list elements alias it)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None, False
    returns = schema.returns
    for index, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or info.is_write:
            continue
        if "*" in info.after_set:
            return index, True
        for ret in returns:
            if ret.alias_info is not None and ret.alias_info.before_set & info.before_set:
                return index, False
    return None, False


_BATCH_NORM = torch.ops.aten._native_batch_norm_legit_functional.default


def _is_recomputable(node: fx.Node, mutated: set[fx.Node]) -> bool:
    """Whether running ``node`` again gives the same values.

    NOTE [ Ops that read a mutated input ]
    Inputs that forward mutates (BatchNorm running statistics, counters) are written back right
    after forward, so a recomputation would read the *new* values. Such ops are never recomputed,
    except BatchNorm in training mode: the outputs backward uses (normalized output, batch mean
    and inverse std) depend only on the batch, and its running-statistics outputs are those of
    the first forward (the recomputed ones are discarded), so statistics update exactly once.
    """
    if is_symbolic_scalar(node.meta.get("val")):
        return False  # a size (SymInt) or other scalar: saving it costs nothing
    if any(a in mutated for a in node.all_input_nodes):
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        if not (node.target is _BATCH_NORM and training is True):
            return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        schema = target._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return False
        if schema.is_mutable:
            return False
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False
    return not node.is_impure()


def _signature(node: fx.Node) -> str:
    def describe(a: object) -> str:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if _is_tensor(val):
                return f"T{tuple(val.shape)}{str(val.dtype)[6:]}"
            return "N"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(describe(x) for x in a) + "]"
        return repr(a)

    args = ",".join(describe(a) for a in node.args)
    kwargs = ",".join(f"{k}={describe(v)}" for k, v in sorted(node.kwargs.items()))
    return f"{node.target}({args};{kwargs})"


def _output_descs(joint: fx.GraphModule) -> list[object]:
    out = next(iter(reversed(joint.graph.nodes)))
    return list(out.meta.get("desc") or [])


def _mutated_inputs(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """Placeholders whose tensors forward mutates (written back after it runs).

    They may still be read by a recomputed BatchNorm (see NOTE [ Ops that read a mutated
    input ]), so they are saved without autograd's version check, which the write-back bumps.
    """
    descs = _output_descs(joint)[:num_fwd_outputs]
    targets = {d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"}
    mutated = {n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("desc") in targets}
    for node in mutated:
        node.meta["saved_tensor_with_no_vc_check"] = True
    return mutated


def lower_joint_graph(joint: fx.GraphModule, *, num_fwd_outputs: int) -> Lowered:
    """Build the plain-data graph of an AOTAutograd joint forward+backward graph.

    Args:
        joint: The joint graph handed to a partition function.
        num_fwd_outputs: Number of leading outputs that belong to forward.

    Returns:
        The :class:`Lowered` graph.

    Raises:
        CaptureError: for graph features remat cannot schedule (unknown placeholders).
    """
    nodes = list(joint.graph.nodes)
    output_node = nodes[-1]
    mutated = _mutated_inputs(joint, num_fwd_outputs)
    value_of: dict[fx.Node, int] = {}
    values: list[Value] = []
    value_nodes: list[fx.Node] = []
    exprs: list[object] = []

    def add_value(node: fx.Node, kind: ValueKind, producer: int, nbytes: tuple[int, object],
                  alias: int | None) -> int:
        value_of[node] = len(values)
        scalar = is_symbolic_scalar(node.meta.get("val"))
        values.append(Value(node.name, kind, producer, nbytes[0], alias, scalar))
        exprs.append(nbytes[1])
        value_nodes.append(node)
        return value_of[node]

    # Like PyTorch's default partitioner, untagged nodes traced after the last forward-tagged one
    # belong to backward (a custom autograd.Function's backward is traced without tags, and its
    # tangent-free ops, e.g. unpacking saved codes, must not be hoisted into forward).
    last_forward = max((k for k, n in enumerate(nodes) if n.meta.get("partitioner_tag") == "is_forward"),
                       default=-1)
    backward_nodes: set[fx.Node] = set()
    op_candidates: list[fx.Node] = []
    size_nodes: list[fx.Node] = []
    for position, node in enumerate(nodes):
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                add_value(node, ValueKind.TANGENT, -1, _storage_nbytes(node.meta["val"]), None)
                backward_nodes.add(node)
            elif node.name.startswith("primals"):
                add_value(node, ValueKind.INPUT, -1, (0, 0), None)
            else:
                raise CaptureError(
                    f"the joint graph has an input {node.name!r} remat cannot schedule "
                    "(RNG seed/offset or backward-state inputs). Use torch.compile's default "
                    "partitioner for this model, or report the model.",
                    reason="unsupported_op",
                )
        elif node.op == "get_attr":
            add_value(node, ValueKind.INPUT, -1, (0, 0), None)
        elif node.op == "call_function" and is_symbolic_scalar(node.meta.get("val")) and all(
                value_of.get(a) is not None and values[value_of[a]].kind is ValueKind.INPUT
                for a in node.all_input_nodes):
            # Size arithmetic on the size inputs (NOTE [ Sizes come from the inputs ]): an input
            # like them, emitted at the top of forward (remat.codegen).
            add_value(node, ValueKind.INPUT, -1, (0, 0), None)
            size_nodes.append(node)
        elif node.op == "call_function":
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and not _is_tensor(
                node.args[0].meta.get("val")
            ):
                continue  # an output of a multi-output op: handled with its parent
            depends_on_backward = any(a in backward_nodes for a in node.all_input_nodes)
            tag = node.meta.get("partitioner_tag")
            if depends_on_backward or tag == "is_backward" or (
                    tag is None and position > last_forward):
                backward_nodes.add(node)
            op_candidates.append(node)

    forward = [n for n in op_candidates if n not in backward_nodes]
    backward = [n for n in op_candidates if n in backward_nodes]
    ops: list[Op] = []
    op_nodes: list[fx.Node] = []
    pending: list[tuple[int, fx.Node, list[fx.Node], Phase]] = []
    for index, node in enumerate(forward + backward):
        phase = Phase.FORWARD if index < len(forward) else Phase.BACKWARD
        val = node.meta.get("val")
        alias_arg, list_alias = _alias_sources(node)
        alias_input = None
        if alias_arg is not None:
            arg = node.args[alias_arg] if alias_arg < len(node.args) else None
            alias_input = arg if isinstance(arg, fx.Node) else None
        produced: list[fx.Node]
        if isinstance(val, (tuple, list)):
            produced = [u for u in node.users if u.target is operator.getitem]
            produced.sort(key=lambda u: u.args[1])
        else:
            produced = [node]
        kind = ValueKind.ACTIVATION if phase is Phase.FORWARD else ValueKind.GRADIENT
        for out in produced:
            out_val = out.meta.get("val")
            aliased = alias_input is not None and (list_alias or out is node)
            if aliased and alias_input in value_of:
                add_value(out, kind, len(ops), (0, 0), value_of[alias_input])
            else:
                nbytes = _storage_nbytes(out_val) if _is_tensor(out_val) else (0, 0)
                add_value(out, kind, len(ops), nbytes, None)
        transient = 0  # outputs nobody reads are allocated and freed inside the op
        if isinstance(val, (tuple, list)):
            used = {u.args[1] for u in produced}
            transient = sum(_storage_nbytes(t)[0] for k, t in enumerate(val)
                            if k not in used and _is_tensor(t))
        pending.append((len(ops), node, produced, phase, transient))
        ops.append(None)  # type: ignore[arg-type]  # filled below once inputs are known
        op_nodes.append(node)

    for index, node, produced, phase, transient in pending:
        inputs: list[int] = []
        for arg in node.all_input_nodes:
            v = value_of.get(arg)
            if v is None:
                raise CaptureError(
                    f"op {node.name!r} reads {arg.name!r}, which is not a tensor value remat "
                    "can track (symbolic or opaque values). Call rematerialize with static "
                    "shapes, or report the model.",
                    reason="unsupported_op",
                )
            if v not in inputs:
                inputs.append(v)
        ops[index] = Op(
            name=node.name,
            phase=phase,
            inputs=tuple(inputs),
            outputs=tuple(value_of[p] for p in produced),
            recomputable=_is_recomputable(node, mutated),
            module=_node_module(node),
            signature=_signature(node),
            workspace=transient,
        )

    joint_outputs = list(output_node.args[0])
    descs = _output_descs(joint)
    fwd_out = [o for o in joint_outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]
    user_out: list[int] = []
    for position, o in enumerate(joint_outputs[:num_fwd_outputs]):
        if not isinstance(o, fx.Node):
            continue
        desc = type(descs[position]).__name__ if position < len(descs) else ""
        if "InputMutation" not in desc:
            user_out.append(value_of[o])
    bwd_out = [o for o in joint_outputs[num_fwd_outputs:] if isinstance(o, fx.Node)]
    graph = RematGraph(
        ops=tuple(ops),
        values=tuple(values),
        num_forward=len(forward),
        forward_outputs=tuple(dict.fromkeys(value_of[o] for o in fwd_out)),
        backward_outputs=tuple(dict.fromkeys(value_of[o] for o in bwd_out)),
        user_outputs=tuple(dict.fromkeys(user_out)),
    )
    return Lowered(graph, tuple(op_nodes), tuple(value_nodes), num_fwd_outputs, tuple(exprs),
                   tuple(size_nodes))
