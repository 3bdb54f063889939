"""Hugging Face's eager expert loops, captured as one op that runs them as eager does.

NOTE [ An expert loop as one op ]
A mixture-of-experts layer of ``transformers`` (Mixtral, Qwen-MoE, OLMoE, ... : every experts
class decorated by ``use_experts_implementation``) run with ``experts_implementation="eager"``
loops over the experts its tokens were routed to (``for expert_idx in expert_hit``, a tensor of
data-dependent length) and gathers each expert's tokens (``torch.where``): sizes dynamo cannot
trace, so the capture failed (``CaptureError``, issue 34). ``transformers``' own ``grouped_mm``
and ``batched_mm`` implementations capture, but they add in another order: a 2-layer Mixtral's
gradients were 5e-10 (``grouped_mm``) and 5e-9 (``batched_mm``) from the eager loop's.

So while a compiled step runs, such a layer's config names :data:`ONE_OP` instead of ``"eager"``
(NOTE [ The algorithm eager runs ] in :mod:`remat.frames`: at every call, restored after it),
and that implementation calls :func:`expert_loop`, a custom op whose shapes do not depend on the
routing (its output is shaped like its input) and whose kernel runs the layer's own eager loop
on the real tensors, with nothing recorded. Its backward, :func:`expert_loop_backward`, runs
that loop again with autograd on and returns the gradients of the layer's input, its routing
weights and its parameters: the same autograd graph eager builds, differentiated in the same
order, each read's gradient added where eager adds it
(NOTE [ Each read's gradient in eager's order ]), so the gradients are eager's, bitwise
(Mixtral, Qwen2-MoE with its shared expert: ``tests/remat/test_transformers.py``). The loop's
activations are never kept between forward and backward (only the op's inputs are:
``hidden_states``, the routing and the parameters); they are the backward op's scratch memory,
which profiling measures (NOTE [ Measuring op times ] in :mod:`remat.costs`), and the price is
one more forward of the experts in backward, as per-block checkpointing would pay (a 4-layer
Mixtral at "50%": 0.467 of eager's step peak at 1.25-1.42x its time, tiny layers). One layer's
loop with its gradients is that op's scratch and so the floor of the step's peak: a 2-layer
Mixtral reaches 51%, not 50%. The planner sees one op per layer and plans the rest of the step
around it.

A layer is named in the graph by a handle (an ``int`` kept on the module, handed out in the
order layers are first seen in a process, so a script's graphs, and the plans cached for them,
are the same from run to run); the op finds the layer by it and runs it with the op's own
parameter tensors.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ONE_OP", "expert_grads_in_order", "expert_loop", "expert_loop_backward",
           "one_op_note", "one_op_switches"]

ONE_OP = "hiremate_one_op"  # the experts implementation name a switched config reads

_LAYERS: dict[int, weakref.ReferenceType] = {}  # handle -> experts module
# The module attribute holding its handle: a lookup in a registry of ours, traced by dynamo,
# failed as it built its guards once a second model's layers were in it (IndexError).
_HANDLE = "_hiremate_experts_handle"
_NEXT = itertools.count()


def _is_eager_loop(module: nn.Module) -> bool:
    """A ``transformers`` experts module set to run its eager loop."""
    forward = getattr(type(module), "forward", None)
    config = getattr(module, "config", None)
    # ``use_experts_implementation``'s dispatching forward (other decorators wrap forwards too)
    return ("experts_interface" in getattr(getattr(forward, "__code__", None), "co_freevars", ())
            and hasattr(forward, "__wrapped__")
            and getattr(config, "_experts_implementation_internal", None) == "eager")


def one_op_switches(module: nn.Module) -> list[tuple[Any, str, str]]:
    """``(config, attribute, value)`` for every experts config in ``module`` that runs the eager
    loop: :data:`ONE_OP` while a compiled step runs (NOTE [ An expert loop as one op ])."""
    configs: dict[int, Any] = {}
    for m in module.modules():
        if _is_eager_loop(m):
            known = _LAYERS.get(getattr(m, _HANDLE, -1))
            if known is None or known() is not m:  # new, or a deep copy of a known layer
                handle = next(_NEXT)
                setattr(m, _HANDLE, handle)  # read by dynamo as a constant of the module
                _LAYERS[handle] = weakref.ref(m)
            configs[id(m.config)] = m.config
    if not configs:
        return []
    _register()
    return [(config, "_experts_implementation_internal", ONE_OP) for config in configs.values()]


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ONE_OP not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(ONE_OP, _as_one_op)


def _params(module: nn.Module) -> list[tuple[str, Tensor]]:
    return list(module.named_parameters(recurse=False))


def _as_one_op(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
               top_k_weights: Tensor) -> Tensor:
    """The experts implementation :data:`ONE_OP` names: the module's eager loop as one op."""
    params = [p for _, p in _params(module)]
    return expert_loop(getattr(module, _HANDLE), hidden_states, top_k_index, top_k_weights,
                       params)


def _run_eager(handle: int, params: list[Tensor], hidden_states: Tensor, top_k_index: Tensor,
               top_k_weights: Tensor) -> Tensor:
    """The layer's own eager loop with ``params`` in place of its parameters."""
    ref = _LAYERS.get(handle)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(f"remat: the experts layer of handle {handle} no longer exists: a "
                           "compiled step outlived the model it was captured from; call "
                           "rematerialize on the model you train")
    names = [name for name, _ in _params(module)]
    eager_loop = type(module).forward.__wrapped__
    # functional_call would call the module, whose forward reads the switched config and comes
    # back here; the eager loop is called directly, with the op's tensors as its parameters
    with torch.nn.utils.stateless._reparametrize_module(module, dict(zip(names, params))):
        return eager_loop(module, hidden_states, top_k_index, top_k_weights)


@torch.library.custom_op("hiremate::expert_loop", mutates_args=())
def expert_loop(handle: int, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                params: list[Tensor]) -> Tensor:
    """The experts layer ``handle`` run as its eager loop (NOTE [ An expert loop as one op ])."""
    out = _run_eager(handle, params, hidden_states, top_k_index, top_k_weights)
    if out.shape != hidden_states.shape or out.dtype != hidden_states.dtype:
        raise RuntimeError(f"remat: an experts layer returned {tuple(out.shape)} {out.dtype} for "
                           f"its input {tuple(hidden_states.shape)} {hidden_states.dtype}; only "
                           "layers whose output is shaped like their input run as one op; "
                           "call model.set_experts_implementation('grouped_mm') before "
                           "rematerialize to capture this one as transformers writes it")
    return out


@expert_loop.register_fake
def _(handle, hidden_states, top_k_index, top_k_weights, params):
    return hidden_states.new_empty(hidden_states.shape)


def _autograd_inside_op():
    """Autograd back on inside a custom op's kernel.

    A custom op's kernel runs below autograd (PyTorch excludes the autograd dispatch keys while
    it runs), so ops called in it record nothing and ``torch.autograd.grad`` finds no graph. The
    backward op differentiates the eager loop with eager's own engine, so for its duration the
    exclusion is lifted. ``torch.func.vjp`` works there without this, but it ran the same
    gradients at 0.533 of eager's step peak where the engine does at 0.482 (its wrappers keep
    more alive; a 4-layer Mixtral at "99%").
    """
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther,
                C.DispatchKey.AutogradNestedTensor, C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("hiremate::expert_loop_backward", mutates_args=())
def expert_loop_backward(handle: int, grad: Tensor, hidden_states: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor, params: list[Tensor],
                         grad_h_before: Tensor | None = None,
                         grad_w_before: Tensor | None = None) -> list[Tensor]:
    """Gradients of :func:`expert_loop` for ``hidden_states``, ``top_k_weights`` and every
    parameter: the eager loop again, differentiated as eager's autograd does. The first two
    are added onto ``grad_*_before`` (what other readers gave before) read by read, in eager's
    order (NOTE [ Each read's gradient in eager's order ])."""
    with _autograd_inside_op(), torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (hidden_states, top_k_weights, *params)]
        sums = {id(leaves[0]): _OrderedSum(grad_h_before),
                id(leaves[1]): _OrderedSum(grad_w_before)}
        reads = _ReadsOneByOne(sums)
        with reads:
            out = _run_eager(handle, leaves[2:], leaves[0], top_k_index, leaves[1])
        grads = torch.autograd.grad(out, [*leaves, *reads.aliases], grad, allow_unused=True)
    summed = [sums[id(leaf)].plus(g) for leaf, g in zip(leaves[:2], grads[:2])]
    return [torch.zeros_like(t) if g is None else g
            for t, g in zip(leaves, [*summed, *grads[2:len(leaves)]])]


# NOTE [ Each read's gradient in eager's order ]
# Eager's autograd adds the gradients that reach one tensor in the order their nodes run: the
# layer's input gets one from every expert's ``hidden_states[token_idx]`` (the last expert's
# first), and one from each other reader, before or after them. The op returns one gradient,
# so its experts' sum was added to the others at once: where a reader's gradient comes first,
# as Qwen2-MoE's shared-expert gate (it reads the input after the experts), that is
# ``gate + (e3 + e2 + e1 + e0)`` for eager's ``((gate + e3) + e2) + ...``: 7e-9 off. So inside
# the op each read of the input (and of the routing weights) is made from an alias of its own,
# whose gradient a hook adds to a running sum as the engine computes it, starting from what
# came before (``grad_*_before``: :func:`expert_grads_in_order` hands the op the partial sum
# the graph would have added its result to), and the hook returns a zero-strided tensor so no
# read's gradient is kept beyond its addition.


class _OrderedSum:
    """A sum of gradients in the order they are added (eager's ``InputBuffer``)."""

    def __init__(self, start: Tensor | None) -> None:
        self.total = start

    def add(self, grad: Tensor) -> Tensor:
        self.total = grad if self.total is None else self.total + grad
        return grad.new_zeros(()).expand(grad.shape)  # nothing kept beyond the sum

    def plus(self, rest: Tensor | None) -> Tensor | None:
        """The sum, with ``rest`` (reads that were not made one by one) added last."""
        if rest is not None:
            self.add(rest)
        return self.total


class _ReadsOneByOne(torch.overrides.TorchFunctionMode):
    """``t[index]`` of a watched tensor read from an alias of its own, whose gradient goes to
    the tensor's :class:`_OrderedSum` (NOTE [ Each read's gradient in eager's order ])."""

    def __init__(self, sums: dict[int, _OrderedSum]) -> None:
        super().__init__()
        self.sums = sums
        self.aliases: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and id(args[0]) in self.sums:
            alias = args[0].detach().requires_grad_()
            alias.register_hook(self.sums[id(args[0])].add)
            self.aliases.append(alias)
            args = (alias, *args[1:])
        return func(*args, **kwargs)


@expert_loop_backward.register_fake
def _(handle, grad, hidden_states, top_k_index, top_k_weights, params, grad_h_before=None,
      grad_w_before=None):
    return [hidden_states.new_empty(hidden_states.shape),
            top_k_weights.new_empty(top_k_weights.shape),
            *(p.new_empty(p.shape) for p in params)]


def expert_grads_in_order(joint) -> int:
    """Hand every :func:`expert_loop_backward` the gradient its first two results were added to
    (NOTE [ Each read's gradient in eager's order ]); returns how many it was handed."""
    import operator

    aten = torch.ops.aten
    graph = joint.graph
    position = {node: k for k, node in enumerate(graph.nodes)}
    handed = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.hiremate.expert_loop_backward.default:
            continue
        for index, name in ((0, "grad_h_before"), (1, "grad_w_before")):
            result = next((u for u in node.users if u.target is operator.getitem
                           and u.args[1] == index), None)
            if result is None or len(result.users) != 1:
                continue
            add = next(iter(result.users))
            if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
                continue
            before = add.args[0] if add.args[1] is result else add.args[1]
            val, sum_val = before.meta.get("val"), add.meta.get("val")
            if not isinstance(val, Tensor) or val.shape != sum_val.shape or \
                    val.dtype != sum_val.dtype or position[before] > position[node]:
                continue
            node.update_kwarg(name, before)
            add.replace_all_uses_with(result)
            graph.erase_node(add)
            handed += 1
    if handed:
        graph.lint()
        joint.recompile()
    return handed


def _save(ctx, inputs: tuple, output: Tensor) -> None:
    handle, hidden_states, top_k_index, top_k_weights, params = inputs
    ctx.handle = handle
    ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, *params)


def _backward(ctx, grad: Tensor):
    hidden_states, top_k_index, top_k_weights, *params = ctx.saved_tensors
    grad_h, grad_w, *grad_params = expert_loop_backward(ctx.handle, grad, hidden_states,
                                                        top_k_index, top_k_weights, params)
    return None, grad_h, None, grad_w, grad_params


expert_loop.register_autograd(_backward, setup_context=_save)


def one_op_note(signatures: list[str]) -> str:
    """The plan's note saying which layers ran as one op, from its ops' signatures ("" if
    none): what the user learns in ``plan.summary()`` about code the capture did not trace."""
    layers = sum(sig.startswith("hiremate.expert_loop.default(") for sig in signatures)
    if not layers:
        return ""
    return (f"{layers} experts layer{'s' if layers > 1 else ''} ran as one op each: the "
            "layer's eager loop, run again in its backward (NOTE [ An expert loop as one op ])")
