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
