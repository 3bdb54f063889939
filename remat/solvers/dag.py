"""The upper level for graphs that are not chains: an ILP over block options (HiRemate's HILP).

NOTE [ The block ILP ]
The chain DP (:mod:`remat.solvers.chain`) sees a sequence of blocks, each reading only the one
before it. A U-Net's decoder reads encoder features from far back, a model's head may read an
early embedding: storages that cross several blocks. The chain model counts such a storage in
every cut it crosses and cannot drop it and recompute it later, so it over-charges memory and
misses schedules. Here the blocks (the same segments, regions and options) form a DAG, and an ILP
decides, for backward *stages* t = 0..n-1 (stage t runs the backward of block b(t) = n-1-t):

* ``S[c, o]``: the first forward of block c keeps option o's activations (one option per block);
  ``s[r]``: storage r that crosses blocks is kept from the first forward;
* ``A[t, c, o]``: block c's option-o activations are alive at the start of stage t;
* ``RF[t, c, o]``: block c's forward is rerun in stage t keeping option o's activations;
  ``RN[t, c]``: it is rerun keeping nothing (to remake the storages it hands to others);
* ``K[t, r]``: storage r is alive at the start of stage t;
* ``U[t, o]``: block b(t)'s backward runs with option o.

Constraints: one option per backward; an option's activations come from the first forward or a
rerun (``A[t+1] <= A[t] + RF[t]``, ``A[0] <= S``); a storage is alive only if kept or remade
(``K[t+1, r] <= K[t, r] + remade[t, r]``); a rerun or a backward needs every storage it reads
(kept, or remade earlier in the same stage: reruns run in forward order); memory at each
backward, at each rerun and at each block of the first forward stays within the capacity. The
objective is the time of the reruns and of the chosen backwards.

The model's memory accounting is approximate (storages remade in a stage count for the whole
stage, an option's backward peak is taken from its block alone), so, as for the chain DP, the
simulator judges: we solve at the budget, then at a lower capacity while the simulated peak is
over it, or a higher one while the model finds nothing or leaves memory unused. The actions
become one schedule with :func:`remat.solvers.upper.assemble`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pulp

from ..errors import ScheduleError
from ..graph import RematGraph, ValueKind
from ..liveness import liveness
from ..schedule import Schedule, Simulation, simulate
from ..segments import Chain
from ..subgraph import Subgraph
from .base import time_cut
from .mip import _binary_factory, make_mip_solver, step_gap
from .options import BlockOptions
from .upper import assemble  # the chain DP's merge step serves both upper levels

__all__ = ["BlockDAG", "block_dag", "solve_block_dag"]

log = logging.getLogger(__name__)

# Bound on branch-and-bound nodes per solve: the answer must not depend on machine load. The
# time limit per solve only guards against a pathological model (the solve's deadline caps all).
_MAX_NODES = 2_000
_MIP_TIME_LIMIT = 10.0
# NOTE [ The gap that matters ] holds here too, at 2% of the step time where the exact ILP asks
# for 1%. This MIP's relaxation is weak (a U-Net at 50%: its LP bound 7% of the step below the
# optimum, cuts take it to 3%) and HiGHS finds its answer well before it proves it: on U-Net
# captures whose block ILP took 2-3 s, the answer was found at 1.0-1.4 s, the rest went to the
# proof, all at the root node (a node bound cannot cut that). Fourteen block ILPs of five U-Net
# captures (33-70% budgets) and a T5-small config: the same objective at 2% as at 1%, the slow
# ones 2.0 -> 1.8, 2.3 -> 1.4, 3.1 -> 1.7, 1.3 -> 0.5 s. Whole solves of 20 problems (those
# captures at 33-70%, T5 at 33-70%): 18 the same schedule; U-Net at 50% 3.0 -> 2.4 s and at 45%
# 4.2-4.5 -> 3.2 s, same schedules; one U-Net at 50% took another path (its first schedule left
# 6% of the memory unused, so a second MIP ran) and ended +15.4% instead of +14.9%.
# (At 1%: U-Net at 50%, the one MIP 2.7 s -> 2.0 s from 0.5%, the same schedule.)
_STEP_GAP = 2e-2
# The objective counts microseconds of backward and recomputation.
_OBJECTIVE_SCALE = 1e6


@dataclass(frozen=True)
class BlockDAG:
    """Blocks of a chain seen as a DAG: what crosses between them and who reads it.

    Attributes:
        storages: Storage roots (global value indices) produced by one block and read by
            another block's forward or backward.
        producer: Block producing each storage.
        remakeable: Whether rerunning its block remakes it (its producer is recomputable).
        nbytes: Size of each storage.
        forward_reads: For each block, the storages its forward (keep-nothing) reads.
        option_forward_reads / option_backward_reads: For each block and option, storages read
            by the option's forward / its backward list (inputs of internal recomputations
            and values of other blocks its backward ops read).
        forward_live: For each block, bytes of crossing storages the unmodified forward holds
            while the block runs (produced before it, read by it or later forward ops).
        last_forward_reader: For each storage, the last block whose forward reads it.
        first_reader: For each storage, the first block that reads it (forward or backward).
        option_forward_time: For each block and option, seconds of the option's forward.
        backward_base: For each block, backward-side bytes alive when its region starts.
        forward_base: For each block, model outputs produced before it.
        is_chain: True if every storage is read only by the block right after its producer.
    """

    storages: tuple[int, ...]
    producer: tuple[int, ...]
    remakeable: tuple[bool, ...]
    nbytes: tuple[int, ...]
    forward_reads: tuple[frozenset[int], ...]
    option_forward_reads: tuple[tuple[frozenset[int], ...], ...]
    option_backward_reads: tuple[tuple[frozenset[int], ...], ...]
    forward_live: tuple[int, ...]
    last_forward_reader: tuple[int, ...]
    first_reader: tuple[int, ...]
    option_forward_time: tuple[tuple[float, ...], ...]
    backward_base: tuple[int, ...]
    forward_base: tuple[int, ...]
    is_chain: bool


def block_dag(graph: RematGraph, chain: Chain, subs: list[Subgraph],
              options: list[BlockOptions]) -> BlockDAG:
    """The :class:`BlockDAG` of a chain's segments (see NOTE [ The block ILP ])."""
    values, ops = graph.values, graph.ops
    nf = graph.num_forward
    root = graph.storage_root
    block_of_op = {i: k for k, seg in enumerate(chain.segments) for i in seg}
    pinned = {root[v] for v in graph.user_outputs}

    def crossing(block: int, sub: Subgraph, local_ops) -> frozenset[int]:
        """Storages of other blocks' forward that ``local_ops`` of ``sub`` read."""
        found = set()
        for i in local_ops:
            for lv in sub.graph.ops[i].inputs:
                v = sub.values[lv]
                r = root[v]
                p = values[r].producer
                if (0 <= p < nf and values[r].kind is ValueKind.ACTIVATION and r not in pinned
                        and block_of_op[p] != block and values[r].nbytes):
                    found.add(r)
        return frozenset(found)

    n = len(subs)
    fwd_reads, opt_f, opt_b = [], [], []
    for c, (sub, opts) in enumerate(zip(subs, options)):
        fwd_reads.append(crossing(c, sub, sub.graph.forward_ops))
        opt_f.append(tuple(crossing(c, sub, o.forward) for o in opts.options))
        opt_b.append(tuple(crossing(c, sub, o.backward) for o in opts.options))
    storages = sorted(set().union(*fwd_reads, *(s for x in opt_f for s in x),
                                  *(s for x in opt_b for s in x)))
    index = {r: k for k, r in enumerate(storages)}

    def remap(sets):
        return frozenset(index[r] for r in sets)

    producer = tuple(block_of_op[values[r].producer] for r in storages)
    last_fwd = [producer[k] for k in range(len(storages))]
    for c, reads in enumerate(fwd_reads):
        for r in reads:
            last_fwd[index[r]] = max(last_fwd[index[r]], c)
    nbytes = tuple(values[r].nbytes for r in storages)
    forward_live = tuple(
        sum(nbytes[k] for k in range(len(storages)) if producer[k] < c <= last_fwd[k])
        for c in range(n))
    # A chain: every crossing storage is read (forward or backward) only by the next block.
    readers: list[set[int]] = [set() for _ in storages]
    for c in range(n):
        for r in fwd_reads[c] | set().union(*opt_b[c], *opt_f[c]):
            readers[index[r]].add(c)
    is_chain = all(rd <= {producer[k] + 1} for k, rd in enumerate(readers))
    first_reader = tuple(min(rd) for rd in readers)

    bwd_base = _incoming_backward_bytes(graph, chain)
    out_roots = [(block_of_op[values[r].producer], values[r].nbytes) for r in pinned
                 if 0 <= values[r].producer < nf]
    fwd_base = tuple(sum(b for p, b in out_roots if p < c) for c in range(n))
    return BlockDAG(
        storages=tuple(storages),
        producer=producer,
        remakeable=tuple(ops[values[r].producer].recomputable for r in storages),
        nbytes=nbytes,
        forward_reads=tuple(remap(s) for s in fwd_reads),
        option_forward_reads=tuple(tuple(remap(s) for s in x) for x in opt_f),
        option_backward_reads=tuple(tuple(remap(s) for s in x) for x in opt_b),
        forward_live=forward_live,
        last_forward_reader=tuple(last_fwd),
        first_reader=first_reader,
        option_forward_time=tuple(
            tuple(sum(sub.graph.ops[i].recompute_cost for i in o.forward) for o in opts.options)
            for sub, opts in zip(subs, options)),
        backward_base=tuple(bwd_base),
        forward_base=fwd_base,
        is_chain=is_chain,
    )


def _incoming_backward_bytes(graph: RematGraph, chain: Chain) -> list[int]:
    """For each block, the backward-side bytes alive when its region starts (regions run from
    the last block to the first): gradients made by earlier regions and still to be read
    there or later, parameter gradients, tangents, model outputs. What the region itself makes
    is in its options' backward peaks."""
    values, ops = graph.values, graph.ops
    root = graph.storage_root
    order = [b for region in reversed(chain.regions) for b in region]
    region_of = {b: c for c, region in enumerate(chain.regions) for b in region}
    kept_to_end = {root[v] for v in graph.backward_outputs}
    last_region: dict[int, int] = {}  # storage -> the last region (lowest index) reading it
    born: dict[int, int] = {}  # storage -> region that makes it (n for tangents)
    n = len(chain.regions)
    for v, value in enumerate(values):
        if value.kind is ValueKind.TANGENT and value.nbytes:
            born[v] = n
    for b in order:
        c = region_of[b]
        for v in ops[b].inputs:
            r = root[v]
            if r in born:
                last_region[r] = min(last_region.get(r, c), c)
        for v in ops[b].outputs:
            r = root[v]
            if values[r].kind is ValueKind.GRADIENT and values[r].nbytes and r not in born:
                born[r] = c
    outputs = liveness(graph).output_bytes
    return [outputs + sum(values[r].nbytes for r, made in born.items()
                          if made > c and (r in kept_to_end or last_region.get(r, made) <= c))
            for c in range(n)]


def _affine(terms: list[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Sum of coefficient * variable, adding up repeated variables (``LpAffineExpression``
    built from pairs keeps only the last coefficient of a variable that appears twice: a
    rerun counted for the activations it keeps and for the storages it remakes lost one)."""
    total: dict[pulp.LpVariable, float] = {}
    for var, coef in terms:
        total[var] = total.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(total.items()))


class _BlockModel:
    """The ILP of NOTE [ The block ILP ] at one memory capacity."""

    def __init__(self, dag: BlockDAG, options: list[BlockOptions], capacity: int,
                 ceilings: dict[tuple[str, int], int] | None = None) -> None:
        self.dag, self.options = dag, options
        n = self.n = len(options)
        prob = self.prob = pulp.LpProblem("remat_blocks", pulp.LpMinimize)
        binary = _binary_factory(prob)
        unit = max(1.0, capacity / 1e6)

        def size(nbytes: int) -> float:
            return round(nbytes / unit, 3)

        cap = capacity / unit
        ceilings = ceilings or {}
        self.unit = unit
        # The memory limits by place, ("bwd", stage) or ("fwd", block of the first forward),
        # and the bytes each leaves out of its terms.
        self.limits: dict[tuple[str, int], list[tuple[pulp.LpConstraint, int]]] = {}

        def limit(place: tuple[str, int], base: int, terms: list) -> None:
            """Memory at ``place``: ``terms`` and ``base`` bytes within the capacity, or the
            lower ceiling the simulator's peaks have set there."""
            ceiling = min(cap, ceilings.get(place, capacity) / unit)
            constraint = _affine(terms) <= ceiling - size(base)
            prob.addConstraint(constraint)
            self.limits.setdefault(place, []).append((constraint, base))

        nopt = [len(o.options) for o in options]
        a = [[size(o.saved_bytes) for o in opts.options] for opts in options]
        fpk = [[size(o.forward_peak) for o in opts.options] for opts in options]
        bpk = [[size(o.backward_peak) for o in opts.options] for opts in options]
        npk = [size(opts.nosave_peak) for opts in options]
        nb = [size(x) for x in dag.nbytes]
        storages = range(len(dag.storages))
        # Last stage at which storage r may be read: the stage of the first block reading it.
        last_stage = {r: n - 1 - dag.first_reader[r] for r in storages}

        self.S = {(c, o): binary(f"S_{c}_{o}") for c in range(n) for o in range(nopt[c])}
        self.s = {r: binary(f"s_{r}") for r in storages}
        self.A, self.RF, self.RN, self.K, self.U = {}, {}, {}, {}, {}
        for t in range(n):
            b = n - 1 - t
            for c in range(b + 1):
                for o in range(nopt[c]):
                    self.A[t, c, o] = binary(f"A_{t}_{c}_{o}")
                    self.RF[t, c, o] = binary(f"RF_{t}_{c}_{o}")
            for r in storages:
                if t <= last_stage[r]:
                    self.K[t, r] = binary(f"K_{t}_{r}")
            for o in range(nopt[b]):
                self.U[t, o] = binary(f"U_{t}_{o}")
        # A rerun without saving is useful only to remake storages someone reads later; blocks
        # after b(t) are never rerun (their storages are kept, or remade by their own stage).
        makes = [[r for r in storages if dag.producer[r] == c and dag.remakeable[r]]
                 for c in range(n)]
        for t in range(n):
            for c in range(n - 1 - t):
                if any(t <= last_stage[r] for r in makes[c]):
                    self.RN[t, c] = binary(f"RN_{t}_{c}")
        A, RF, RN, K, U, S, s = self.A, self.RF, self.RN, self.K, self.U, self.S, self.s

        def remade(t: int, r: int):
            c = dag.producer[r]
            if not dag.remakeable[r]:
                return []
            terms = [RN[t, c]] if (t, c) in RN else []
            return terms + [RF[t, c, o] for o in range(nopt[c]) if (t, c, o) in RF]

        def available(t: int, r: int):
            return pulp.lpSum([K[t, r]] + remade(t, r)) if (t, r) in K else None

        def require(t: int, reads, var) -> None:
            for r in reads:
                have = available(t, r)
                prob.addConstraint((have >= var) if have is not None else (var == 0))

        times = []
        for t in range(n):
            b = n - 1 - t
            prob += pulp.lpSum(U[t, o] for o in range(nopt[b])) == 1
            for o in range(nopt[b]):
                prob += U[t, o] <= A[t, b, o] + RF[t, b, o]
                require(t, dag.option_backward_reads[b][o], U[t, o])
                times.append((U[t, o], options[b].options[o].backward_time))
            for c in range(n):
                reruns = [RF[t, c, o] for o in range(nopt[c]) if (t, c, o) in RF]
                if (t, c) in RN:
                    reruns.append(RN[t, c])
                    require(t, dag.forward_reads[c], RN[t, c])
                    times.append((RN[t, c], options[c].nosave_time))
                if len(reruns) > 1:
                    prob += pulp.lpSum(reruns) <= 1
                for o in range(nopt[c]):
                    if (t, c, o) in RF:
                        require(t, dag.option_forward_reads[c][o], RF[t, c, o])
                        times.append((RF[t, c, o], dag.option_forward_time[c][o]))
            for c in range(b + 1):
                for o in range(nopt[c]):
                    before = S[c, o] if t == 0 else A[t - 1, c, o] + RF[t - 1, c, o]
                    prob += A[t, c, o] <= before
            for r in storages:
                if (t, r) in K:
                    prob += K[t, r] <= (s[r] if t == 0 else
                                        pulp.lpSum([K[t - 1, r]] + remade(t - 1, r)))
            # Memory while block b's backward runs.
            kept = [(A[t, c, o], a[c][o]) for c in range(b) for o in range(nopt[c])]
            kept += [(RF[t, c, o], a[c][o]) for c in range(b) for o in range(nopt[c])]
            alive = [(K[t, r], nb[r]) for r in storages if (t, r) in K]
            alive += [(x, nb[r]) for r in storages if (t, r) in K for x in remade(t, r)]
            own = [(U[t, o], bpk[b][o]) for o in range(nopt[b])]
            limit(("bwd", t), dag.backward_base[b], kept + alive + own)
            # Memory while block c is rerun in this stage (reruns go in forward order).
            for c in range(n):
                runs = [(RF[t, c, o], fpk[c][o]) for o in range(nopt[c]) if (t, c, o) in RF]
                if (t, c) in RN:
                    runs.append((RN[t, c], npk[c]))
                if not runs:
                    continue
                held = [(A[t, d, o], a[d][o]) for d in range(b + 1) for o in range(nopt[d])]
                held += [(RF[t, d, o], a[d][o]) for d in range(min(c, b + 1))
                         for o in range(nopt[d])]
                held += [(K[t, r], nb[r]) for r in storages if (t, r) in K]
                held += [(x, nb[r]) for r in storages if (t, r) in K and dag.producer[r] < c
                         for x in remade(t, r)]
                limit(("bwd", t), dag.backward_base[b], held + runs)
        # The first forward: one option per block; memory at each block.
        for c in range(n):
            prob += pulp.lpSum(S[c, o] for o in range(nopt[c])) == 1
            terms = [(S[d, o], a[d][o]) for d in range(c) for o in range(nopt[d])]
            terms += [(s[r], nb[r]) for r in storages
                      if dag.producer[r] < c and dag.last_forward_reader[r] < c]
            terms += [(S[c, o], fpk[c][o]) for o in range(nopt[c])]
            limit(("fwd", c), dag.forward_live[c] + dag.forward_base[c], terms)
        prob += _affine([(x, _OBJECTIVE_SCALE * sec) for x, sec in times])

    def used(self, place: tuple[str, int]) -> int:
        """The most bytes the solution uses at ``place``, as the model counts them."""
        return max(int(self.unit * (c.value() - c.constant)) + base
                   for c, base in self.limits[place])

    def actions(self) -> list[tuple]:
        """The solution as backward-phase actions for :func:`assemble`."""

        def on(var) -> bool:
            return (var.value() or 0) > 0.5

        out: list[tuple] = []
        n = self.n
        for t in range(n):
            b = n - 1 - t
            for c in range(n):
                if (t, c) in self.RN and on(self.RN[t, c]):
                    out.append(("F0", c))
                for o in range(len(self.options[c].options)):
                    if (t, c, o) in self.RF and on(self.RF[t, c, o]):
                        out.append(("F", c, o))
            chosen = [o for o in range(len(self.options[b].options)) if on(self.U[t, o])]
            out.append(("B", b, chosen[0]))
        return out


def solve_block_dag(graph: RematGraph, dag: BlockDAG, subs: list[Subgraph],
                    options: list[BlockOptions], budget: int, *, deadline: float,
                    attempts: int = 6) -> tuple[Schedule, Simulation] | None:
    """The fastest schedule the block ILP finds whose simulated peak fits ``budget``.

    NOTE [ Correcting the block ILP where it errs ]: the model's memory is approximate in both
    directions, so the simulator judges. Starting at ``budget``, the capacity given to the
    model goes up when the model finds nothing (it was pessimistic) or its schedule leaves 5%
    of the budget or more unused. When the simulated peak is over the budget, the model was
    optimistic *at one place*: the stage (or first-forward block) where the peak lies gets a
    ceiling, what the solution used there by the model's count less what it missed, which
    holds at every capacity after, and the same capacity is solved again. Searching the
    capacity alone, as this did before, cannot fix that: on a U-Net at 45% the model was
    pessimistic elsewhere (nothing fits at capacity 1.03 of the budget) and optimistic by 0.7%
    of the budget at the last stage; six MIPs bisecting the capacity between 1.03 and 1.06 all
    gave that 1.007 peak (the solve took 14.8 s; now 4.1 s, each capped place soon proven
    infeasible). On the tests' U-shaped graphs at 5-60% of the way from the lower bound to the
    unmodified peak, 3 of 24 solves got faster schedules (one found where none was) and none
    slower. At most ``attempts`` solves, each bounded in branch-and-bound nodes. ``None`` if
    no schedule fits.
    """
    step = max(1, budget // 33)  # ~3% of the budget
    # Memory left that is worth more MIPs (1-4 s each on a U-Net): what the polish does with
    # less is about as good. U-Net at 50%: 2.4% left, three more MIPs (6.4 s) for 126.75 ->
    # 126.70 ms; 4.6% left, three more (5.5 s) for +17.88% -> +17.73% step time (solve 8.9 s ->
    # 3.4 s without them); with 6-9% left at 70% the search bought 1-2% step time. Since the
    # MIPs stop within 2% of the step time (_STEP_GAP) the first one may leave ~6% unused for
    # nothing better: one U-Net capture at 50% left 5.9% and its second MIP took the solve from
    # 2.2 s to 3.1 s for the same schedule; at 1/15 instead of 1/20, over seven captures at
    # 50/55/65/75% and five other U-Net and four T5 problems, every schedule is the same but
    # one, better (+12.40% -> +11.99% step time, 2.1 s -> 1.4 s).
    worth_more = max(step, budget // 15)
    gap = step_gap(graph, _OBJECTIVE_SCALE, _STEP_GAP)
    capacity, best = budget, None
    ceilings: dict[tuple[str, int], int] = {}  # bytes the model may count, by place
    for _ in range(attempts):
        if deadline - time.perf_counter() < 1.0:
            time_cut("block ILP search")
            break
        model = _BlockModel(dag, options, capacity, ceilings)
        mip = make_mip_solver(min(deadline - time.perf_counter(), _MIP_TIME_LIMIT),
                              max_nodes=_MAX_NODES, gap_abs=gap)
        model.prob.solve(mip)
        sim = None
        if model.prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            try:
                schedule = assemble(graph, subs, options, model.actions(), backward_only=True)
                sim = simulate(graph, schedule)
            except (ScheduleError, ValueError) as exc:
                log.debug("block ILP at capacity %d gave an invalid schedule: %s", capacity, exc)
                break
        log.debug("block ILP at %.3f of the budget, ceilings %s: %s", capacity / budget, ceilings,
                  "no solution" if sim is None else
                  f"simulated peak {sim.peak_bytes / budget:.3f}, time {sim.time:.6g} s")
        if sim is None:
            capacity += step
        elif sim.peak_bytes > budget:
            place = _peak_place(graph, subs, schedule, sim)
            missed = sim.peak_bytes - budget + max(1, budget // 200)
            if place is None:
                capacity -= missed
            else:  # below what this solution uses there, whatever the capacity
                ceilings[place] = model.used(place) - missed
        else:
            if best is None or sim.time < best[1].time:
                best = (schedule, sim)
            if budget - sim.peak_bytes < worth_more:
                break  # a higher capacity would overshoot, and more MIPs buy little
            capacity += budget - sim.peak_bytes
        if capacity <= 0:
            break
    return best


def _peak_place(graph: RematGraph, subs: list[Subgraph], schedule: Schedule,
                sim: Simulation) -> tuple[str, int] | None:
    """Where in the block model ``sim``'s peak lies: ``("fwd", block)`` in the first forward,
    ``("bwd", stage)`` in backward (the stage of the next block backward op; recomputations
    run just before the backward they serve), or ``None`` outside every block."""
    block_of = {i: b for b, sub in enumerate(subs) for i in sub.ops}
    phase, k = sim.peak_at
    if phase == "fwd":
        b = block_of.get(schedule.forward[k])
        return None if b is None else ("fwd", b)
    nf = graph.num_forward
    for i in schedule.backward[k:]:
        if i >= nf and i in block_of:
            return ("bwd", len(subs) - 1 - block_of[i])
    return None
