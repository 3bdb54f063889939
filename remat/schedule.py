"""Schedules (which ops run when, what is kept) and the simulator that checks and prices them.

NOTE [ Schedule semantics ]
A :class:`Schedule` is three things:

* ``forward``: forward ops in the order the forward graph runs them (each at most once);
* ``saved``: forward values handed from forward to backward;
* ``backward``: op indices in the order the backward graph runs them. Every backward op
  appears exactly once; a *forward* op index appearing here is a recomputation, and may appear
  several times (a value may be recomputed more than once).

An op reads the most recent instance of each input: in forward, what forward produced; in
backward, the saved instance or the latest recomputation. Every instance is freed right after its
last read (this is what FX code generation does: node order is memory order), except model
outputs and gradients, which the caller keeps. The simulator replays exactly these rules, so its
peak is what the generated graphs allocate, up to scratch memory inside kernels (the ops'
measured ``workspace``) and allocator rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ScheduleError
from .graph import Phase, RematGraph, ValueKind

__all__ = [
    "Schedule",
    "Simulation",
    "simulate",
    "save_all_schedule",
    "on_demand_schedule",
    "forward_ops_needed",
    "tidy",
    "remake_views",
]


@dataclass(frozen=True)
class Schedule:
    """An executable plan for one training step. See NOTE [ Schedule semantics ]."""

    forward: tuple[int, ...]
    saved: frozenset[int]
    backward: tuple[int, ...]

    def recompute_count(self, graph: RematGraph) -> int:
        """Number of recomputed op executions in backward."""
        return sum(1 for i in self.backward if i < graph.num_forward)


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs, as predicted by :func:`simulate`.

    Attributes:
        peak_bytes: Peak of live activation bytes over the step (graph inputs excluded).
        forward_peak_bytes: Peak during forward.
        backward_peak_bytes: Peak during backward (tangents, saved values, recomputations,
            gradients).
        saved_bytes: Bytes of the saved values' storages (counted once; model outputs, which
            the caller holds anyway, excluded).
        time: Predicted step time in seconds (forward + backward incl. recomputation).
        recompute_time: Seconds spent recomputing forward ops in backward.
        peak_at: ``("fwd", k)`` / ``("bwd", k)``: position of the peak in its op list.
    """

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved_bytes: int
    time: float
    recompute_time: float
    peak_at: tuple[str, int]


def simulate(graph: RematGraph, schedule: Schedule) -> Simulation:
    """Check a schedule's dependencies and predict its peak memory and time.

    Args:
        graph: The joint graph.
        schedule: The plan to check.

    Returns:
        A :class:`Simulation`.

    Raises:
        ScheduleError: when an op would read a value that has no live instance, a backward op
            is missing or repeated, a non-recomputable op is recomputed, or an output is never
            produced.
    """
    values, ops, nf = graph.values, graph.ops, graph.num_forward
    _check_op_lists(graph, schedule)

    # Pass 1: bind reads to instances along the timeline. Position p: forward ops are
    # 0..F-1, the forward/backward boundary is F, backward ops are F+1..F+B.
    num_f = len(schedule.forward)
    boundary = num_f
    end = num_f + 1 + len(schedule.backward)
    inst_value: list[int] = []  # instance -> value
    inst_birth: list[int] = []
    inst_death: list[int] = []
    inst_storage: list[int] = []  # instance -> owning instance (storage), -1 for inputs

    def new_instance(v: int, pos: int, env: dict[int, int]) -> int:
        value = values[v]
        inst = len(inst_value)
        inst_value.append(v)
        inst_birth.append(pos)
        inst_death.append(pos)
        if value.alias_of is None:
            inst_storage.append(inst)
        else:
            base = env.get(value.alias_of)
            inst_storage.append(-1 if base is None or base < 0 else inst_storage[base])
        env[v] = inst
        return inst

    env: dict[int, int] = {v: -1 for v in graph.always_available}  # -1: pre-existing input
    positions: list[tuple[int, int, str]] = []  # (op, pos, phase) for the memory sweep

    def run(op_index: int, pos: int, phase: str) -> None:
        op = ops[op_index]
        for v in op.inputs:
            inst = env.get(v)
            if inst is None:
                where = "forward" if phase == "fwd" else "backward"
                what = "recomputation of " if phase == "bwd" and op_index < nf else ""
                raise ScheduleError(
                    f"{what}op {op.name!r} at {where} position {pos if phase == 'fwd' else pos - boundary - 1} "
                    f"reads {values[v].name!r}, which is not available there (not computed yet, "
                    "not saved, and not recomputed)"
                )
            if inst >= 0:
                inst_death[inst] = max(inst_death[inst], pos)
        for v in op.outputs:
            new_instance(v, pos, env)
        positions.append((op_index, pos, phase))

    for pos, i in enumerate(schedule.forward):
        run(i, pos, "fwd")

    missing = [values[v].name for v in graph.forward_outputs if v not in env]
    if missing:
        raise ScheduleError(f"forward never produces the outputs {missing[:5]}")
    missing = [values[v].name for v in schedule.saved if v not in env]
    if missing:
        raise ScheduleError(f"saved values {missing[:5]} are not produced by the forward")
    user_outputs = set(graph.user_outputs)
    # At the boundary: model outputs are kept by the caller until the end; saved values live
    # at least to the boundary; everything else produced in forward is gone.
    bwd_env: dict[int, int] = {v: -1 for v in graph.always_available}
    for v in graph.forward_outputs:
        inst = env[v]
        if inst >= 0:
            inst_death[inst] = max(inst_death[inst], end if v in user_outputs else boundary)
    for v in schedule.saved:
        inst = env[v]
        bwd_env[v] = inst
        if inst >= 0:
            inst_death[inst] = max(inst_death[inst], boundary)
    for v in user_outputs:  # the caller's output tensors stay readable (no copy)
        bwd_env.setdefault(v, env[v])
    for v, value in enumerate(values):
        if value.kind is ValueKind.TANGENT:
            new_instance(v, boundary, bwd_env)
    env = bwd_env
    for k, i in enumerate(schedule.backward):
        run(i, boundary + 1 + k, "bwd")
    for v in graph.backward_outputs:
        inst = env.get(v)
        if inst is None:
            raise ScheduleError(f"backward never produces the gradient {values[v].name!r}")
        if inst >= 0:
            inst_death[inst] = end

    # Pass 2: storage lifetimes and the memory sweep.
    storage_death: dict[int, int] = {}
    for inst, owner in enumerate(inst_storage):
        if owner >= 0:
            storage_death[owner] = max(storage_death.get(owner, -1), inst_death[inst])
    delta = [0] * (end + 2)
    for owner, death in storage_death.items():
        nbytes = values[inst_value[owner]].nbytes
        if nbytes == 0:
            continue
        delta[inst_birth[owner]] += nbytes
        delta[death + 1] -= nbytes
    root = graph.storage_root
    pinned = {root[v] for v in user_outputs}
    saved_bytes = sum(values[r].nbytes for r in {root[v] for v in schedule.saved} - pinned)
    live = [0] * (end + 1)
    running = 0
    for pos in range(end + 1):
        running += delta[pos]
        live[pos] = running

    fwd_peak = bwd_peak = 0
    peak_at = ("fwd", 0)
    time = recompute = 0.0
    for op_index, pos, phase in positions:
        op = ops[op_index]
        here = live[pos] + op.workspace
        time += op.time
        if phase == "fwd":
            if here > fwd_peak:
                fwd_peak = here
                if here > bwd_peak:
                    peak_at = ("fwd", pos)
        else:
            if op_index < nf:
                recompute += op.time
            if here > bwd_peak:
                bwd_peak = here
                if here >= fwd_peak:
                    peak_at = ("bwd", pos - boundary - 1)
    bwd_peak = max(bwd_peak, live[boundary])
    return Simulation(
        peak_bytes=max(fwd_peak, bwd_peak),
        forward_peak_bytes=fwd_peak,
        backward_peak_bytes=bwd_peak,
        saved_bytes=saved_bytes,
        time=time,
        recompute_time=recompute,
        peak_at=peak_at,
    )


def _check_op_lists(graph: RematGraph, schedule: Schedule) -> None:
    nf = graph.num_forward
    seen: set[int] = set()
    for i in schedule.forward:
        if not 0 <= i < nf:
            raise ScheduleError(f"forward list holds op {i}, which is not a forward op")
        if i in seen:
            raise ScheduleError(f"forward runs op {graph.ops[i].name!r} twice")
        seen.add(i)
    backward_seen: set[int] = set()
    for i in schedule.backward:
        if not 0 <= i < len(graph.ops):
            raise ScheduleError(f"backward list holds op {i}, which does not exist")
        op = graph.ops[i]
        if op.phase is Phase.BACKWARD:
            if i in backward_seen:
                raise ScheduleError(f"backward runs op {op.name!r} twice")
            backward_seen.add(i)
        elif not op.recomputable:
            raise ScheduleError(
                f"op {op.name!r} is random or impure and may not be recomputed; save its outputs"
            )
    missing = len(graph.ops) - nf - len(backward_seen)
    if missing:
        names = [graph.ops[i].name for i in graph.backward_ops if i not in backward_seen]
        raise ScheduleError(f"backward is missing {missing} ops, e.g. {names[:5]}")


def forward_ops_needed(graph: RematGraph, saved: frozenset[int] | set[int]) -> tuple[int, ...]:
    """Forward ops needed to produce the forward outputs and the saved values, in order."""
    need_values = set(graph.forward_outputs) | set(saved)
    needed: set[int] = set()
    for i in reversed(graph.forward_ops):
        op = graph.ops[i]
        if any(v in need_values for v in op.outputs):
            needed.add(i)
            need_values.update(op.inputs)
    return tuple(i for i in graph.forward_ops if i in needed)


def save_all_schedule(graph: RematGraph) -> Schedule:
    """The unmodified step: forward once, save every forward value backward reads."""
    saved = frozenset(
        v
        for i in graph.backward_ops
        for v in graph.ops[i].inputs
        if graph.values[v].kind is ValueKind.ACTIVATION
    )
    return Schedule(
        forward=forward_ops_needed(graph, saved),
        saved=saved,
        backward=tuple(graph.backward_ops),
    )


def on_demand_schedule(
    graph: RematGraph,
    saved: frozenset[int] | set[int],
    groups: list[list[int]] | None = None,
    *,
    keep_recomputed: bool = True,
) -> Schedule:
    """Backward in its usual order, recomputing missing forward values right before first use.

    Args:
        graph: The joint graph.
        saved: Forward values to keep from forward (non-recomputable ops' outputs that
            backward needs are added automatically).
        groups: Optional partition of forward ops into recompute groups (e.g. one per
            checkpointed block): when backward first needs a missing value of a group, the
            whole group's recomputable forward is rerun, like ``torch.utils.checkpoint``.

    Returns:
        A valid :class:`Schedule` (recomputed instances live until their last use).
    """
    nf = graph.num_forward
    producer = [v.producer for v in graph.values]
    saved = set(saved) | _forced_saves(graph, saved, groups)
    group_of: dict[int, int] = {}
    for g, members in enumerate(groups or []):
        for i in members:
            group_of[i] = g
    available = set(saved) | set(graph.always_available) | set(graph.user_outputs)
    order: list[int] = []

    def ensure(wanted: list[int]) -> None:
        # Collect the missing producers (whole groups where given), then run them in forward
        # order, which is topological. Iterative: chains can be thousands of ops deep.
        need_ops: set[int] = set()
        stack = [v for v in wanted if v not in available]
        while stack:
            v = stack.pop()
            p = producer[v]
            if v in available or p in need_ops:
                continue
            if p < 0 or not graph.ops[p].recomputable:
                raise ScheduleError(
                    f"backward needs {graph.values[v].name!r}, which is neither saved nor "
                    "recomputable"
                )
            members = [p]
            if p in group_of:
                members = [
                    i for i in groups[group_of[p]]
                    if graph.ops[i].recomputable
                    and not all(o in available for o in graph.ops[i].outputs)
                ]
            for i in members:
                if i not in need_ops:
                    need_ops.add(i)
                    stack.extend(u for u in graph.ops[i].inputs if u not in available)
        for i in sorted(need_ops):
            order.append(i)
            available.update(graph.ops[i].outputs)

    base = set(available)
    for b in graph.backward_ops:
        op = graph.ops[b]
        ensure([v for v in op.inputs if 0 <= producer[v] < nf])
        order.append(b)
        if not keep_recomputed:
            available = set(base)
        available.update(op.outputs)
        base.update(op.outputs)
    saved_frozen = frozenset(saved)
    return Schedule(
        forward=forward_ops_needed(graph, saved_frozen), saved=saved_frozen, backward=tuple(order)
    )


def _forced_saves(
    graph: RematGraph, saved: frozenset[int] | set[int], groups: list[list[int]] | None
) -> set[int]:
    """Outputs of non-recomputable forward ops that a recomputation may read.

    Without groups these are the ones backward transitively needs; with groups, also any
    read by a recomputable op of a group (the whole group reruns).
    """
    nf = graph.num_forward
    forced: set[int] = set()
    needed: set[int] = set()
    for b in graph.backward_ops:
        needed.update(v for v in graph.ops[b].inputs if 0 <= graph.values[v].producer < nf)
    for members in groups or []:
        for i in members:
            if graph.ops[i].recomputable:
                needed.update(graph.ops[i].inputs)
    stack = list(needed)
    visited: set[int] = set()
    while stack:
        v = stack.pop()
        if v in visited or v in saved:
            continue
        visited.add(v)
        p = graph.values[v].producer
        if p < 0:
            continue
        if not graph.ops[p].recomputable:
            forced.add(v)
            continue
        stack.extend(graph.ops[p].inputs)
    return forced


def tidy(graph: RematGraph, schedule: Schedule) -> Schedule:
    """Drop recomputations nobody reads and saved values backward never reads first.

    A solver may leave zero-cost or redundant recomputations in its answer; removing them never
    raises memory or time, and keeps the generated graphs minimal.
    """
    nf = graph.num_forward
    read_later: dict[int, bool] = {}
    keep = [True] * len(schedule.backward)
    for pos in range(len(schedule.backward) - 1, -1, -1):
        i = schedule.backward[pos]
        op = graph.ops[i]
        if i < nf and not any(read_later.get(v, False) for v in op.outputs):
            keep[pos] = False
            continue
        for v in op.outputs:
            read_later[v] = False
        for v in op.inputs:
            read_later[v] = True
    backward = tuple(i for i, k in zip(schedule.backward, keep) if k)
    saved = frozenset(v for v in schedule.saved if read_later.get(v, False))
    return Schedule(forward_ops_needed(graph, saved), saved, backward)


def _is_view_op(graph: RematGraph, i: int) -> bool:
    op = graph.ops[i]
    return op.recomputable and bool(op.outputs) and all(
        graph.values[v].alias_of is not None and graph.values[v].nbytes == 0 for v in op.outputs
    )


def remake_views(graph: RematGraph, schedule: Schedule) -> Schedule:
    """Insert the view ops backward needs right before their readers.

    Solvers reason about storages, not views (a ``transpose`` of a saved tensor costs nothing
    to remake). This pass walks the backward list and, wherever an op reads a view that has no
    live instance, remakes it (and the views it is made from) from the newest instance of its
    base. A view made from an instance that gets recomputed later is dropped, so it never keeps
    a stale storage alive.

    Raises:
        ScheduleError: if a read value is neither available nor a view of something available.
    """
    nf = graph.num_forward
    values, ops = graph.values, graph.ops
    # derived[u]: the views made (directly or not) from u; made stale when u is remade.
    chain: dict[int, set[int]] = {}
    derived: dict[int, set[int]] = {}
    for v, value in enumerate(values):
        if value.alias_of is not None:
            chain[v] = {value.alias_of} | chain.get(value.alias_of, set())
            for u in chain[v]:
                derived.setdefault(u, set()).add(v)
    available = set(schedule.saved) | set(graph.always_available) | set(graph.user_outputs)
    available |= {v for v, value in enumerate(values) if value.kind is ValueKind.TANGENT}
    order: list[int] = []
    sizes: set[int] = set()  # forward-made sizes (SymInts) a remade view needs: kept, free

    def materialize(v: int) -> None:
        if v in available:
            return
        p = values[v].producer
        if values[v].scalar and 0 <= p < nf:
            sizes.add(v)
            available.add(v)
            return
        if not 0 <= p < nf or not _is_view_op(graph, p):
            raise ScheduleError(
                f"backward reads {values[v].name!r}, which is neither available nor a view of "
                "an available value"
            )
        for u in ops[p].inputs:
            materialize(u)
        order.append(p)
        available.update(ops[p].outputs)

    for i in schedule.backward:
        op = ops[i]
        for u in op.inputs:
            materialize(u)
        order.append(i)
        if i < nf:
            # Forward-made views of a recomputed value go stale; a view backward made earlier
            # keeps the instance it was made from (the simulator and codegen bind it there).
            for v in op.outputs:
                available -= {d for d in derived.get(v, ()) if values[d].producer < nf}
        available.update(op.outputs)
    if sizes:
        saved = frozenset(schedule.saved | sizes)
        return Schedule(forward_ops_needed(graph, saved), saved, tuple(order))
    return Schedule(schedule.forward, schedule.saved, tuple(order))
