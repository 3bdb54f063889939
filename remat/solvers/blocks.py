"""The block options of one hierarchy (NOTE [ Hierarchical solving ], step 2): which blocks are
leaves and which are cut into a chain of children, the MIPs that give each leaf (and each small
composed block) its options, the chain DP that composes a block's options from its children's,
and the caches the hierarchies of one solve share.
"""
from __future__ import annotations

import dataclasses
import time

from ..errors import ScheduleError
from ..graph import RematGraph
from ..schedule import Schedule, Simulation
from ..segments import Chain, chain_structure
from ..subgraph import extract_subgraph
from .base import Problem, time_cut
from .chain import solve_chain
from .ilp import _Model
from .options import (BlockOptions, block_options, block_options_many, block_signature,
                      block_structure, option_from_schedule, pareto, repriced_options,
                      sizes_close)
from .progress import SolveProgress
from .upper import assemble, capacity_grid, chain_stages

__all__ = ["BlockContext", "SharedCaches"]

_INNER_SLOTS = 200
# Each leaf block's MIPs (one per grid limit, NOTE [ Block options ]): bounded in nodes, with a
# time limit that only guards against a pathological block.
_LEAF_NODES = 500
_LEAF_TIME_LIMIT = 5.0
# NOTE [ Block MIPs of loops ]: no block's MIP in a hierarchy has more binaries than this. A
# leaf with more is cut in two, as a block with more forward ops than ``leaf_ops`` is, and
# gets no ILP options of its own (that ILP is the one too large); a composed block with more
# gets only the options composed from its children. A GPT's leaves have ~450 binaries and its
# layer's MIP ~720; a Mamba-style scan's leaves ~780 and its composed blocks ~1,380 (1.3 s at
# 50 nodes; without them, the same schedule). A loop's have many more at the same op count
# (an ``LSTMCell`` or GRU step is a dozen tiny ops whose values reach later steps' backward),
# and their MIPs are slow for their size:
# * where the chain could not cut them at ``max_block_ops``, a 64-step ``LSTMCell`` loop had
#   51-op leaves of 3,124-3,143 binaries whose MIPs stopped at the 5 s cap in 13 of 39 solves
#   (7 of 39 even with an 80-node bound): solve 53 s, and a plan that depended on machine load.
#   Cut in two (357-416 binaries), none is capped: 18-20 s, +117.1% vs +116.2% predicted;
# * a GRU encoder's composed blocks of 1,672-2,044 binaries took up to 5.1 s at 50 nodes (the
#   cap): solve 19.6-24.1 s at 50-70%; without their MIPs 7.8-9.9 s, the same schedules.
# The MLP, U-Net, T5-small, ViT, 12-layer GPT and the Mamba-style scan solve to the same
# schedules as with the former bounds (3,000 binaries for composed blocks, none for leaves).
_BLOCK_MAX_BINARIES = 1_200
_MIN_SPLIT_OPS = 16
# Composed blocks within it also get ILP options, on a coarser grid than leaves (each point is
# one MIP solve of a whole transformer layer). Their MIPs are bounded in nodes too, as a node
# bound does not depend on machine load: the save-limited ones end at their root node, the
# peak-limited one may not (a GPT layer's: 1,190 us of recomputation at 10 nodes, 819 at 50,
# 683 at 107; NOTE [ Branching when nodes are few ]).
_MID_BLOCK_GRID = {"save_grid": (0.15, 0.3, 0.5, 0.75), "peak_grid": (), "peak_range_grid": (0.4,),
                   "max_nodes": 50}


@dataclasses.dataclass
class SharedCaches:
    """What the hierarchies of one solve share."""

    # Block options by (use_ilp, mid_ilp), then by block signature (see BlockContext.cache).
    options: dict[tuple[bool, bool], dict[str, BlockOptions]] = dataclasses.field(
        default_factory=dict)
    # Blocks solved, by (use_ilp, mid_ilp), then by structure (see BlockContext.options_of).
    solved: dict[tuple[bool, bool], dict[str, list[tuple[RematGraph, BlockOptions]]]] = \
        dataclasses.field(default_factory=dict)
    # The hierarchies solved so far: (use_ilp, mid_ilp, block_ilp, top-level chain).
    hierarchies: set[tuple] = dataclasses.field(default_factory=set)
    # Every schedule the capacity searches simulated: hierarchies often assemble the same ones.
    simulations: dict[Schedule, Simulation] = dataclasses.field(default_factory=dict)


class BlockContext:
    """Shared state of one hierarchical solve: the option cache keyed by block structure."""

    def __init__(self, use_ilp: bool, problem: Problem, deadline: float, regions: str = "reads",
                 *, mid_ilp: bool = False, bar: "SolveProgress | None" = None,
                 caches: SharedCaches | None = None) -> None:
        opts = problem.options
        self.use_ilp = use_ilp
        self.mid_ilp = use_ilp and mid_ilp
        self.regions = regions
        self.leaf_ops = int(opts.get("leaf_ops", 40))
        self.max_block_ops = int(opts.get("max_block_ops", 120))
        self.option_time_limit = opts.get("option_time_limit")
        self.deadline = deadline
        # Options by block structure. Shared by the hierarchies of one solve that compute them
        # the same way: a transformer layer is the same block under both region rules and in
        # both top levels, and its mid-block MIPs are most of a hierarchy's time (6-layer GPT:
        # 3.9 of 4.9 s), so it is solved once per solve, not once per hierarchy.
        key = (self.use_ilp, self.mid_ilp)
        self.cache: dict[str, BlockOptions] = ({} if caches is None
                                               else caches.options.setdefault(key, {}))
        self.by_structure: dict[str, list[tuple[RematGraph, BlockOptions]]] = (
            {} if caches is None else caches.solved.setdefault(key, {}))
        self.solved = self.reused = self.repriced = 0
        self.bar = bar or SolveProgress(False, 1, problem.time_limit)
        # By block signature: how its options are made (_plan), its children, and options
        # whose MIPs were solved ahead (prefetch).
        self.plans: dict[str, tuple[Chain | None, dict | None]] = {}
        self.parts: dict[str, list] = {}
        self.prefetched: dict[str, BlockOptions] = {}

    def prefetch(self, subs: list[RematGraph], depth: int) -> None:
        """Solve the MIPs of every block :meth:`options_of` will solve for ``subs`` and their
        descendants, all at once (NOTE [ The MIPs of many blocks at once ]). Walks the blocks in
        the order ``options_of`` will, with its rules for reuse, so it solves exactly the blocks
        that would be solved."""
        known = set(self.cache)
        similar = {k: [g for g, _ in v] for k, v in self.by_structure.items()}
        jobs: list[tuple[str, RematGraph, dict]] = []

        def walk(sub: RematGraph, depth: int) -> None:
            sig = block_signature(sub)
            if sig in known:
                return
            known.add(sig)
            group = similar.setdefault(block_structure(sub), [])
            if any(sizes_close(g, sub) for g in group):
                return  # options_of will reprice another block's options
            chain, own = self._plan(sub, sig, depth)
            if chain is not None:
                for part in self._parts(sub, sig):
                    walk(part.graph, depth + 1)
            if own is not None:
                jobs.append((sig, sub, own))
            group.append(sub)  # after its children, as options_of registers it

        for sub in subs:
            walk(sub, depth)
        found = block_options_many([(sub, own) for _, sub, own in jobs], deadline=self.deadline)
        self.prefetched.update((sig, options) for (sig, _, _), options in zip(jobs, found))

    def options_of(self, sub: RematGraph, depth: int) -> BlockOptions:
        sig = block_signature(sub)
        if sig in self.cache:
            self.reused += 1
            return self.cache[sig]
        # NOTE [ Blocks that differ only in size ]: a block wired like one solved before, at
        # close sizes, takes its schedules, priced on its own ops.
        structure = block_structure(sub)
        similar = self.by_structure.setdefault(structure, [])
        model = next((opts for g, opts in similar if sizes_close(g, sub)), None)
        if model is not None:
            self.repriced += 1
            result = self.cache[sig] = repriced_options(sub, model)
            return result
        self.solved += 1
        result = self._solve_block(sub, sig, depth)
        self.cache[sig] = result
        similar.append((sub, result))
        self.bar.block()
        return result

    def _plan(self, sub: RematGraph, sig: str, depth: int) -> tuple[Chain | None, dict | None]:
        """How a block's options are made: the chain of its children (``None``: a leaf) and the
        keyword arguments of :func:`block_options` for its own options (``None``: none)."""
        if sig in self.plans:
            return self.plans[sig]
        small = sub.num_forward <= 2 * self.leaf_ops
        use_ilp = self.use_ilp and small and self.deadline - time.perf_counter() > 1.0
        if self.use_ilp and small and not use_ilp:
            time_cut("block options not computed")
        # A fixed limit, not a share of the time left: the node bound ends these MIPs, and the
        # limit is only a safety net (NOTE [ Work bounds and the time cap ]).
        limit = self.option_time_limit or _LEAF_TIME_LIMIT
        plan: tuple[Chain | None, dict | None] = (
            None, {"time_limit": limit, "use_ilp": use_ilp, "max_nodes": _LEAF_NODES})
        chain = None
        if sub.num_forward > self.leaf_ops and depth < 6:
            chain = chain_structure(sub, max_block_ops=max(self.leaf_ops, self.max_block_ops // 2),
                                    regions=self.regions)
        if (use_ilp and depth < 6 and (chain is None or len(chain.segments) == 1)
                and sub.num_forward >= _MIN_SPLIT_OPS
                and _Model(sub, 0).num_variables > _BLOCK_MAX_BINARIES):
            # NOTE [ Block MIPs of loops ]: its own ILP options are then refused for their size
            chain = chain_structure(sub, max_block_ops=sub.num_forward // 2, regions=self.regions)
        if chain is not None and len(chain.segments) > 1:
            # Mid-sized blocks (a transformer layer) also get the exact ILP's options: the
            # composition of its children's options misses trade-offs across them (keep the
            # first linear's output, recompute the activation after it): 1-2 layer GPTs at
            # 80%, +7.6% step time from composed options alone vs +3.7% exact.
            plan = (chain, {"time_limit": limit, "use_ilp": True,
                            "max_variables": _BLOCK_MAX_BINARIES, **_MID_BLOCK_GRID}
                    if use_ilp and self.mid_ilp else None)
        self.plans[sig] = plan
        return plan

    def _parts(self, sub: RematGraph, sig: str) -> list:
        """The children of a composed block (its plan's chain cut out of it), made once."""
        if sig not in self.parts:
            chain = self.plans[sig][0]
            self.parts[sig] = [extract_subgraph(sub, seg, reg)
                               for seg, reg in zip(chain.segments, chain.regions)]
        return self.parts[sig]

    def _solve_block(self, sub: RematGraph, sig: str, depth: int) -> BlockOptions:
        chain, own = self._plan(sub, sig, depth)
        exact = self.prefetched.pop(sig, None)
        if chain is None:
            return exact or block_options(sub, deadline=self.deadline, **own)
        composed = self._compose(sub, self._parts(sub, sig), chain, depth)
        if own is None:
            return composed
        exact = exact or block_options(sub, deadline=self.deadline, **own)
        return dataclasses.replace(composed, options=pareto([*composed.options, *exact.options]))

    def _compose(self, sub: RematGraph, parts: list, chain: Chain, depth: int) -> BlockOptions:
        """Options of a block from the chain DP over its children, at a grid of capacities."""
        child = [self.options_of(p.graph, depth + 1) for p in parts]
        leaf = block_options(sub, use_ilp=False)  # keep-all / keep-nothing for reference
        ceiling = max(o.backward_peak for o in leaf.options) + max(o.forward_peak for o in leaf.options)
        table = solve_chain(chain_stages(chain, child), chain.cut_bytes[-1], ceiling, slots=_INNER_SLOTS)
        candidates = list(leaf.options)
        seen: set[tuple] = set()
        for slot in capacity_grid(table):
            try:
                schedule = assemble(sub, parts, child, table.actions(slot))
            except (ScheduleError, ValueError):
                continue
            key = (schedule.saved, schedule.backward)
            if key not in seen:
                seen.add(key)
                candidates.append(option_from_schedule(sub, f"dp@{slot}", schedule))
        return BlockOptions(
            options=pareto(candidates),
            forward_time=leaf.forward_time,
            nosave_forward=leaf.nosave_forward,
            nosave_time=leaf.nosave_time,
            nosave_peak=leaf.nosave_peak,
        )
