"""Options of a block: a Pareto set of ways to run it, trading memory kept for recomputation.

NOTE [ Block options ]
For a block (a sub-problem cut out with :func:`remat.subgraph.extract_subgraph`), an option says
which of its activations the first forward keeps for backward, and how its backward runs
(backward ops plus the recomputations they need). Each option is priced by simulating it on the
block alone: bytes kept, forward peak, backward peak, backward time. We always offer "keep
everything", "keep nothing" (recompute from the block's inputs, like ``torch.utils.checkpoint``)
and "least memory" (recompute for every backward op anew, freeing as it goes), and in between the exact ILP's answers under a grid of limits on the
bytes kept and a limit on the block's own peak (Rockmate's approach, with an explicit Pareto
filter instead of a heuristic spread).
Identical blocks (same ops, shapes and structure) share one solve (:func:`block_signature`).
"""
from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Callable

from ..errors import ScheduleError
from ..graph import Op, RematGraph, Value, ValueKind
from ..schedule import Schedule, forward_ops_needed, on_demand_schedule, save_all_schedule, simulate
from .base import Problem
from .ilp import _Model, solve_many

__all__ = ["BlockOption", "BlockOptions", "block_options", "block_options_many",
           "block_signature", "block_structure",
           "option_from_schedule", "pareto", "repriced_options", "sizes_close"]

log = logging.getLogger(__name__)

# Limits on the bytes a block keeps, as fractions of what keeping everything keeps.
SAVE_GRID = (0.0, 0.15, 0.3, 0.5, 0.75)
# Limits on a block's own peak: fractions of its peak when it keeps everything, and fractions
# of the way from the lowest peak we know for it (the "least memory" option's) to that peak.
# The first kind alone was often entirely below the lowest possible peak (ResNet blocks, whose
# backward peak is mostly gradients, then had no low-peak option but "least memory", which
# recomputes everything for every backward op: +35% step time at 50% instead of +21%); the
# second kind alone lost options a U-Net needed (+30% instead of +21% at 50%).
# One point of the second kind is enough: the save grid's options already span the peaks, and
# peak-limited MIPs are the slow ones (a Mamba block's: 0.9-4.5 s each, its save-limited ones
# 0.1-2.7 s). With the first kind's 3 points and 3 of the second, the MLP, ViT, U-Net, ResNet
# and 1-2 layer GPTs at 70/50/30% found the same schedules within 0.5 points (ViT at 70%: +5.5%
# instead of +5.9%, at 50% +10.3% instead of +10.1%; a small Mamba-style scan at 50%: +78%
# instead of +110%) and their solves took 1.5-2x as long (ViT: 5.2-5.8 s -> 3.3-3.9 s).
PEAK_GRID: tuple[float, ...] = ()
PEAK_RANGE_GRID = (0.4,)


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block (local indices of its sub-graph).

    Attributes:
        name: ``"all"``, ``"none"`` or ``"ilp<=30%"``.
        forward: Forward ops a forward that keeps ``saved`` must run.
        saved: Values kept from that forward for the backward.
        backward: Backward list: the block's backward ops and its internal recomputations.
        saved_bytes: Bytes of the block's own activations kept (storages counted once).
        forward_peak: Peak while the forward runs (relative to the block's inputs).
        backward_peak: Peak while the backward runs, kept activations included.
        backward_time: Seconds of the backward list (recomputation included).
        recompute_time: Seconds of recomputation in it.
    """

    name: str
    forward: tuple[int, ...]
    saved: frozenset[int]
    backward: tuple[int, ...]
    saved_bytes: int
    forward_peak: int
    backward_peak: int
    backward_time: float
    recompute_time: float


@dataclass(frozen=True)
class BlockOptions:
    """The Pareto set of a block, with what running it without keeping anything costs.

    Attributes:
        options: Non-dominated options, fewest bytes kept first.
        forward_time: Seconds of the block's whole forward, each op at its
            :attr:`~remat.graph.Op.recompute_cost` (what the solvers weigh are the forwards run
            again; the first one, the same in every schedule, shifts every total alike).
        nosave_forward: Forward ops needed just to produce the block's outputs.
        nosave_time: Seconds of those (priced the same way).
        nosave_peak: Peak while they run (nothing kept).
    """

    options: tuple[BlockOption, ...]
    forward_time: float
    nosave_forward: tuple[int, ...]
    nosave_time: float
    nosave_peak: int


def block_signature(sub: RematGraph) -> str:
    """A hash of a block's structure: ops, wiring, shapes and sizes (not names, times or
    constant arguments).

    Two blocks with the same hash take the same options: a schedule is valid for any block with
    the same wiring, and its price depends on each op's kind and tensor shapes (its work) and on
    the bytes, not on constants such as an index. So the steps of a scan written as a Python
    loop (``x[:, i]`` for each ``i``) are one block, not one per step: a 64-step Mamba-style
    scan cut into 4-step segments solves 1 segment, not 16.
    """
    return _block_hash(sub, lambda op: _work(op.signature),
                       lambda v: f"{v.kind.value}|{v.nbytes}|{v.alias_of}|{v.producer}")


def block_structure(sub: RematGraph) -> str:
    """A hash of a block's wiring alone: :func:`block_signature` without shapes or sizes.

    NOTE [ Blocks that differ only in size ]: a schedule (what the forward keeps, what backward
    recomputes, in which order) is valid for every block wired the same way, whatever its
    tensors' sizes; only its price changes. Layers of different widths (a GPT whose every MLP
    is another width; the 24 layers of such a GPT were 24 blocks solved one by one, past the
    60 s time limit) share a structure. A block whose structure was solved before, at sizes
    close to its own (:func:`sizes_close`), takes that block's schedules, priced anew on its own
    ops and sizes (:func:`repriced_options`), instead of its own MIPs.
    """
    return _block_hash(sub, lambda op: op.signature.partition("(")[0],
                       lambda v: f"{v.kind.value}|{v.nbytes > 0}|{v.alias_of}|{v.producer}|{v.scalar}")


def _block_hash(sub: RematGraph, op_work: Callable[[Op], str], value: Callable[[Value], str]
                ) -> str:
    """A hash of a block's wiring (each op's phase, inputs, outputs and recomputability; its
    outputs) with what ``op_work`` and ``value`` say of each op and value."""
    h = hashlib.sha1()
    for op in sub.ops:
        h.update(f"{op.phase.value}|{op_work(op)}|{op.inputs}|{op.outputs}|"
                 f"{op.recomputable}".encode())
    for v in sub.values:
        h.update(value(v).encode())
    h.update(f"{sub.forward_outputs}|{sub.backward_outputs}|{sub.user_outputs}".encode())
    return h.hexdigest()


# Sizes within this factor of each other, value by value, count as close: the schedules of one
# are nearly the best of the other (NOTE [ Blocks that differ only in size ]). A U-Net's levels
# (each half the bytes of the one above) are not close; a GPT's layers 16 MLP columns apart are.
_CLOSE_SIZES = 1.25


def sizes_close(a: RematGraph, b: RematGraph) -> bool:
    """Whether two blocks of one structure have every value's bytes within ``_CLOSE_SIZES``."""
    return all(x.nbytes <= _CLOSE_SIZES * y.nbytes and y.nbytes <= _CLOSE_SIZES * x.nbytes
               for x, y in zip(a.values, b.values))


def repriced_options(sub: RematGraph, solved: BlockOptions) -> BlockOptions:
    """``sub``'s options from the schedules of another block of its structure, each simulated
    on ``sub`` (NOTE [ Blocks that differ only in size ])."""
    own = block_options(sub, use_ilp=False)  # keep-all, keep-nothing, least memory, and costs
    candidates = list(own.options)
    for o in solved.options:
        if o.name not in ("all", "none", "least-memory"):
            schedule = Schedule(o.forward, o.saved, o.backward)
            try:
                candidates.append(option_from_schedule(sub, o.name, schedule))
            except ScheduleError:  # the wiring is the same, so never seen; the option is dropped
                log.warning("remat: a schedule of a block of the same structure does not fit "
                            "another; please report it", exc_info=True)
    return BlockOptions(options=pareto(candidates), forward_time=own.forward_time,
                        nosave_forward=own.nosave_forward, nosave_time=own.nosave_time,
                        nosave_peak=own.nosave_peak)


_TENSOR_ARG = re.compile(r"T\([^)]*\)\w+")


def _work(signature: str) -> str:
    """An op's target and tensor arguments (shapes, dtypes) from its signature, without its
    constants: ``aten.select.int(T(s0, 64, 128)float32,1,57;)`` ->
    ``aten.select.int T(s0, 64, 128)float32``."""
    target, _, args = signature.partition("(")
    return " ".join([target, *_TENSOR_ARG.findall(args)])


def _own_bytes(sub: RematGraph, saved: frozenset[int]) -> int:
    root = sub.storage_root
    pinned = {root[v] for v in sub.user_outputs}
    roots = {root[v] for v in saved if sub.values[root[v]].kind is ValueKind.ACTIVATION}
    return sum(sub.values[r].nbytes for r in roots - pinned)


def option_from_schedule(sub: RematGraph, name: str, schedule: Schedule) -> BlockOption:
    """Price a schedule of a block as a :class:`BlockOption` (by simulating it)."""
    sim = simulate(sub, schedule)
    backward_time = sum(sub.ops[i].recompute_cost if i < sub.num_forward else sub.ops[i].time
                        for i in schedule.backward)
    return BlockOption(
        name=name,
        forward=schedule.forward,
        saved=schedule.saved,
        backward=schedule.backward,
        saved_bytes=_own_bytes(sub, schedule.saved),
        forward_peak=sim.forward_peak_bytes,
        backward_peak=sim.backward_peak_bytes,
        backward_time=backward_time,
        recompute_time=sim.recompute_time,
    )


def pareto(options: list[BlockOption]) -> tuple[BlockOption, ...]:
    """The options no other option beats on every count (bytes kept, peaks, time)."""

    def key(o: BlockOption) -> tuple:
        return (o.saved_bytes, o.backward_peak, o.forward_peak, o.backward_time)

    kept: list[BlockOption] = []
    for o in sorted(options, key=lambda o: (key(o), o.name)):
        if any(all(a <= b for a, b in zip(key(k), key(o))) for k in kept):
            continue
        kept.append(o)
    return tuple(kept)


def block_options(sub: RematGraph, *, time_limit: float = 10.0, max_variables: int = 20_000,
                  save_grid: tuple[float, ...] = SAVE_GRID, peak_grid: tuple[float, ...] = PEAK_GRID,
                  peak_range_grid: tuple[float, ...] = PEAK_RANGE_GRID,
                  max_nodes: int | None = None,
                  use_ilp: bool = True, deadline: float | None = None) -> BlockOptions:
    """Compute the options of a block. See NOTE [ Block options ].

    Args:
        sub: The block as a graph of its own (see :func:`remat.subgraph.extract_subgraph`).
        time_limit: Seconds for each ILP solve (the best incumbent is used after that).
        max_variables: Skip the ILP options for blocks whose model would be larger.
        save_grid: Limits on bytes kept, as fractions of keeping everything.
        peak_grid: Limits on the block's peak, as fractions of its peak when keeping everything.
        peak_range_grid: More limits, as fractions of the way from its lowest known peak (the
            "least memory" option's) to its peak when keeping everything.
        use_ilp: Compute the in-between options with the ILP (else only "all" and "none").
        max_nodes: Bound on each ILP's branch-and-bound nodes (HiGHS), besides the time limit.
        deadline: ``time.perf_counter()`` value after which no further ILP starts (and none
            runs past it): the options found so far are returned.

    Returns:
        The block's :class:`BlockOptions`.
    """
    problems = _option_problems(sub, time_limit=time_limit, max_variables=max_variables,
                                save_grid=save_grid, peak_grid=peak_grid,
                                peak_range_grid=peak_range_grid, max_nodes=max_nodes,
                                use_ilp=use_ilp)
    return problems.finish(solve_many(problems.problems, deadline=deadline))


def block_options_many(jobs: list[tuple[RematGraph, dict]], *, deadline: float | None = None
                       ) -> list[BlockOptions]:
    """:func:`block_options` of several blocks (each with its keyword arguments but
    ``deadline``), their MIPs solved all at once, largest models first.

    NOTE [ The MIPs of many blocks at once ]: one block's MIPs (6 on a leaf, 5 on a mid-block)
    differ in length by up to 10x, so solved block by block the cores idled at each block's
    tail (a ViT's solve used 1.2 of 2 cores). Pooled, the longest start first and the short ones
    fill in: the largest models first and, among a block's, the one limited by its peak, not by
    the bytes it keeps (the slowest of its block on a GPT layer, 1.6 s against 0.2-0.7 s, and on
    each of a ViT's three kinds of leaf; started last, it ran alone on one core at the end).
    Each MIP is bounded by nodes, so what is found does not change.
    """
    prepared = [_option_problems(sub, **kwargs) for sub, kwargs in jobs]
    order = sorted((-p.size, "save_budget" in q.options, k, j) for k, p in enumerate(prepared)
                   for j, q in enumerate(p.problems))
    solved = solve_many([prepared[k].problems[j] for *_, k, j in order], deadline=deadline)
    results: list[list] = [[None] * len(p.problems) for p in prepared]
    for (*_, k, j), result in zip(order, solved):
        results[k][j] = result
    return [p.finish(r) for p, r in zip(prepared, results)]


@dataclass
class _OptionProblems:
    """A block's fixed options and the MIPs of its other ones (see :func:`block_options`)."""

    sub: RematGraph
    candidates: list[BlockOption]
    names: list[str]
    problems: list[Problem]
    size: int  # binaries of each of its MIPs

    def finish(self, results: list) -> BlockOptions:
        sub, candidates = self.sub, list(self.candidates)
        for name, result in zip(self.names, results):
            if result is not None and result.schedule is not None \
                    and result.status != "infeasible":
                candidates.append(option_from_schedule(sub, f"ilp:{name}", result.schedule))
        # A forward that keeps nothing still keeps what random ops drew (the "none" option's saves).
        nosave = forward_ops_needed(sub, frozenset())
        keep_nothing = self.candidates[1]
        return BlockOptions(
            options=pareto(candidates),
            forward_time=sum(sub.ops[i].recompute_cost for i in sub.forward_ops),
            nosave_forward=nosave,
            nosave_time=sum(sub.ops[i].recompute_cost for i in nosave),
            nosave_peak=keep_nothing.forward_peak,
        )


def _option_problems(sub: RematGraph, *, time_limit: float = 10.0, max_variables: int = 20_000,
                     save_grid: tuple[float, ...] = SAVE_GRID,
                     peak_grid: tuple[float, ...] = PEAK_GRID,
                     peak_range_grid: tuple[float, ...] = PEAK_RANGE_GRID,
                     max_nodes: int | None = None, use_ilp: bool = True) -> _OptionProblems:
    everything = save_all_schedule(sub)
    candidates = [option_from_schedule(sub, "all", everything)]
    candidates.append(option_from_schedule(sub, "none", on_demand_schedule(sub, frozenset())))
    candidates.append(option_from_schedule(
        sub, "least-memory", on_demand_schedule(sub, frozenset(), keep_recomputed=False)))
    full_saved = candidates[0].saved_bytes
    names: list[str] = []
    problems: list[Problem] = []
    size = 0
    if use_ilp and full_saved > 0 and any(0.0 < f < 1.0 for f in save_grid):
        model = _Model(sub, 0)
        size = model.num_variables
        if model.num_variables <= max_variables and model.stages:
            ceiling = candidates[0].backward_peak + candidates[1].backward_peak + \
                candidates[0].forward_peak
            limits = [(f"kept<={100 * f:.0f}%", ceiling, int(f * full_saved))
                      for f in save_grid if 0.0 <= f < 1.0]
            # Low-peak options: the least time under a limit on the block's own peak (what the
            # parent needs when memory is tight), as in Rockmate's two-dimensional grid.
            top = max(candidates[0].backward_peak, candidates[0].forward_peak)
            low = min(top, max(candidates[2].backward_peak, candidates[2].forward_peak))
            peaks = {int(f * top): f"peak<={100 * f:.0f}%" for f in peak_grid}
            peaks.update({int(low + f * (top - low)): f"peak<=low+{100 * f:.0f}%"
                          for f in peak_range_grid if top > low})
            limits += [(name, peak, None) for peak, name in sorted(peaks.items())]
            for name, peak, kept in limits:
                options = {"max_variables": max_variables, "max_nodes": max_nodes}
                if kept is not None:
                    options["save_budget"] = kept
                names.append(name)
                problems.append(Problem(sub, peak, time_limit=time_limit, options=options))
    return _OptionProblems(sub, candidates, names, problems, size)
