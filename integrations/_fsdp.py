"""HiRemate under FSDP2 (``torch.distributed.fsdp.fully_shard``): every FSDP unit rematerialized,
one budget for the whole step on each rank. Framework-free (torch only); the Lightning callback
drives it under ``ModelParallelStrategy``.

NOTE [ Remat inside an FSDP unit ]
    ``fully_shard`` puts hooks on a unit's call: all-gather its parameters before forward,
    reshard after, all-gather again before backward, reduce-scatter the gradients after. Dynamo
    does not trace those hooks (capturing a sharded unit fails with "Attempted to call function
    marked as skipped"), so remat captures the unit's own forward, between them: with the unit's
    parameters gathered (``unit.unshard()``), a view that shares the unit's submodule, parameter
    and buffer dicts and calls its class's ``forward`` (:class:`UnitForward`) is
    rematerialized, and the result is installed as the unit's ``forward``. FSDP's hooks keep
    running around it, in the same order and number (a 4-layer Llama: 9 all-gathers and 5
    reduce-scatters per step, with and without remat); a recomputation in backward runs after
    the pre-backward all-gather, on the gathered parameters; the graph sees plain tensors, never
    DTensors. Nothing is replaced in the module tree: state_dict keys, distributed checkpoints
    and the optimizer's parameters stay FSDP's. On 2 CPU ranks with gloo the losses and
    gradients are bitwise those of FSDP2 without remat.

NOTE [ One step budget over FSDP units ]
    The budget is of the whole step on each rank, as the warmup measures it, not of each unit:
    70% of every unit's own step gave 0.74-0.81 of the whole step, 55-60% gave 0.43-0.48. The
    step's peak is predicted from what each unit's plan saves and peaks at (NOTE [ The step's
    peak over a chain of units ] in ``integrations/_fsdp_peak.py``). Every unit is planned at
    one fraction ``f`` of its own eager step, the largest whose predicted step fits the budget
    (bisection; units with the same graph are solved once per fraction): the least
    recomputation under an even cut. A unit's
    own schedule cannot go below about half of its own step (its inputs, outputs and
    gradients), so on its own that stops near 0.64 of a 4-layer Llama's step; the upper level's
    other choice is to keep only a unit's inputs and run its forward again in backward
    (``torch.utils.checkpoint`` around the rematerialized unit, RNG state preserved: bitwise),
    which holds its inputs alone and needs its own peak while it runs. The first ``k`` units
    are checkpointed (their saved values are held longest) and every unit is planned at the
    largest fraction that fits with them, ``k`` being the count whose plan is predicted fastest
    (NOTE [ Checkpointing more units can be faster ]): HiRemate's upper level reduced to two
    numbers per chain. The plans are then checked on a measured step (:func:`plan_units`'
    ``trial``); a step over the budget plans again with the model calibrated on that step, at
    most ``_ROUNDS`` times.

NOTE [ Checkpointing more units can be faster ]
    The fewest checkpointed units is not the fastest plan: to fit with fewer, every unit's own
    schedule goes deeper, and a 4-layer Llama at 50%/53%/60% of its step ran 1.27-1.34x FSDP2's
    step time (3 or 2 units checkpointed, every unit at 55% of its own step) where
    ``checkpoint_wrapper`` on every unit ran 1.22-1.26x (at a higher peak, 0.53-0.58). So every
    count is searched (its largest fitting fraction, 1.0 first: no remat inside the units; the
    search solver takes 0.04 s a plan), and the plan with the least predicted time wins: the
    units' predicted step times plus one more forward per checkpointed unit, from the probes'
    modelled op times. Measured since (two quiet runs): the Llama at 60% checkpoints every unit
    with no remat inside, at checkpoint_wrapper's peak or lower, 1.15-1.25x against its
    1.18-1.30x; an HF GPT-2 takes the same plan at the same peak and ran 1-8% slower than it.

NOTE [ Buffers gloo's workers release late ]
    On CPU, FSDP2's collectives run on gloo, whose worker threads hold each collective's work
    (and so its buffers: a unit's all-gathered parameters, the clone of its unsharded gradients
    that a reduce-scatter reduces) until they drop it after the collective completes. When the
    calling thread lets go of a buffer first, it is freed where and when the worker drops the
    work: at once on an idle machine, a few milliseconds later when the worker waits for a core.
    First, that free is missing from the profiler's record, so a step seemed to keep the buffer
    to its end: identical steps read 6.84-8.42 MB on a 4-layer Llama, 0.79 MB (one unit's
    unsharded parameters) apart. ``track_memory`` now puts those frees back (NOTE [ Frees in
    other threads ] in ``remat/memory.py``) and identical steps read the same on an idle
    machine. Second, beside a busy neighbour the buffer really lives on while the next unit's
    backward allocates: one step in a few dozen measured one such buffer above the rest (7.50
    then 8.29 MB). So on CPU the trial step must fit with the largest FSDP module's own
    unsharded parameters to spare (:func:`late_release_bytes`: a Llama's root, embedding and
    head, 1.0 MB). On CUDA the allocator's counters see a free in any thread; whether NCCL
    holds buffers late is not measured yet (no GPU here), and no headroom is kept there.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import remat
from remat import RematModule
from remat.budget import NO_LIMIT, format_bytes
from remat.cache import PlanCache, costs_key
from remat.errors import RematError
from remat.graph import Phase

from integrations._fsdp_peak import (StepModel, StepPhases, activation_bytes, gradient_bytes,
                                     step_phases)
from integrations._remat_shared import Collectives, RematSettings, Target, TargetResult
from integrations._warmup import record_first_calls

__all__ = ["StepShare", "UnitForward", "UnitPlans", "Unplannable", "fsdp2_line", "fsdp2_miss",
           "fsdp_units", "install", "late_release_bytes", "plan_units", "rematerialize_fsdp2",
           "share_step_budget", "uninstall", "units_to_plan"]

# Halvings of the fraction interval: 1/128 of the eager step is finer than the solvers' own
# granularity on a unit (a few values), and each halving solves every distinct unit once.
_BISECTIONS = 7
# The search prices each fraction with the chain DP: on a Llama layer it gives the hierarchical
# solver's peak and saved bytes (within 3%) in 0.04 s instead of 1.2 s, and a search solves a
# few dozen fractions. The units' plans are then solved with the user's solver, and the trial
# step checks what they measure.
_SEARCH_SOLVER = "dp"
# Plans checked on a measured step (NOTE [ One step budget over FSDP units ]): a first miss
# teaches what FSDP holds beyond the prediction; a second round seldom misses again.
_ROUNDS = 3


def fsdp_units(root: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The FSDP2 roots of ``root`` (outermost ``fully_shard`` modules) and the units under them,
    each as ``(dotted name, module)`` in call order of registration."""
    from torch.distributed.fsdp import FSDPModule

    roots, units = [], []
    for name, module in root.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        inside = any(name.startswith(f"{r}.") or r == "" for r, _ in roots)
        (units if inside else roots).append((name, module))
    return roots, units


class Unplannable(Exception):
    """Why the FSDP2 units cannot be planned (the caller trains unmodified, or raises when
    strict)."""


def units_to_plan(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units of ``root`` to rematerialize (:func:`fsdp_units`).

    Raises:
        Unplannable: when ``root`` holds no ``fully_shard`` unit inside a root.
    """
    roots, units = fsdp_units(root)
    if not units:
        raise Unplannable(
            "no FSDP2 unit inside a root to rematerialize: call fully_shard(layer) for each layer "
            "(e.g. each decoder layer), then fully_shard(model)" if roots else
            f"{type(root).__name__} has no fully_shard module")
    return units


def rematerialize_fsdp2(root: nn.Module, step: Callable[[bool], int | None],
                        settings: RematSettings, cache: PlanCache, *,
                        comm: Collectives | None = None,
                        info: Callable[[str], None] = lambda message: None,
                        owner: str) -> tuple[UnitPlans, int, dict[str, TargetResult]]:
    """Plan and install every FSDP2 unit of ``root`` (:func:`units_to_plan`) for one
    whole-step budget on each rank: what the Lightning callback and the Accelerate plugin both
    run (NOTE [ One step budget over FSDP units ]).

    Args:
        root: The sharded model (``fully_shard`` on each layer, then on the model).
        step: ``step(warmup)`` runs one whole training step (forward, loss, backward) on the
            example batch and returns its measured peak (``None``: not measurable), leaving no
            trace: the unmodified warmup step (``True``; the units' calls are recorded), then
            each trial step (``False``).
        settings: The validated settings (budget, solver, time limit).
        cache, comm: The plan cache and the other ranks.
        info: Where progress lines go.
        owner: Who speaks in messages (``HiRemateCallback``...).

    Returns:
        The plans, the unmodified step's measured peak, and a result per unit.

    Raises:
        Unplannable: ``root`` has no unit to plan, the step did not call every unit, or its
            peak could not be measured.
    """
    units = units_to_plan(root)
    modules = [unit for _, unit in units]
    targets = [Target(name, None, "", unit, False) for name, unit in units]
    with record_first_calls(targets) as recorded, step_phases(modules) as phases:
        eager = step(True)
    calls = dict(recorded)
    missing = [t.name for t in targets if t.name not in calls]
    if missing:
        raise Unplannable(f"the training step did not call the FSDP units {', '.join(missing)}")
    cached = [name for name, call in calls.items() if _holds_cache(call)]
    if cached:
        raise Unplannable(
            f"the training step hands the FSDP units {', '.join(cached)} a Hugging Face cache "
            "(past_key_values), which a unit's graph cannot take: pass use_cache=False in the "
            "training call (e.g. model(input_ids=..., labels=..., use_cache=False)), as training "
            "needs no cache")
    if not eager:
        raise Unplannable("the warmup step's peak could not be measured (a torch.profiler "
                          "session is running?)")
    budget = settings.budget.resolve(eager)
    started = time.perf_counter()
    info(f"{owner}: FSDP2: planning {len(units)} units for a step budget of "
         f"{format_bytes(budget)} ({settings.budget} of the warmup step's "
         f"{format_bytes(eager)}) ...")
    try:
        planned = plan_units(modules, [calls[n] for n, _ in units], eager, budget,
                             solver=settings.solver, time_limit=settings.time_limit,
                             cache=cache, trial=lambda: step(False) or 0, comm=comm,
                             late_bytes=late_release_bytes(root), phases=phases.measured)
    except BaseException:
        for _, unit in units:
            uninstall(unit)
        raise
    seconds = time.perf_counter() - started
    results = {name: TargetResult(name, plan=rm.plan, plans=rm.plans, capture_time_s=seconds,
                                  remat_module=rm)
               for (name, _), rm in zip(units, planned.modules)}
    return planned, eager, results


class UnitForward(nn.Module):
    """An FSDP unit's own forward without its hooks (NOTE [ Remat inside an FSDP unit ]): shares
    the unit's submodule, parameter and buffer dicts (FSDP swaps sharded and gathered tensors
    in them) and reads other attributes (config, methods) from the unit."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.__dict__["_modules"] = unit._modules
        self.__dict__["_parameters"] = unit._parameters
        self.__dict__["_buffers"] = unit._buffers
        self.__dict__["_unit"] = unit
        self.training = unit.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the class's forward, not the instance's: that one is ours once installed
        return type(self._unit).forward(self, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_unit"], name)


def install(unit: nn.Module, rm: RematModule, *, checkpointed: bool = False) -> None:
    """Run ``rm`` as ``unit``'s forward, inside FSDP's hooks; ``checkpointed``: keeping only its
    inputs, run again in backward (NOTE [ One step budget over FSDP units ])."""
    run = _checkpointed_forward if checkpointed else _remat_forward
    unit.__dict__["forward"] = functools.partial(run, unit, rm)


def uninstall(unit: nn.Module) -> None:
    """Give ``unit`` its own forward back."""
    unit.__dict__.pop("forward", None)


def _remat_forward(unit: nn.Module, rm: RematModule, *args: Any, **kwargs: Any) -> Any:
    if rm.training != unit.training:  # model.eval() reaches the unit, not rm (unregistered)
        rm.train(unit.training)
    return rm(*args, **kwargs)


def _checkpointed_forward(unit: nn.Module, rm: RematModule, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    if rm.training != unit.training:
        rm.train(unit.training)
    return checkpoint(rm, *args, use_reentrant=False, **kwargs)


def probe(unit: nn.Module, args: tuple, kwargs: dict) -> RematModule:
    """Capture ``unit``'s forward on its recorded call and measure its memory, solving nothing
    (a collective: every rank gathers the unit's parameters)."""
    unit.unshard()
    try:
        with warnings.catch_warnings():
            # a unit returns hidden states, not a loss: the whole step's budget is planned here,
            # so rematerialize's advice to pass step_peak_bytes does not apply
            warnings.filterwarnings("ignore", message=r"remat: .* no loss of its own")
            return remat.rematerialize(UnitForward(unit), *args, budget=NO_LIMIT, solver="none",
                                       cache=False, example_kwargs=kwargs)
    finally:
        unit.reshard()


def rematerialize_unit(unit: nn.Module, args: tuple, kwargs: dict, fraction: float, *,
                       solver: str, time_limit: float, cache: PlanCache,
                       eager_peak_bytes: int, comm: Collectives) -> RematModule:
    """``unit``'s forward rematerialized at ``fraction`` of its own eager step (a collective):
    rank 0 measures and solves, the others take its op costs and plan from its cache (NOTE
    [ Same plan on every rank ] in ``integrations/_remat_shared.py``)."""
    def solve() -> RematModule:
        return remat.rematerialize(UnitForward(unit), *args, budget=fraction, solver=solver,
                                   time_limit=time_limit, cache=cache,
                                   eager_peak_bytes=eager_peak_bytes, example_kwargs=kwargs)

    unit.unshard()
    try:
        rm, failure = None, None
        if comm.rank == 0:
            try:
                rm = solve()
            except Exception as exc:  # noqa: BLE001 - told to the other ranks, then raised
                failure = exc
        shared = comm.broadcast(None if comm.rank else
                                {"cache": cache.state_dict(),
                                 "failure": None if failure is None else
                                 f"{type(failure).__name__}: {failure}"})
        if failure is not None:
            raise failure
        if comm.rank:
            if shared["failure"] is not None:
                raise RematError(f"rank 0 could not rematerialize this FSDP unit: "
                                 f"{shared['failure']}")
            cache.load_state_dict(shared["cache"])
            rm = solve()
        return rm
    finally:
        unit.reshard()


@dataclasses.dataclass(frozen=True)
class StepShare:
    """The fraction every unit is planned at and what the step is predicted to peak at.

    Attributes:
        fraction: Of each unit's own eager step (1.0: no unit needs remat).
        checkpointed: How many units (the first ones) keep only their inputs.
        predicted_step_bytes: The step's predicted peak on this rank with those plans.
        eager_step_bytes: The measured unmodified step.
        model: How the step's peak was predicted from the units' plans.
        sizes: Each unit's ``(peak, held)`` in the model with these plans (NOTE [ The step's
            peak over a chain of units ]).
        fits: Whether ``predicted_step_bytes`` is within the budget; when not, ``fraction`` is
            and ``checkpointed`` those with the lowest predicted step.
    """

    fraction: float
    checkpointed: int
    predicted_step_bytes: int
    eager_step_bytes: int
    model: StepModel
    sizes: tuple[tuple[int, int], ...]
    fits: bool


def share_step_budget(probes: Sequence[RematModule], inputs: Sequence[int], eager_step_bytes: int,
                      budget_bytes: int, *, solver: str,
                      phases: StepPhases | None = None,
                      grads: Sequence[tuple[int, int]] = (),
                      model: StepModel | None = None) -> StepShare:
    """NOTE [ One step budget over FSDP units ]: the fewest checkpointed units and the largest
    fraction of each unit's eager step at which the whole step is predicted to fit
    ``budget_bytes``; ``probes`` and ``inputs`` (the bytes of each unit's input activations) in
    the order the units run. The step's peak is predicted by ``model``, or by the model
    calibrated on the unmodified step's ``phases`` (when measured) and the bytes of each unit's
    gradients (kept, being reduced) on this rank, ``grads`` (NOTE [ The step's peak over a
    chain of units ])."""
    keys = [costs_key(p.graphs[0]) for p in probes]
    eager = tuple((p.plan.baseline_bytes + x, p.plan.saved_bytes + x)
                  for p, x in zip(probes, inputs))
    model = model or StepModel.calibrated(eager, eager_step_bytes, phases, grads)
    # a checkpointed unit runs its forward once more in backward (the probes' modelled times)
    forward_s = [sum(op.time for op in p.graphs[0].ops if op.phase == Phase.FORWARD)
                 for p in probes]
    # (unit key, fraction) -> that plan's (peak, saved bytes, predicted step seconds)
    solved: dict[tuple[str, float], tuple[int, int, float] | None] = {}

    def plan_at(key: str, probe: RematModule, fraction: float) -> tuple[int, int, float] | None:
        if (key, fraction) not in solved:
            plan = probe.plan_for(fraction, solver=solver)
            solved[key, fraction] = None if plan is None else (
                plan.predicted_peak_bytes, plan.saved_bytes,
                plan.baseline_time_s * (1 + plan.predicted_overhead))
        return solved[key, fraction]

    def sizes_at(fraction: float, checkpointed: int) -> tuple[tuple[int, int], ...] | None:
        # a unit's input is held with what it saves (a checkpointed one's: alone) until its
        # backward has run, and its schedule's peak leaves its inputs out
        sizes = []
        for k, (key, p) in enumerate(zip(keys, probes)):
            found = plan_at(key, p, fraction)
            if found is None:
                return None
            peak, saved, _ = found
            sizes.append((peak + inputs[k], inputs[k] + (0 if k < checkpointed else saved)))
        return tuple(sizes)

    def step_at(fraction: float, checkpointed: int) -> float:
        sizes = sizes_at(fraction, checkpointed)
        return math.inf if sizes is None else model(sizes)

    def seconds_at(fraction: float, checkpointed: int) -> float:
        return sum(solved[key, fraction][2] for key in keys) + sum(forward_s[:checkpointed])

    if eager_step_bytes <= budget_bytes:
        return StepShare(1.0, 0, eager_step_bytes, eager_step_bytes, model, eager, True)
    best = (math.inf, 1.0, 0)  # the lowest finite step seen, for when nothing fits

    def largest_fitting(checkpointed: int) -> float | None:
        # The fractions that fit form an interval [f_min, f_max]: below f_min some unit has no
        # schedule (``inf``: go up), above f_max the step is over the budget (go down).
        nonlocal best
        if step_at(1.0, checkpointed) <= budget_bytes:
            return 1.0
        low, high, fitted = 0.0, 1.0, None
        for _ in range(_BISECTIONS):
            mid = (low + high) / 2
            step = step_at(mid, checkpointed)
            best = min(best, (step, mid, checkpointed))
            if step <= budget_bytes:
                low = fitted = mid
            elif math.isinf(step):
                low = mid
            else:
                high = mid
        return fitted

    fastest = None  # NOTE [ Checkpointing more units can be faster ]
    for checkpointed in range(len(probes) + 1):
        fitted = largest_fitting(checkpointed)
        if fitted is not None:
            # ties: the larger fraction, then fewer checkpointed units
            priced = (seconds_at(fitted, checkpointed), -fitted, checkpointed)
            fastest = priced if fastest is None else min(fastest, priced)
    if fastest is not None:
        _, fraction, checkpointed = fastest
        return StepShare(-fraction, checkpointed, int(step_at(-fraction, checkpointed)),
                         eager_step_bytes, model, sizes_at(-fraction, checkpointed), True)
    step, fraction, checkpointed = best
    return StepShare(fraction, checkpointed,
                     int(step) if math.isfinite(step) else eager_step_bytes,
                     eager_step_bytes, model, sizes_at(fraction, checkpointed) or eager, False)


@dataclasses.dataclass
class UnitPlans:
    """What :func:`plan_units` decided and measured.

    Attributes:
        modules: Per unit, its :class:`remat.RematModule` (installed as its forward).
        share: The fraction and checkpointed count of the last round.
        measured_step_bytes: The trial step's measured peak with them.
        budget_bytes: The step budget on this rank.
        rounds: How many times the units were planned.
        late_bytes: Headroom the step keeps for buffers collectives release late (NOTE
            [ Buffers gloo's workers release late ]).
    """

    modules: list[RematModule]
    share: StepShare
    measured_step_bytes: int
    budget_bytes: int
    rounds: int
    late_bytes: int = 0

    @property
    def fits(self) -> bool:
        return self.measured_step_bytes + self.late_bytes <= self.budget_bytes


def plan_units(units: Sequence[nn.Module], calls: Sequence[tuple[tuple, dict]],
               eager_step_bytes: int, budget_bytes: int, *, solver: str, time_limit: float,
               cache: PlanCache, trial: Callable[[], int],
               comm: Collectives | None = None, late_bytes: int = 0,
               phases: StepPhases | None = None) -> UnitPlans:
    """Rematerialize every FSDP unit so that the whole step fits ``budget_bytes`` (NOTE [ One
    step budget over FSDP units ]) and install them (NOTE [ Remat inside an FSDP unit ]).

    Args:
        units: The FSDP units, in the order they run.
        calls: Each unit's recorded ``(args, kwargs)``.
        eager_step_bytes: The measured peak of the unmodified step on this rank.
        budget_bytes: The step's budget on this rank.
        solver, time_limit, cache: As :func:`remat.rematerialize`'s.
        trial: Runs one training step with the units as installed and returns its measured
            peak, leaving no trace (parameters, gradients, RNG).
        comm: The other ranks: every rank calls this with its own measurements; rank 0's
            decisions and plans are used by all, and every rank plans again when any rank's
            trial step is over its budget (each unit's parameters are gathered, a collective,
            the same number of times on every rank).
        late_bytes: Headroom the trial step must leave under the budget (NOTE [ Buffers
            gloo's workers release late ]).
        phases: The unmodified step's peak in each phase (:func:`step_phases`; ``None``: a
            looser model, NOTE [ The step's peak over a chain of units ]).
    """
    comm = comm or Collectives()
    probes, seen = [], {}
    for unit, call in zip(units, calls):
        # identical layers called alike have one graph: probed once (a capture each is seconds)
        same = _likeness(unit, call)
        if same not in seen:
            seen[same] = probe(unit, *call)
        probes.append(seen[same])
    inputs = [activation_bytes(call) for call in calls]
    grads = [gradient_bytes(unit) for unit in units]
    target, model, modules, tried = budget_bytes - late_bytes, None, [], None
    for rounds in range(1, _ROUNDS + 1):
        share = comm.broadcast(None if comm.rank else share_step_budget(
            probes, inputs, eager_step_bytes, target, solver=_SEARCH_SOLVER, phases=phases,
            grads=grads, model=model))
        if (share.fraction, share.checkpointed) == tried:  # installed and measured already
            rounds -= 1
            break
        tried = share.fraction, share.checkpointed
        modules = []
        for k, (unit, call, p) in enumerate(zip(units, calls, probes)):
            uninstall(unit)
            rm = rematerialize_unit(unit, *call, share.fraction, solver=solver,
                                    time_limit=time_limit, cache=cache,
                                    eager_peak_bytes=p.plan.eager_bytes, comm=comm)
            install(unit, rm, checkpointed=k < share.checkpointed)
            modules.append(rm)
        with step_phases(units) as measuring:
            measured = trial()
        # by how much the rank that missed most went over (NOTE [ Buffers gloo's workers
        # release late ])
        over = measured + late_bytes - budget_bytes
        worst = comm.all_max(over)
        if worst <= 0:
            break
        # NOTE [ The step's peak over a chain of units ]: the model calibrated on this trial
        # predicts what it measured (when nothing seemed to fit, that may find a plan that
        # does); the ranks that missed by more than rank 0 lower its target
        found = measuring.measured
        if not comm.broadcast(None if comm.rank else share.fits or found is not None):
            break
        if found is None:
            target, model = share.predicted_step_bytes - worst, share.model
        else:
            model = StepModel.calibrated(share.sizes, measured, found, grads)
            target = budget_bytes - late_bytes - max(0, worst - over)
    return UnitPlans(modules, share, measured, budget_bytes, rounds, late_bytes)


def _holds_cache(call: tuple[tuple, dict]) -> bool:
    """Whether a recorded call passes a ``transformers`` cache object (a ``DynamicCache`` that
    every decoder layer appends to)."""
    return any(type(x).__module__ == "transformers.cache_utils" for x in tree_leaves(call))


def _likeness(unit: nn.Module, call: tuple[tuple, dict]) -> object:
    """What a unit's captured graph depends on: its class, its parameters' and buffers' shapes
    and dtypes, and its call (tensors by shape, dtype, strides and ``requires_grad``; other
    values as they are)."""
    def describe(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.stride(), x.requires_grad)
        return repr(x)

    tensors = [(name, tuple(t.shape), t.dtype, t.requires_grad)
               for name, t in [*unit.named_parameters(), *unit.named_buffers()]]
    return (type(unit), tuple(tensors), tuple(describe(x) for x in tree_leaves(call[0])),
            tuple(sorted((k, tuple(describe(x) for x in tree_leaves(v)))
                         for k, v in call[1].items())))


def late_release_bytes(root: nn.Module) -> int:
    """On CPU, the most parameter bytes one FSDP module of ``root`` gathers and reduces itself
    (its own, not its units'; a DTensor parameter's shape is the whole tensor's): what a gloo
    worker may hold after the step let go of it (NOTE [ Buffers gloo's workers release
    late ]); 0 elsewhere."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    owner: dict[int, tuple[int, torch.Tensor]] = {}  # the innermost FSDP module holding each
    for k, module in enumerate(modules):  # outer modules come first, inner ones overwrite
        owner.update((id(p), (k, p)) for p in module.parameters())
    sizes = [0] * len(modules)
    for k, p in owner.values():
        if p.device.type == "cpu":
            sizes[k] += p.numel() * p.element_size()
    return max(sizes, default=0)


def fsdp2_line(planned: UnitPlans, eager_step_bytes: int, *, owner: str) -> str:
    """One line a person reads: what the units run and what the step measured against its
    budget and the unmodified step."""
    share, n = planned.share, len(planned.modules)
    kept = (f"{share.checkpointed} of {n} units keep only their inputs (run again in backward)"
            if share.checkpointed else f"all {n} units keep what their schedules save")
    return (f"{owner}: FSDP2: {kept}, each unit scheduled at {100 * share.fraction:.0f}% of its "
            f"own step; measured step {format_bytes(planned.measured_step_bytes)} = "
            f"{100 * planned.measured_step_bytes / max(eager_step_bytes, 1):.0f}% of the "
            f"unmodified warmup step's {format_bytes(eager_step_bytes)} (budget "
            f"{format_bytes(planned.budget_bytes)}{_headroom(planned)}, predicted "
            f"{format_bytes(share.predicted_step_bytes)}; planned {planned.rounds} time"
            f"{'s' if planned.rounds > 1 else ''})")


def _headroom(planned: UnitPlans) -> str:
    return (f" with {format_bytes(planned.late_bytes)} kept for buffers gloo releases late"
            if planned.late_bytes else "")


def fsdp2_miss(planned: UnitPlans, eager_step_bytes: int, *, owner: str) -> str:
    """The warning when even the lowest plans measured over the budget, with the budget that
    would fit."""
    measured = format_bytes(planned.measured_step_bytes)
    over = (f"{measured}, over its budget {format_bytes(planned.budget_bytes)}"
            if not planned.late_bytes else
            f"{measured}, and {format_bytes(planned.late_bytes)} kept for buffers gloo releases "
            f"late puts it over its budget {format_bytes(planned.budget_bytes)}")
    lowest = math.ceil(100 * (planned.measured_step_bytes + planned.late_bytes)
                       / max(eager_step_bytes, 1))
    return (f"{owner}: FSDP2: the step measured {over}: this is the lowest the units' plans "
            f"reach, so they stay installed. budget=\"{lowest}%\" or more fits this batch; "
            "below that, shrink the batch.")
