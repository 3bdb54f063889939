"""Plain-data graphs built by hand, for testing the simulator and the solvers without tracing."""
from __future__ import annotations

from remat.graph import Op, Phase, RematGraph, Value, ValueKind


def chain(times: list[float], act: int = 100, grad: int = 10, per_layer: int = 1,
          view_every: int = 0) -> RematGraph:
    """A chain ``x -> a1 -> ... -> an`` (like linear layers): op ``f_i`` reads ``a_{i-1}`` and
    a weight ``w_i``; its backward ``b_i`` reads ``a_{i-1}`` and the incoming gradient and
    produces the gradient of ``a_{i-1}`` (``act`` bytes) and of ``w_i`` (``grad`` bytes).

    Args:
        times: Forward time of each op (backward ops take twice as long).
        act: Bytes of every activation and activation gradient.
        grad: Bytes of every weight gradient.
        per_layer: Ops per module (module paths ``layers.<k>``), for the hierarchical solver.
        view_every: Every that-many ops, add a free view of the activation (tests aliases).
    """
    values: list[Value] = []
    ops: list[Op] = []

    def value(name: str, kind: ValueKind, producer: int, nbytes: int, alias: int | None = None) -> int:
        values.append(Value(name, kind, producer, nbytes, alias))
        return len(values) - 1

    x = value("x", ValueKind.INPUT, -1, 0)
    weights = [value(f"w{i}", ValueKind.INPUT, -1, 0) for i in range(len(times))]
    acts = [x]
    fwd_reads = []  # what each backward op reads from forward
    for i, t in enumerate(times):
        module = f"layers.{i // per_layer}"
        a = value(f"a{i + 1}", ValueKind.ACTIVATION, len(ops), act)
        ops.append(Op(f"f{i + 1}", Phase.FORWARD, (acts[-1], weights[i]), (a,), t, True, module,
                      f"linear{act}"))
        fwd_reads.append(acts[-1])
        acts.append(a)
        if view_every and (i + 1) % view_every == 0:
            v = value(f"v{i + 1}", ValueKind.ACTIVATION, len(ops), 0, alias=a)
            ops.append(Op(f"view{i + 1}", Phase.FORWARD, (a,), (v,), 0.0, True, module, "view"))
            acts[-1] = v
    g = value("tangent", ValueKind.TANGENT, -1, act)
    grads = []
    for i in reversed(range(len(times))):
        module = f"layers.{i // per_layer}"
        dx = value(f"da{i}", ValueKind.GRADIENT, len(ops), act)
        dw = value(f"dw{i + 1}", ValueKind.GRADIENT, len(ops), grad)
        ops.append(Op(f"b{i + 1}", Phase.BACKWARD, (g, fwd_reads[i], weights[i]), (dx, dw),
                      2 * times[i], True, module, f"linear_backward{act}"))
        grads.append(dw)
        g = dx
    num_forward = sum(1 for op in ops if op.phase is Phase.FORWARD)
    return RematGraph(ops=tuple(ops), values=tuple(values), num_forward=num_forward,
                      forward_outputs=(acts[-1],), backward_outputs=tuple(grads),
                      user_outputs=(acts[-1],))


def unet(levels: int = 3, act: int = 100, grad: int = 10, enc_time: float = 1.0,
         dec_time: float = 2.0, ops_per_level: int = 2) -> RematGraph:
    """A U-shaped graph: an encoder chain whose outputs are read again, through long skip
    connections, by the decoder level of the same depth (a U-Net), so storages cross many blocks.

    Encoder level k runs ``ops_per_level`` ops (module ``down.<k>``) producing ``e_k``; the
    bottleneck reads ``e_L``; decoder level k (module ``up.<k>``) reads the previous decoder
    output and ``e_k``. Every forward op's backward reads the forward op's inputs; the gradient
    of ``e_k`` is the sum of the gradients reaching it along both paths.

    Args:
        levels: Depth of the U.
        act: Bytes of every activation and activation gradient.
        grad: Bytes of every weight gradient.
        enc_time / dec_time: Forward time of each encoder / decoder op (backward: twice that).
        ops_per_level: Forward ops per level.
    """
    values: list[Value] = []
    ops: list[Op] = []

    def value(name: str, kind: ValueKind, producer: int, nbytes: int) -> int:
        values.append(Value(name, kind, producer, nbytes, None))
        return len(values) - 1

    fwd: list[tuple[int, tuple[int, ...], float, str]] = []  # (op, inputs read, time, module)
    x = value("x", ValueKind.INPUT, -1, 0)
    w = value("w", ValueKind.INPUT, -1, 0)

    def forward_op(name: str, inputs: tuple[int, ...], t: float, module: str) -> int:
        out = value(name, ValueKind.ACTIVATION, len(ops), act)
        ops.append(Op(f"f_{name}", Phase.FORWARD, (*inputs, w), (out,), t, True, module,
                      f"conv{len(inputs)}"))
        fwd.append((len(ops) - 1, inputs, t, module))
        return out

    h, skips = x, []
    for k in range(levels):
        for j in range(ops_per_level):
            h = forward_op(f"e{k}_{j}", (h,), enc_time, f"down.{k}")
        skips.append(h)
    h = forward_op("mid", (h,), enc_time, "mid")
    for k in reversed(range(levels)):
        h = forward_op(f"d{k}_0", (h, skips[k]), dec_time, f"up.{k}")
        for j in range(1, ops_per_level):
            h = forward_op(f"d{k}_{j}", (h,), dec_time, f"up.{k}")
    num_forward = len(ops)

    # Backward in reverse: each op reads its forward inputs and the gradient of its output;
    # gradients reaching a value along two paths are summed by an add before they are used.
    pending: dict[int, list[int]] = {h: [value("tangent", ValueKind.TANGENT, -1, act)]}
    weight_grads = []
    for index, inputs, t, module in reversed(fwd):
        out = ops[index].outputs[0]
        parts = pending.pop(out)
        g = parts[0]
        if len(parts) > 1:
            g = value(f"g_{values[out].name}", ValueKind.GRADIENT, len(ops), act)
            ops.append(Op(f"add_{values[out].name}", Phase.BACKWARD, tuple(parts), (g,),
                          0.1 * t, True, module, "add"))
        outs = [value(f"d_{values[u].name}_{values[out].name}", ValueKind.GRADIENT, len(ops), act)
                for u in inputs if u != x]
        dw = value(f"dw_{values[out].name}", ValueKind.GRADIENT, len(ops), grad)
        ops.append(Op(f"b_{values[out].name}", Phase.BACKWARD, (g, *inputs, w), (*outs, dw),
                      2 * t, True, module, f"conv_backward{len(inputs)}"))
        weight_grads.append(dw)
        for u, du in zip([u for u in inputs if u != x], outs):
            pending.setdefault(u, []).append(du)
    return RematGraph(ops=tuple(ops), values=tuple(values), num_forward=num_forward,
                      forward_outputs=(h,), backward_outputs=tuple(weight_grads),
                      user_outputs=(h,))
