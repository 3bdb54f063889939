"""Plans that bind to sizes: one captured graph, a few schedules, the right one for each batch.

NOTE [ Shape-generic plans ]
A schedule is structural: which values are kept, which ops are recomputed, in what order. The
joint graph of a training step captured with dynamic dimensions (NOTE [ Dynamic shapes ]) has the
same structure for every batch size and sequence length; only the byte sizes, which are
expressions of a few size symbols, and the op times change. So a :class:`ShapePlans` keeps, per
graph *structure* (a :class:`Family`), the graph profiled once and every schedule solved for it,
and for a batch of new sizes:

1. re-prices every schedule at those sizes with the simulator (memory exact from the size
   expressions; each op's time scaled from the profiled one by the bytes it touches), plus the
   unmodified step, and runs the fastest that fits the byte budget;
2. solves again only when none fits but some schedule could (the sizes' lower bound is under the
   budget), and then for the sizes' *bucket* (every size rounded up to a power of two) widened to
   every bucket solved for before, so that one solve serves every smaller batch seen or to come
   and a run sees O(log(max/min)) solves;
3. when no schedule can fit (the lower bound itself is over the budget), runs the lowest-peak
   schedule it has and says so once, with the numbers.

Only the graph a dynamo specialisation changes (a size of 1 is traced as a constant) forms a new
family, which is profiled and solved on its own.
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Sequence

from .budget import Budget, Reference, format_bytes
from .errors import InfeasibleBudgetError
from .graph import RematGraph
from .liveness import peak_lower_bound
from .plan import Plan
from .schedule import Schedule, Simulation, save_all_schedule, simulate
from .sized_graph import SizedGraph, bucket

__all__ = ["Family", "ShapePlans"]

log = logging.getLogger(__name__)

# Headroom for a schedule re-priced at sizes other than the profiled ones: op scratch memory is
# measured at the profiled sizes and scaled by the bytes an op touches, which is close but not
# exact (measured on a tiny GPT-2: up to 5 KiB, 0.03%, above the prediction at other lengths).
_REPRICE_HEADROOM = 0.01

# The eager step's peak over the compiled unmodified step's, at sizes other than the example's,
# varies around the ratio measured at the example: on a 2-layer GPT-2, 0.98-1.13 against 1.03-1.08
# at the example (NOTE [ The unmodified step runs eagerly ]).
_EAGER_HEADROOM = 0.15

# NOTE [ A schedule in use is worth a little time ]
# Every schedule a run uses is one more compile of the whole step (dynamo and AOTAutograd trace
# it again: ~0.8 of the first setup on a 2-layer GPT-2), while schedules solved for neighbouring
# sizes are predicted within a percent of each other there (the bucket (4, 512)'s schedule and
# (2, 487)'s at (8, 488): 232.4 vs 234.1 ms). A batch runs the fastest schedule that fits unless
# one already in use (chosen for other sizes, or the unmodified step run eagerly) fits and is
# predicted at most _IN_USE_MARGIN slower: well inside the cost model's own error (predicted
# overheads are within ~5 points of the measured ones), and it saves a compile.
_IN_USE_MARGIN = 0.01


@dataclass
class Entry:
    """One schedule of a family, with the plan it was solved with (``None`` for the unmodified
    step and the least-memory fallback, which are never solved)."""

    family: str
    schedule: Schedule
    plan: Plan | None
    label: str
    graph: RematGraph | None = None  # the graph it was solved on (for inspection)
    eager: bool = False  # NOTE [ The unmodified step runs eagerly ]
    fallback: bool = False  # the least-memory schedule (NOTE [ An over-budget choice is revisited ])


@dataclass
class Family:
    """Every schedule solved for one graph structure (see NOTE [ Shape-generic plans ])."""

    key: str
    sized: SizedGraph
    budget_bytes: int  # the budget the family was first solved with
    # Never less than this (NOTE [ Budgets over many sizes ]): a specialisation (a size of 1)
    # is solved for the run's budget in bytes, not for a share of its own smaller peak.
    floor_bytes: int = 0
    max_baseline: int = 0  # largest unmodified-step peak seen (NOTE [ Budgets over many sizes ])
    input_dims: tuple[tuple[int, int] | None, ...] = ()  # per symbol: (input leaf, dimension)
    dim_names: tuple[str | None, ...] = ()  # per symbol: ``input_ids[1]`` (NOTE [ Naming sizes ])
    # per input leaf: its shape with None where symbolic (NOTE [ A graph serves the sizes it did
    # not fix ] in remat/symbolic.py); () where unknown
    fixed_dims: tuple[tuple[int | None, ...] | None, ...] = ()
    entries: list[int] = field(default_factory=list)  # indices into ShapePlans.entries
    solved_at: set[tuple[int, ...]] = field(default_factory=set)
    envelope: tuple[int, ...] = ()  # componentwise max of the sizes solved for

    def __post_init__(self) -> None:
        if not self.envelope:
            self.envelope = tuple(self.sized.sizes)

    def sizes_of(self, leaves: Sequence[object], *, strict: bool = True
                 ) -> tuple[int, ...] | None:
        """The symbol values of a call whose flattened inputs are ``leaves`` (``None`` when a
        symbol is not a dimension of an input tensor, or the call differs in a size the graph
        fixed; not ``strict``: in a size it fixed at 1. NOTE [ A graph serves the sizes it did
        not fix ] in remat/symbolic.py)."""
        import torch

        if self.fixed_dims:
            if len(leaves) != len(self.fixed_dims):
                return None
            for leaf, shape in zip(leaves, self.fixed_dims):
                if shape is None:
                    continue
                if not isinstance(leaf, torch.Tensor) or leaf.dim() != len(shape) or any(
                        f is not None and f != n and (strict or f == 1)
                        for f, n in zip(shape, leaf.shape)):
                    return None
        sizes = []
        for where in self.input_dims:
            if where is None or where[0] >= len(leaves):
                return None
            leaf = leaves[where[0]]
            if not isinstance(leaf, torch.Tensor) or where[1] >= leaf.dim():
                return None
            sizes.append(int(leaf.shape[where[1]]))
        return tuple(sizes)


@dataclass(frozen=True)
class Choice:
    """The schedule a batch of given sizes runs, and what it is predicted to cost there."""

    entry: int
    sizes: tuple[int, ...]
    peak_bytes: int
    time: float
    fits: bool
    fallback: bool = False  # the least-memory schedule, run as no solved one fits

    @property
    def settled(self) -> bool:
        """Whether the choice is final (NOTE [ An over-budget choice is revisited ])."""
        return self.fits and not self.fallback


class ShapePlans:
    """The schedules of one rematerialized module, and which one each batch size runs.

    Args:
        budget: The user's budget. Bytes hold for every size; a fraction applies to the largest
            unmodified-step peak seen so far (NOTE [ Budgets over many sizes ]).
        solver, time_limit, options: How to solve a new bucket (as for :func:`remat.rematerialize`).
    """

    def __init__(self, budget: Budget, *, solver: str, time_limit: float,
                 options: dict | None = None) -> None:
        self.budget = budget
        self.solver = solver
        self.time_limit = time_limit
        self.options = dict(options or {})
        self.families: dict[str, Family] = {}
        self.entries: list[Entry] = []
        self.choices: dict[tuple, Choice] = {}  # (family, sizes) -> choice
        # Entries some batch runs, and the unmodified steps that run eagerly (no compile).
        self.in_use: set[int] = set()
        self._warned: set[str] = set()
        # Unsettled choices: (entries, the family's largest baseline) when made (NOTE [ An over-budget choice
        # is revisited ]).
        self._over: dict[tuple, tuple[int, int]] = {}
        # What the user measures, set with the first graph (NOTE [ A budget is what the user
        # measures ]); None: budgets apply to the compiled step's own peak.
        self.reference: Reference | None = None

    # ---- building --------------------------------------------------------------------------
    def add_family(self, key: str, sized: SizedGraph, schedule: Schedule, plan: Plan,
                   input_dims: Sequence[tuple[int, int] | None] = (),
                   dim_names: Sequence[str | None] = (),
                   fixed_dims: Sequence[tuple[int | None, ...] | None] = ()) -> int:
        """Register a freshly solved graph; returns the entry index of its schedule.

        ``input_dims`` and ``dim_names`` give, per size symbol, the input dimension it is
        (``(leaf index, axis)``) and its name (``"input_ids[1]"``), ``None`` where unknown;
        ``fixed_dims`` per input leaf the sizes the graph fixed (:func:`remat.symbolic.fixed_dims`).
        """
        # Solved against the measured eager step, a family's budget follows its own sizes; a
        # specialisation solved without it (``reference=None``: the run's bytes) keeps those.
        floor = 0 if self.reference is not None and plan.eager_bytes else plan.budget_bytes
        family = Family(key, sized, plan.budget_bytes, floor, plan.baseline_bytes,
                        tuple(input_dims), tuple(dim_names), tuple(fixed_dims))
        self.families[key] = family
        family.solved_at.add(sized.sizes)
        first = self._add(family, schedule, plan, f"solved at {self.describe(family, sized.sizes)}",
                          sized.graph)
        # NOTE [ The unmodified step runs eagerly ] where the eager step's peak can be priced.
        eager = self.reference is not None
        unmodified = self._add(family, save_all_schedule(sized.graph), None,
                               "unmodified step" + (", run eagerly" if eager else ""), eager=eager)
        self.in_use.update((first, unmodified) if eager else (first,))
        self.choices[(key, sized.sizes)] = Choice(
            first, sized.sizes, plan.predicted_peak_bytes,
            plan.baseline_time_s * (1 + plan.predicted_overhead),
            plan.predicted_peak_bytes <= plan.budget_bytes)
        return first

    def _add(self, family: Family, schedule: Schedule, plan: Plan | None, label: str,
             graph: RematGraph | None = None, *, eager: bool = False,
             fallback: bool = False) -> int:
        self.entries.append(Entry(family.key, schedule, plan, label, graph, eager, fallback))
        family.entries.append(len(self.entries) - 1)
        return len(self.entries) - 1

    def family_for(self, leaves: Sequence[object]) -> tuple[Family, tuple[int, ...]] | None:
        """The first family captured with dynamic dimensions that serves a call with these
        inputs, and its sizes there: one whose every fixed size matches, else one whose sizes
        fixed at 1 do; ``None`` if none does (NOTE [ A graph serves the sizes it did not fix ]
        in remat/symbolic.py)."""
        dynamic = [f for f in self.families.values() if f.sized.symbols]
        for strict in (True, False):
            for family in dynamic:
                sizes = family.sizes_of(leaves, strict=strict)
                if sizes is not None:
                    return family, sizes
        return None

    @property
    def serving(self) -> Family | None:
        """The family whose schedules every batch is chosen from: the first captured with
        dynamic dimensions, else the first (static shapes: NOTE [ Static first ] in
        remat/module.py); ``None`` before any capture."""
        families = list(self.families.values())
        return next((f for f in families if f.sized.symbols), families[0] if families else None)

    @staticmethod
    def describe(family: Family, sizes: Sequence[int]) -> str:
        """Sizes as a person reads them (NOTE [ Naming sizes ]): ``input_ids[0]=8,
        input_ids[1]=212``, or ``size s52=4`` for a symbol no input is known to have."""
        if not family.sized.symbols:
            return "static shapes"
        names = family.dim_names
        return ", ".join(f"{names[i] if i < len(names) and names[i] else 'size ' + s}={v}"
                         for i, (s, v) in enumerate(zip(family.sized.symbols, sizes)))

    @property
    def plans(self) -> list[Plan]:
        """Every plan solved so far, in order."""
        return [e.plan for e in self.entries if e.plan is not None]

    @property
    def graphs(self) -> list[RematGraph]:
        """The graph each plan of :attr:`plans` was solved on."""
        return [e.graph for e in self.entries if e.plan is not None]

    # ---- choosing --------------------------------------------------------------------------
    def price(self, family: Family, entry: int, sizes: Sequence[int]) -> Simulation:
        return simulate(family.sized.at(sizes), self.entries[entry].schedule)

    def run_price(self, family: Family, entry: int, sizes: Sequence[int]) -> Simulation:
        """:meth:`price` of the step as it runs: the eager step's peak is the simulated
        unmodified peak scaled as NOTE [ The unmodified step runs eagerly ] says."""
        sim = self.price(family, entry, sizes)
        if not self.entries[entry].eager or self.reference is None:
            return sim
        return replace(sim, peak_bytes=self.eager_peak(sim.peak_bytes))

    def eager_peak(self, unmodified_bytes: int) -> int:
        """The eager step's peak priced from a compiled unmodified step's, ``unmodified_bytes``
        (NOTE [ The unmodified step runs eagerly ]), with :attr:`reference`.

        Where eager was the leaner at the example, the ratio applies below the example's peak
        only: what makes a compiled step fatter (a buffer it keeps) may not grow with the
        batch, so a smaller batch's ratio is nearer 1 than the example's from below but a
        larger one's could be above it; the headroom covers the rest."""
        ref = self.reference
        ratio = ref.eager_bytes / max(ref.compiled_bytes, 1)
        if unmodified_bytes > ref.compiled_bytes:
            ratio = max(1.0, ratio)
        return math.ceil(unmodified_bytes * ratio * (1 + _EAGER_HEADROOM))

    def run_eagerly(self, key: str, sizes: Sequence[int]) -> int:
        """Make the eager step the choice of a family just added for the batch of ``sizes`` it
        was captured at (NOTE [ A specialisation the eager step fits ] in
        remat/dynamo_backend.py); returns its entry."""
        family = self.families[key]
        sizes = tuple(int(s) for s in sizes)
        entry = family.entries[1]
        sim = self.run_price(family, entry, sizes)
        self.choices[(key, sizes)] = Choice(entry, sizes, sim.peak_bytes, sim.time, True)
        self.in_use.add(entry)
        return entry

    def baseline_at(self, family: Family, sizes: Sequence[int]) -> int:
        """Peak of the unmodified step at ``sizes``."""
        return self.price(family, family.entries[1], sizes).peak_bytes

    def budget_at(self, family: Family, sizes: Sequence[int]) -> int:
        """The bytes a schedule may peak at for a batch of ``sizes``.

        NOTE [ Budgets over many sizes ]
        A byte budget is a memory limit and holds for every size (less the memory outside the
        module at these sizes). A fraction is a promise about the run's peak, which its largest
        batch sets: it applies to the largest unmodified-step peak seen so far for this graph
        (the example batch's, then any larger batch's), so ``"50%"`` halves the run's peak
        whatever order the batches come in, and a small batch is not squeezed to half of its
        own, already small, peak. What the step adds outside the module is charged (or, for a
        step leaner than the module, credited) at the batch's own sizes: a credit measured at
        the largest batch, given to a smaller one, let a Hugging Face fine-tune's steps reach
        0.527 of the run's peak at "50%".
        """
        baseline = self.baseline_at(family, sizes)
        if self.budget.bytes is not None:
            return self.budget.resolve(baseline, self.reference)
        family.max_baseline = max(family.max_baseline, baseline)
        return max(family.floor_bytes,
                   self.budget.resolve(baseline, self.reference, of_bytes=family.max_baseline))

    def _fraction_budget(self, family: Family) -> int:
        return max(family.budget_bytes, self.budget.resolve(family.max_baseline, self.reference))

    def new_family_budget(self, baseline_bytes: int) -> int | None:
        """The budget in bytes of a new specialisation of the module (a graph dynamo traced
        anew: a size of 1, a loop unrolled at another length) whose unmodified step peaks at
        ``baseline_bytes``; ``None`` before the first graph.

        NOTE [ Budgets over many sizes ] holds across specialisations too: bytes are the run's
        bytes; a fraction is of the run's largest step, so a smaller specialisation gets the
        run's budget in bytes (not a share of its own smaller peak) and a larger one, which is
        the run's largest step now, its own share where that is more. HF Mamba's scan, which
        dynamo unrolls at each sequence length, ran T=48 after a T=32 example at 1.056x its
        eager peak at "60%" with T=32's bytes, below what any schedule reaches at T=48."""
        if not self.families:
            return None
        if self.budget.bytes is not None:
            return max(f.budget_bytes for f in self.families.values())
        return max(self.budget.resolve(baseline_bytes, self.reference),
                   *(self._fraction_budget(f) for f in self.families.values()))

    def choose(self, key: str, sizes: Sequence[int]) -> Choice:
        """The schedule for a batch of ``sizes`` (solving one if needed)."""
        sizes = tuple(int(s) for s in sizes)
        found = self.choices.get((key, sizes))
        family = self.families[key]
        if found is not None and (found.settled or not self._may_fit_now(family, sizes)):
            return found
        budget_bytes = self.budget_at(family, sizes)
        priced = [(self.run_price(family, e, sizes), e) for e in family.entries]
        fitting = [(sim.time, e, sim) for sim, e in priced
                   if self._fits(family, sizes, sim.peak_bytes, budget_bytes)]
        if fitting:
            def rank(t: tuple) -> tuple:
                # At equal time (a solved schedule that recomputes nothing) the eager step
                # wins: the compiled unmodified step can need more memory than eager's.
                return t[0], not self.entries[t[1]].eager, t[1]

            _, entry, sim = min(fitting, key=rank)
            # NOTE [ A schedule in use is worth a little time ]
            in_use = [f for f in fitting if f[1] in self.in_use]
            if in_use:
                best_used = min(in_use, key=rank)
                if best_used[0] <= sim.time * (1 + _IN_USE_MARGIN):
                    _, entry, sim = best_used
            choice = Choice(entry, sizes, sim.peak_bytes, sim.time, True,
                            self.entries[entry].fallback)
        if not fitting or (choice.fallback and self._top(family, sizes) not in family.solved_at):
            choice = self._solve_for(family, sizes, budget_bytes, priced)
        self.choices[(key, sizes)] = choice
        self.in_use.add(choice.entry)
        if not choice.settled:
            self._over[(key, sizes)] = (len(self.entries), family.max_baseline)
        return choice

    def to_compile(self, key: str, sizes: Sequence[int]) -> int:
        """NOTE [ A capture compiles a schedule that needs one ]
        The schedule a new capture of a family compiles for a call of ``sizes``: the one
        :meth:`choose` gives, unless that is the unmodified step run eagerly, which needs no
        compile; then the family's first solved schedule that fits those sizes, which runs
        this call and every later batch choosing it. Otherwise the capture served only the
        batches of those exact shapes (NOTE [ A call runs what its first call ran ] in
        remat/module.py) and the first batch needing the solved schedule captured the step
        again: the dynamic capture that follows a static one (NOTE [ Static first ]) met a short
        batch first in the 40-step dynamic-padding run, and that run spent one more capture
        (2.7 s of a 2-layer GPT-2's) than one captured dynamic from the start."""
        sizes = tuple(int(s) for s in sizes)
        choice = self.choose(key, sizes)
        if not self.entries[choice.entry].eager:
            return choice.entry
        family = self.families[key]
        budget_bytes = self.budget_at(family, sizes)
        for entry in family.entries:
            if self.entries[entry].eager or self.entries[entry].fallback:
                continue
            sim = self.run_price(family, entry, sizes)
            if self._fits(family, sizes, sim.peak_bytes, budget_bytes):
                self.choices[(key, sizes)] = Choice(entry, sizes, sim.peak_bytes, sim.time, True)
                self.in_use.add(entry)
                return entry
        return choice.entry

    def _may_fit_now(self, family: Family, sizes: tuple[int, ...]) -> bool:
        """NOTE [ An over-budget choice is revisited ]
        Sizes no solved schedule fits run the lowest-peak one, often the least-memory schedule
        (recompute every value on demand), which can be many times slower than the step
        (1.8-46x eager's time, ~9x typical, in the issue that found it). That choice was kept
        for good, and later sizes the least-memory schedule fitted ran it too, without a solve
        of their own and without a word. Now a batch the least-memory schedule fits is still
        solved for at its bucket, the warning gives the predicted slowdown, and such a choice
        is made again once the run has a schedule it has not priced, or a larger budget (a
        fraction grows with the run's largest batch): one comparison per call of those sizes
        until then."""
        seen = self._over.get((family.key, sizes))
        if seen is None:
            return False
        # A budget at fixed sizes grows only with the run's largest batch (a fraction): compared
        # by that, not re-priced, so an unsettled batch costs no simulation per call.
        count, largest = seen
        return len(self.entries) > count or family.max_baseline > largest

    @staticmethod
    def _fits(family: Family, sizes: tuple[int, ...], peak: int, budget_bytes: int) -> bool:
        if sizes == family.sized.sizes:
            return peak <= budget_bytes  # the profiled sizes: the simulator is exact there
        return peak * (1 + _REPRICE_HEADROOM) <= budget_bytes

    def _solve_for(self, family: Family, sizes: tuple[int, ...], budget_bytes: int,
                   priced: list) -> Choice:
        """Solve for a batch of ``sizes`` that no schedule fits yet.

        NOTE [ A bucket solved for its batch ]
        A new batch is solved at its bucket (its sizes rounded up to powers of two, and widened
        to every bucket before), so one solve covers the sizes that follow. Under a fraction the
        bucket is solved for the same share of its own peak, and its schedule, re-priced at the
        batch that asked, can miss that batch's share: peaks of a schedule and of the unmodified
        step do not scale alike (attention's scores grow with the square of the length, most
        else linearly). Which schedules miss depends on the solver's pick among near-equal ones:
        a 2-layer GPT at "65%" over lengths 16-64 made 1, 2, 3 or 4 solves in runs of one
        recipe, each new longest batch solved at its own sizes. So a bucket schedule that misses
        is solved once more at the bucket, tightened by the share it missed by: it then fits the
        batch that asked and, tighter than the bucket needs, the sizes between them. Only if that
        misses too are the batch's own sizes solved.
        """
        from .planner import crawls, least_memory_schedule

        graph = family.sized.at(sizes)
        lower = peak_lower_bound(graph)
        if lower <= budget_bytes:
            # The bucket, widened to every bucket solved for before (the envelope): each solve
            # then covers all sizes seen so far, and solves grow the envelope by powers of two.
            top = self._top(family, sizes)
            for target in dict.fromkeys((top, sizes)):  # the bucket first, then these sizes
                if target in family.solved_at:
                    continue
                # A fraction solves the bucket for the same share of its own peak.
                target_bytes = budget_bytes if self.budget.bytes is not None or target == sizes \
                    else max(budget_bytes, self.budget.resolve(self.baseline_at(family, target),
                                                               self.reference))
                # Solved with the re-pricing headroom, so that it fits where it is re-priced.
                target_bytes = int(target_bytes / (1 + _REPRICE_HEADROOM))
                for _ in range(1 + (target != sizes)):  # NOTE [ A bucket solved for its batch ]
                    entry = self._solve_at(family, target, target_bytes, sizes)
                    if entry is None:
                        break
                    sim = self.price(family, entry, sizes)
                    if self._fits(family, sizes, sim.peak_bytes, budget_bytes):
                        return Choice(entry, sizes, sim.peak_bytes, sim.time, True)
                    priced.append((sim, entry))
                    target_bytes = int(target_bytes * budget_bytes
                                       / (sim.peak_bytes * (1 + _REPRICE_HEADROOM)))
        # Nothing fits: the lowest peak we have, or the least-memory fallback if it is lower.
        fallback, sim_fb = least_memory_schedule(graph)
        best_sim, best = min(priced, key=lambda t: (t[0].peak_bytes, t[0].time))
        unmodified = self.price(family, family.entries[1], sizes).time
        if sim_fb.peak_bytes < best_sim.peak_bytes:
            best = self._add(family, fallback, None, "least memory (recompute on demand)",
                             fallback=True)
            best_sim = self.price(family, best, sizes)
            if crawls(best_sim.time, unmodified):  # NOTE [ The fastest at the lowest peak ]
                solved = self._solve_at(family, sizes, best_sim.peak_bytes, sizes)
                if solved is not None:
                    sim = self.price(family, solved, sizes)
                    if sim.peak_bytes <= best_sim.peak_bytes and sim.time < best_sim.time:
                        best, best_sim = solved, sim
        fits = self._fits(family, sizes, best_sim.peak_bytes, budget_bytes)
        choice = Choice(best, sizes, best_sim.peak_bytes, best_sim.time, fits,
                        self.entries[best].fallback)
        where = self.describe(family, sizes)
        if not choice.settled and where not in self._warned:
            self._warned.add(where)
            slower = best_sim.time / unmodified if unmodified > 0 else float("nan")
            words = self._budget_words(family, sizes, budget_bytes)
            why = (f"no solved schedule fits the budget {words} for sizes {where}" if fits else
                   f"no schedule fits the budget {words} for sizes {where} (no schedule can go "
                   f"below {format_bytes(lower)} there)")
            warnings.warn(
                f"remat: {why}; running the lowest-peak schedule found, "
                f"{format_bytes(best_sim.peak_bytes)}, predicted at {slower:.1f}x the "
                "unmodified step's time at these sizes. It is chosen again if a later "
                "schedule or a larger budget fits. Use a smaller batch or a larger budget for "
                "these sizes.",
                stacklevel=4,
            )
        return choice

    def _budget_words(self, family: Family, sizes: tuple[int, ...], budget_bytes: int) -> str:
        """The budget as the user set it, for the whole step, and what it leaves the module at
        ``sizes`` where the rest of the step adds or gives back memory (a warning quoted 7.19 MiB
        for a "4MiB" budget, the module's share after a credit, as if it were the budget)."""
        ref = self.reference
        outside = round(ref.at(self.baseline_at(family, sizes))[1]) if ref is not None else 0
        if abs(outside) < 1024:
            return format_bytes(budget_bytes)
        verb = "adds" if outside > 0 else "gives back"
        return (f"{format_bytes(budget_bytes + outside)} for the step ({format_bytes(budget_bytes)}"
                f" for this module: the rest of the step {verb} {format_bytes(abs(outside))} at "
                "these sizes)")

    @staticmethod
    def _top(family: Family, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The bucket ``sizes`` are solved at: rounded up to powers of two, widened to every
        bucket solved before (NOTE [ A bucket solved for its batch ])."""
        return tuple(max(b, s, e) for b, s, e in zip(bucket(sizes), sizes, family.envelope))

    def _solve_at(self, family: Family, target: tuple[int, ...], target_bytes: int,
                  sizes: tuple[int, ...]) -> int | None:
        """Solve ``family`` at the sizes ``target`` within ``target_bytes``, for a batch of
        ``sizes``; the new entry, or ``None`` where no schedule fits there."""
        from .planner import plan_graph

        at = family.sized.at(target)
        if peak_lower_bound(at) > target_bytes:
            return None
        family.solved_at.add(target)
        budget = Budget(bytes=target_bytes, text=format_bytes(target_bytes))
        try:
            plan, schedule = plan_graph(at, budget, solver=self.solver,
                                        time_limit=self.time_limit, options=self.options)
        except InfeasibleBudgetError as exc:
            log.debug("remat: no schedule at %s: %s", target, exc)
            return None
        family.envelope = tuple(max(e, t) for e, t in zip(family.envelope, target))
        where = self.describe(family, target)
        plan = replace(plan, detail=(plan.detail + "; " if plan.detail else "") +
                       f"solved for sizes {where}")
        log.info("remat: solved a schedule for %s (bucket of %s)", where,
                 self.describe(family, sizes))
        return self._add(family, schedule, plan, f"solved at {where}", at)

    def summary(self) -> str:
        """Every batch size seen: which schedule it ran and its predicted peak.

        Schedules are numbered from 1 here (``entries[0]`` is schedule 1), as everything shown
        to a person is; sizes are named as :meth:`describe` names them.

        Example:
            >>> print(net.shapes.summary())  # doctest: +SKIP
            input_ids[0]=2, input_ids[1]=40   schedule 2 (unmodified step, run eagerly): 3.9 MiB
            input_ids[0]=4, input_ids[1]=128  schedule 1 (solved at input_ids[0]=4, ...): 9.3 MiB
        """
        rows = [(self.describe(self.families[key], sizes), c)
                for (key, sizes), c in sorted(self.choices.items(), key=lambda kv: kv[0][1])]
        width = max((len(where) for where, _ in rows), default=0)
        return "\n".join(f"{where:<{width}}  schedule {c.entry + 1} "
                         f"({self.entries[c.entry].label}): {format_bytes(c.peak_bytes)}"
                         + ("" if c.fits else "  [over budget]") for where, c in rows)
