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

import itertools
from dataclasses import dataclass

from .errors import ScheduleError
from .graph import RematGraph, ValueKind

__all__ = [
    "Schedule",
    "Simulation",
    "simulate",
    "save_all_schedule",
    "on_demand_schedule",
    "forward_ops_needed",
    "tidy",
    "remake_views",
    "save_storages",
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

    def fingerprint(self) -> str:
        """A short hash of what runs when: two runs of one model with equal fingerprints run
        the same schedule (op indices are the lowered graph's, the same in every capture)."""
        import hashlib

        text = f"{self.forward}|{sorted(self.saved)}|{self.backward}"
        return hashlib.sha256(text.encode()).hexdigest()[:10]


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
    values, nf = graph.values, graph.num_forward
    _check_op_lists(graph, schedule)
    flat = graph.flat
    op_inputs, op_outputs, alias_of = flat.inputs, flat.outputs, flat.alias_of

    # Pass 1: bind reads to instances along the timeline. Position p: forward ops are
    # 0..F-1, the forward/backward boundary is F, backward ops are F+1..F+B. Reads come in
    # timeline order, so an instance's death only moves forward (one comparison per read).
    # A hot loop (thousands of runs per solve): flat tuples, no helper calls per op.
    forward, backward = schedule.forward, schedule.backward
    num_f = len(forward)
    boundary = num_f
    end = num_f + 1 + len(backward)
    inst_value: list[int] = []  # instance -> value
    inst_birth: list[int] = []
    inst_death: list[int] = []
    inst_storage: list[int] = []  # instance -> owning instance (storage), -1 for inputs

    def missing_input(op_index: int, v: int, pos: int, phase: str) -> ScheduleError:
        op = graph.ops[op_index]
        where = "forward" if phase == "fwd" else "backward"
        what = "recomputation of " if phase == "bwd" and op_index < nf else ""
        return ScheduleError(
            f"{what}op {op.name!r} at {where} position {pos if phase == 'fwd' else pos - boundary - 1} "
            f"reads {values[v].name!r}, which is not available there (not computed yet, "
            "not saved, and not recomputed)"
        )

    def run(op_list: tuple[int, ...], first: int, env: list[int], phase: str) -> None:
        pos = first
        for i in op_list:
            for v in op_inputs[i]:
                inst = env[v]
                if inst >= 0:
                    if inst_death[inst] < pos:
                        inst_death[inst] = pos
                elif inst == _ABSENT:
                    raise missing_input(i, v, pos, phase)
            for v in op_outputs[i]:
                inst = len(inst_value)
                inst_value.append(v)
                inst_birth.append(pos)
                inst_death.append(pos)
                base = alias_of[v]
                if base < 0:
                    inst_storage.append(inst)
                else:
                    base_inst = env[base]
                    inst_storage.append(inst_storage[base_inst] if base_inst >= 0 else -1)
                env[v] = inst
            pos += 1

    env = [_ABSENT] * len(values)  # _ABSENT: no instance; -1: pre-existing input
    for v in graph.always_available:
        env[v] = -1
    run(forward, 0, env, "fwd")

    missing = [values[v].name for v in graph.forward_outputs if env[v] == _ABSENT]
    if missing:
        raise ScheduleError(f"forward never produces the outputs {missing[:5]}")
    missing = [values[v].name for v in schedule.saved if env[v] == _ABSENT]
    if missing:
        raise ScheduleError(f"saved values {missing[:5]} are not produced by the forward")
    user_outputs = set(graph.user_outputs)
    # At the boundary: model outputs are kept by the caller until the end; saved values live
    # at least to the boundary; everything else produced in forward is gone.
    bwd_env = [_ABSENT] * len(values)
    for v in graph.always_available:
        bwd_env[v] = -1
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
        if bwd_env[v] == _ABSENT:
            bwd_env[v] = env[v]
    for v in flat.tangents:
        inst = len(inst_value)
        inst_value.append(v)
        inst_birth.append(boundary)
        inst_death.append(boundary)
        base = alias_of[v]
        inst_storage.append(inst if base < 0 else
                            (inst_storage[bwd_env[base]] if bwd_env[base] >= 0 else -1))
        bwd_env[v] = inst
    env = bwd_env
    run(backward, boundary + 1, env, "bwd")
    for v in graph.backward_outputs:
        inst = env[v]
        if inst == _ABSENT:
            raise ScheduleError(f"backward never produces the gradient {values[v].name!r}")
        if inst >= 0:
            inst_death[inst] = end

    # Pass 2: storage lifetimes and the memory sweep.
    storage_death = [-1] * len(inst_value)
    for inst, owner in enumerate(inst_storage):
        if owner >= 0 and inst_death[inst] > storage_death[owner]:
            storage_death[owner] = inst_death[inst]
    nbytes_of = flat.nbytes
    delta = [0] * (end + 2)
    for owner, death in enumerate(storage_death):
        if death >= 0:
            nbytes = nbytes_of[inst_value[owner]]
            if nbytes:
                delta[inst_birth[owner]] += nbytes
                delta[death + 1] -= nbytes
    root = graph.storage_root
    pinned = {root[v] for v in user_outputs}
    saved_bytes = sum(values[r].nbytes for r in {root[v] for v in schedule.saved} - pinned)
    live = list(itertools.accumulate(delta[:end + 1]))

    times, costs, workspaces = flat.times, flat.recompute_costs, flat.workspaces
    fwd_peak = bwd_peak = 0
    peak_at = ("fwd", 0)
    time = recompute = 0.0
    for pos, i in enumerate(forward):
        here = live[pos] + workspaces[i]
        time += times[i]
        if here > fwd_peak:
            fwd_peak = here
            if here > bwd_peak:
                peak_at = ("fwd", pos)
    for k, i in enumerate(backward):
        here = live[boundary + 1 + k] + workspaces[i]
        if i < nf:  # NOTE [ What a recomputation costs ]
            time += costs[i]
            recompute += costs[i]
        else:
            time += times[i]
        if here > bwd_peak:
            bwd_peak = here
            if here >= fwd_peak:
                peak_at = ("bwd", k)
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


_ABSENT = -2  # in the simulator's value -> instance tables: no instance


def _check_op_lists(graph: RematGraph, schedule: Schedule) -> None:
    nf, n = graph.num_forward, len(graph.ops)
    forward = schedule.forward
    if forward and (min(forward) < 0 or max(forward) >= nf):
        i = next(i for i in forward if not 0 <= i < nf)
        raise ScheduleError(f"forward list holds op {i}, which is not a forward op")
    if len(set(forward)) != len(forward):
        seen: set[int] = set()
        i = next(i for i in forward if i in seen or seen.add(i))
        raise ScheduleError(f"forward runs op {graph.ops[i].name!r} twice")
    backward = schedule.backward
    if backward and (min(backward) < 0 or max(backward) >= n):
        i = next(i for i in backward if not 0 <= i < n)
        raise ScheduleError(f"backward list holds op {i}, which does not exist")
    recomputable = graph.flat.recomputable
    backward_seen: set[int] = set()
    for i in backward:
        if i >= nf:
            if i in backward_seen:
                raise ScheduleError(f"backward runs op {graph.ops[i].name!r} twice")
            backward_seen.add(i)
        elif not recomputable[i]:
            raise ScheduleError(
                f"op {graph.ops[i].name!r} is random or impure and may not be recomputed; save its "
                "outputs"
            )
    missing = n - nf - len(backward_seen)
    if missing:
        names = [graph.ops[i].name for i in graph.backward_ops if i not in backward_seen]
        raise ScheduleError(f"backward is missing {missing} ops, e.g. {names[:5]}")


def forward_ops_needed(graph: RematGraph, saved: frozenset[int] | set[int]) -> tuple[int, ...]:
    """Forward ops needed to produce the forward outputs and the saved values, in order."""
    need_values = set(graph.forward_outputs)
    need_values.update(saved)
    op_inputs, op_outputs = graph.flat.inputs, graph.flat.outputs
    needed: list[int] = []
    for i in range(graph.num_forward - 1, -1, -1):
        for v in op_outputs[i]:
            if v in need_values:
                needed.append(i)
                need_values.update(op_inputs[i])
                break
    needed.reverse()
    return tuple(needed)


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
    op_inputs, op_outputs = graph.flat.inputs, graph.flat.outputs
    read_later = bytearray(len(graph.values))  # 1: read by a later op before it is remade
    keep = [True] * len(schedule.backward)
    for pos in range(len(schedule.backward) - 1, -1, -1):
        i = schedule.backward[pos]
        outputs = op_outputs[i]
        if i < nf and not any(read_later[v] for v in outputs):
            keep[pos] = False
            continue
        for v in outputs:
            read_later[v] = 0
        for v in op_inputs[i]:
            read_later[v] = 1
    backward = tuple(i for i, k in zip(schedule.backward, keep) if k)
    saved = frozenset(v for v in schedule.saved if read_later[v])
    return Schedule(forward_ops_needed(graph, saved), saved, backward)


def _is_view_op(graph: RematGraph, i: int) -> bool:
    op = graph.ops[i]
    return op.recomputable and bool(op.outputs) and all(
        graph.values[v].alias_of is not None and graph.values[v].nbytes == 0 for v in op.outputs
    )


def save_storages(graph: RematGraph, schedule: Schedule) -> Schedule:
    """The same schedule handing no view to backward: each saved view of a forward value is
    replaced by the value it views (the same storage), and remade in backward before its reads.

    NOTE [ Save storages, not views ]
    Every tensor forward hands to backward costs the runtime a few microseconds, whatever its
    size: AOTAutograd detaches a view, marks its dynamic dims, saves and unpacks it. A view
    costs no memory to keep (its base's storage is kept anyway) and about a microsecond to
    remake. On a Mamba-style scan (6,477 small ops) the step that saved every value backward
    reads handed 947 tensors to backward, 666 of them views (512 ``unsqueeze``, 131 ``detach``),
    and its forward spent 4.7 ms in AOTAutograd's wrappers against 1.2 ms when it saved their
    bases (298 tensors) and remade the views: the step ran 3.1 ms faster (+14% over eager's ->
    +3.5%), backward 1.5 ms slower for the 1,182 views remade. The memory is the same: the
    storages kept are the same. The solvers' schedules already remake most views
    (:func:`remake_views`); this catches the rest, the unmodified step first of all, just before
    code generation. The plan is not re-priced: its baseline stays the sum of the op times.
    """
    nf = graph.num_forward
    values = graph.values
    returned = set(graph.user_outputs)  # backward reads these without their being saved
    saved: set[int] = set()
    for v in schedule.saved:
        while values[v].alias_of is not None and 0 <= values[v].producer < nf \
                and _is_view_op(graph, values[v].producer):
            v = values[v].alias_of
        if values[v].kind is ValueKind.ACTIVATION and v not in returned:  # inputs: always there
            saved.add(v)
    if saved == schedule.saved:
        return schedule
    storages = frozenset(saved)
    return remake_views(graph, Schedule(forward_ops_needed(graph, storages), storages,
                                        schedule.backward))


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
    stale_views = graph.flat.forward_views  # made stale when their base is remade
    available = set(schedule.saved) | set(graph.always_available) | set(graph.user_outputs)
    available.update(graph.flat.tangents)
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
                available.difference_update(stale_views[v])
        available.update(op.outputs)
    if sizes:
        saved = frozenset(schedule.saved | sizes)
        return Schedule(forward_ops_needed(graph, saved), saved, tuple(order))
    return Schedule(schedule.forward, schedule.saved, tuple(order))
