"""The ``torch.compile`` backend: capture the joint graph, solve, and generate the schedule.

``remat.backend(budget="50%")`` is a backend for ``torch.compile``; :func:`remat.rematerialize`
uses the same object with ``fullgraph=True``. For every graph dynamo hands it, AOTAutograd builds
the joint forward+backward graph and calls our partition function, which lowers it to a
:class:`~remat.graph.RematGraph`, measures op times on the real example inputs, solves, checks
the schedule with the simulator and emits the forward/backward graphs (:mod:`remat.codegen`).
AOTAutograd's own runtime wrappers then run them, so autograd, buffers mutation and aliasing
semantics are PyTorch's.
"""
from __future__ import annotations

import functools
from dataclasses import replace
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .budget import Budget, Reference, format_bytes, parse_budget
from .cache import PlanCache, costs_key, graph_key, resolve_cache
from .errors import InfeasibleBudgetError, RematError, ScheduleError, SolverError
from .codegen import boxed, direct_calls, generate_modules
from .carry import carry_costs, carry_schedule
from .costs import machine_tag, measure_op_times, model_op_times
from .experts import expert_grads_in_order
from .graph import RematGraph
from .lowering import lower_joint_graph
from .passes import alias_clones, bind_sizes, split_dropout
from .plan import Plan
from .recurrent import recurrent_kernels
from .planner import checkpoint_schedule, describe, plan_graph
from .schedule import Schedule, save_all_schedule, simulate
from .settings import check_time_limit
from .sized_graph import SizedGraph, structure_key
from .sizes import ShapePlans
from .solvers import get_solver
from .symbolic import fixed_dims, hint, input_dims, symbol_values

__all__ = ["RematBackend", "backend", "DEFAULT_SOLVER"]

log = logging.getLogger(__name__)

DEFAULT_SOLVER = "hierarchical"

# A cached schedule is checked against the budget with the scratch memory measured in this
# process, which can differ by a few bytes from the solving process's (another DDP rank): a
# schedule within 1% of the budget is the same plan, an entry solved for another budget is not.
_CACHE_TOLERANCE = 0.01


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return boxed(direct_calls(gm))


class RematBackend:
    """A ``torch.compile`` backend that rematerializes every graph it compiles.

    Args:
        budget: Activation-memory budget (see :func:`remat.parse_budget`). A fraction applies to
            each captured graph's own baseline; a byte budget to each graph separately.
        solver: Name of a registered solver (see ``remat.SOLVERS``).
        time_limit: Seconds each solve may take.
        measure: Time ops on the real example inputs (default) instead of modelling them.
        options: Solver-specific options.
        cache: Where to reuse schedules solved before: a :class:`remat.PlanCache`, a directory,
            ``True`` (the default directory, :func:`remat.cache.default_cache_dir`) or
            ``None``/``False`` (none).

    Attributes:
        plans: The :class:`Plan` of every schedule solved so far, in order.
        graphs: The :class:`RematGraph` each plan was solved on (for inspection and debugging).
        shapes: The :class:`~remat.sizes.ShapePlans`: every schedule, and which one each batch
            size runs (NOTE [ Shape-generic plans ]).
    """

    def __init__(self, budget: str | float | int | Budget = "70%", *, solver: str = DEFAULT_SOLVER,
                 time_limit: float = 60.0, measure: bool = True, options: dict | None = None,
                 cache: PlanCache | str | bool | None = None, between_breaks: bool = False
                 ) -> None:
        self.budget = parse_budget(budget)
        # torch.compile's graphs, one per piece between graph breaks, not one whole step
        # (NOTE [ A piece with nothing to recompute ])
        self.between_breaks = between_breaks
        get_solver(solver)  # validates the name now, not at the first step
        self.solver = solver
        self.time_limit = check_time_limit(time_limit)  # NOTE [ One check per setting ]
        self.measure = measure
        self.options = dict(options or {})
        self.cache = resolve_cache(cache)
        self.shapes = ShapePlans(self.budget, solver=solver, time_limit=self.time_limit,
                                 options=self.options)
        self.current_leaves: list[Any] = []  # the flattened inputs of the call being compiled
        # Their names, computed on demand (NOTE [ Naming sizes ] in remat/calls.py); None: unknown
        self.current_names: Callable[[], list[str] | None] | None = None
        self.last_entry: int | None = None  # the schedule the latest compiled graph runs
        self.lenient = False  # after pin(): over-budget new shapes warn instead of raising
        # (eager_bytes, outside_bytes) of the example's eager step, measured by rematerialize
        # (NOTE [ A budget is what the user measures ]); None: fractions of the compiled step.
        self.eager: tuple[int, int] | None = None
        # Per input leaf, its shape in the call :attr:`eager` was measured on, when that was
        # not the call captured first (a smaller example run eagerly); ``None``: that call.
        self.eager_shapes: list[tuple[int, ...] | None] | None = None
        # NOTE [ Static first ] in remat/module.py: the first graph captured with static shapes
        # and its call's tensor shapes, whose measured op costs a dynamic capture takes over
        self.static: tuple[str, list[tuple[int, ...] | None]] | None = None
        # Set while a capture's family runs the eager step: the backend returns dynamo's graph
        # to run eagerly (NOTE [ A specialisation the eager step fits ])
        self.eager_capture = False
        self.__name__ = "remat_backend"  # dynamo reads a backend's name

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 request: int | None = None) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        real_inputs = list(example_inputs)
        dims = input_dims(gm.graph, real_inputs, self.current_leaves)
        partition = functools.partial(self._partition, gm=gm, real_inputs=real_inputs,
                                      request=request, dims=dims, dim_names=self._dim_names(dims),
                                      fixed=fixed_dims(gm.graph, real_inputs, self.current_leaves))
        self.eager_capture = False
        with recurrent_kernels():  # NOTE [ Recurrent layers as eager runs them ]
            compiled = aot_autograd(
                fw_compiler=_compile_graph,
                bw_compiler=_compile_graph,
                inference_compiler=_compile_graph,
                partition_fn=partition,
            )(gm, example_inputs)
        if self.eager_capture:  # NOTE [ A specialisation the eager step fits ]
            self.eager_capture = False
            return gm.forward
        return compiled

    def _dim_names(self, dims: dict[str, tuple[int, int]]) -> dict[str, str]:
        """Size symbol -> ``"input_ids[1]"``: the name of the input leaf and the axis
        (NOTE [ Naming sizes ] in remat/calls.py); empty when the call is not known."""
        names = self.current_names() if dims and self.current_names is not None else None
        if not names:
            return {}
        return {s: f"{names[leaf]}[{axis}]" for s, (leaf, axis) in dims.items()
                if leaf < len(names)}

    @property
    def plans(self) -> list[Plan]:
        """Every plan solved (or loaded from the cache) so far, in order."""
        return self.shapes.plans

    @property
    def graphs(self) -> list[RematGraph]:
        """The graph each plan was solved on (for inspection and debugging)."""
        return self.shapes.graphs

    def _partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                   gm: fx.GraphModule, real_inputs: list[Any], request: int | None = None,
                   dims: dict[str, tuple[int, int]] | None = None,
                   dim_names: dict[str, str] | None = None,
                   fixed: tuple[tuple[int | None, ...] | None, ...] = (), **_: Any
                   ) -> tuple[fx.GraphModule, fx.GraphModule]:
        split_dropout(joint)
        alias_clones(joint)  # NOTE [ Copies nobody mutates ]
        bind_sizes(joint)
        expert_grads_in_order(joint)  # NOTE [ Each read's gradient in eager's order ]
        lowered = lower_joint_graph(joint, num_fwd_outputs=num_fwd_outputs)
        key, symbols = structure_key(lowered.graph, lowered.size_exprs)
        values = symbol_values(joint.graph)
        sizes = tuple(values.get(s, 0) for s in symbols)
        family = self.shapes.families.get(key)
        if family is None:
            where = ([(dims or {}).get(s) for s in symbols],
                     [(dim_names or {}).get(s) for s in symbols], fixed)
            entry = self._solve_family(lowered, joint, gm, real_inputs, key, symbols, sizes,
                                       *where)
            if self.shapes.families[key].sized.sizes != sizes:  # solved at the example's sizes
                entry = self.shapes.to_compile(key, sizes)
        elif request is not None and self.shapes.entries[request].family == key:
            entry = request  # NOTE [ Shape-generic plans ]: the slot's own schedule
        else:
            entry = self.shapes.to_compile(key, sizes)
        self.last_entry = entry
        return generate_modules(lowered, self.shapes.entries[entry].schedule, joint)

    def _eager_family(self, lowered, key, symbols, sizes, dims, dim_names, fixed
                      ) -> int | None:
        """NOTE [ A specialisation the eager step fits ]
        A graph dynamo specialises inside training (a batch of 1, a loop unrolled at a shorter
        length) often fits the run's budget unmodified, and the step that captures it, and every
        later call of those shapes, ran the compiled unmodified step: a tiny GPT-2 at "50%" ran
        its batches of 1 at 1.21x (the capturing step, which also measured its ops) and then
        1.11x their eager peak; HF Mamba's T=24 after T=48 at "60%" 1.12x and 1.08x. Where the
        eager step's price (NOTE [ The unmodified step runs eagerly ]) and the unmodified step
        both fit the budget, nothing is measured or solved (op times are modelled, for later
        sizes of the family that may need a solve) and dynamo runs its own graph eagerly: the
        autograd graph, saved tensors and dropout draws of the user's eager step. Returns the
        family's eager entry, or ``None`` to solve the graph as usual."""
        shapes = self.shapes
        if not (self.lenient and self.measure and shapes.reference is not None
                and shapes.families):
            return None
        graph = lowered.graph.with_times(model_op_times(lowered))
        unmodified = simulate(graph, save_all_schedule(graph)).peak_bytes
        budget_bytes = shapes.new_family_budget(unmodified)
        if max(unmodified, shapes.eager_peak(unmodified)) > budget_bytes:
            return None
        plan, schedule = plan_graph(graph, Budget(bytes=budget_bytes,
                                                  text=f"{self.budget} of the run"),
                                    solver=self.solver, time_limit=self.time_limit,
                                    options=self.options)
        plan = replace(plan, detail="the eager step fits the budget: ops not measured")
        shapes.add_family(key, SizedGraph(graph, lowered.size_exprs, symbols, sizes), schedule,
                          plan, dims, dim_names, fixed)
        return shapes.run_eagerly(key, sizes)

    def _solve_family(self, lowered, joint, gm, real_inputs, key, symbols, sizes, dims,
                      dim_names, fixed) -> int:
        """Profile and solve a graph of a structure not seen before (or load it from the cache),
        unless the eager step serves it (:meth:`_eager_family`).

        A dynamic capture of the graph first captured with static shapes takes that graph's
        costs and, op for op, its schedule, else is solved at the example's sizes, as if it had
        been captured first (NOTE [ Costs carried to the dynamic capture ] in
        :mod:`remat.carry`)."""
        carried = self._carried(lowered, symbols, sizes, dims)
        if carried is not None:
            (graph, sizes), alone = carried, False
        else:
            entry = self._eager_family(lowered, key, symbols, sizes, dims, dim_names, fixed)
            if entry is not None:
                self.eager_capture = True
                return entry
            graph, alone = self._costed(lowered, joint, gm, real_inputs, key)
            if not symbols and not self.shapes.families and self.current_leaves:
                self.static = (key, [tuple(x.shape) if isinstance(x, torch.Tensor) else None
                                     for x in self.current_leaves])
        cache_key = graph_key(graph, self.budget, self.solver, self.options, structure=key)
        budget = self.budget
        sized = SizedGraph(graph, lowered.size_exprs, symbols, sizes)
        if not self.shapes.families and self.eager is not None:
            # NOTE [ A budget is what the user measures ]: the example's eager step, measured
            # by rematerialize, against the captured step's unmodified peak at the same sizes.
            measured_at = self._eager_sizes(sizes, dims)
            compiled = simulate(sized.at(measured_at), save_all_schedule(graph)).peak_bytes
            self.shapes.reference = Reference(*self.eager, compiled_bytes=compiled)
        reference = self.shapes.reference
        run_bytes = self.shapes.new_family_budget(simulate(graph, save_all_schedule(graph))
                                                  .peak_bytes) \
            if self.lenient and carried is None else None
        if run_bytes is not None:  # another specialisation of the module
            budget = Budget(bytes=run_bytes, text=f"{budget} of the run = {run_bytes} bytes")
            reference = None  # already the module's bytes
        hit = self._cached(cache_key, graph, budget, reference)
        if hit is None and carried is not None:
            hit = self._from_static(graph, budget, reference)
        if hit is not None:
            schedule, plan = hit
        else:
            try:
                plan, schedule = self._plan(graph, budget, reference, lowered)
            except RematError:
                raise
            except Exception as exc:  # noqa: BLE001 - a solver crash is ours, not the model's
                raise SolverError(
                    f"solver {self.solver!r} failed on a {len(graph.ops)}-op graph: "
                    f"{type(exc).__name__}: {exc}. This is a bug in hiremate; please report it. "
                    f"Meanwhile another solver may work (solver='dp' or 'checkpoint')",
                    solver=self.solver, status="crashed") from exc
            if self.cache is not None:
                self.cache.put(cache_key, schedule, plan)
        if alone:
            plan = replace(plan, detail=(plan.detail + "; " if plan.detail else "") +
                           "ops measured one at a time: the unmodified step would not fit the "
                           "budget")
        return self.shapes.add_family(key, sized, schedule, plan, dims, dim_names, fixed)

    def _carried(self, lowered, symbols: tuple[str, ...], sizes: tuple[int, ...],
                 dims: Sequence[tuple[int, int] | None]
                 ) -> tuple[RematGraph, tuple[int, ...]] | None:
        """``lowered.graph`` at the sizes of the static capture's call, with that capture's
        measured op costs, and those sizes; ``None`` when this is not a dynamic capture of the
        same step (NOTE [ Costs carried to the dynamic capture ] in :mod:`remat.carry`)."""
        if not symbols or self.static is None or not self.measure or \
                any(f.sized.symbols for f in self.shapes.families.values()):
            return None
        static_key, shapes = self.static
        at = []
        for where in dims:
            shape = shapes[where[0]] if where is not None and where[0] < len(shapes) else None
            if shape is None or where[1] >= len(shape):
                return None
            at.append(int(shape[where[1]]))
        at = tuple(at)
        source = self.shapes.families[static_key].sized.graph
        target = SizedGraph(lowered.graph, lowered.size_exprs, symbols, sizes).at(at)
        graph = carry_costs(source, target, model_op_times(lowered))
        if graph is None:
            log.info("remat: the dynamic capture does not match the static one op for op; "
                     "measuring its ops")
            return None
        return graph, at

    def _costed(self, lowered, joint: fx.GraphModule, gm: fx.GraphModule,
                real_inputs: list[Any], structure: str) -> tuple[RematGraph, bool]:
        """``lowered.graph`` with its op costs: kept from an earlier capture of the same graph
        on this machine (NOTE [ Costs measured once ] in :mod:`remat.cache`), else measured on
        the real inputs (one op at a time where the unmodified step would not fit the budget:
        NOTE [ Measuring ops one at a time ]), else modelled; and whether ops were measured one
        at a time. With ``solver="none"`` nothing is recomputed, so only scratch memory is
        measured (what :func:`remat.estimate` reports) and times are modelled."""
        primals = self._primals(gm, real_inputs, joint) if self.measure else None
        if primals is None:
            return lowered.graph.with_times(model_op_times(lowered)), False
        machine = machine_tag(primals)
        ckey = costs_key(lowered.graph, structure=structure)
        num_ops = len(lowered.graph.ops)
        kept = self.cache.get_costs(ckey, machine, num_ops) if self.cache is not None else None
        if kept is not None:
            return lowered.graph.with_times(kept.times, kept.workspaces, kept.rerun_times), False
        alone = self._too_big_to_measure(lowered.graph)
        if self.solver == "none":
            costs = measure_op_times(lowered, joint, primals, alone=alone, repeats=0)
            return lowered.graph.with_times(model_op_times(lowered), costs.workspaces), alone
        costs = measure_op_times(lowered, joint, primals, alone=alone)
        if self.cache is not None:
            self.cache.put_costs(ckey, machine, costs)
        return lowered.graph.with_times(costs.times, costs.workspaces, costs.rerun_times), alone

    def _plan(self, graph: RematGraph, budget: Budget, reference: Reference | None,
              lowered) -> tuple[Plan, Schedule]:
        """NOTE [ A piece with nothing to recompute ]
        Under ``torch.compile(model, backend=remat.backend(...))`` each graph between graph
        breaks gets the budget of its own step. A piece where no schedule peaks below its
        unmodified step (an embedding lookup before ``pack_padded_sequence``, which dynamo
        cannot trace) raised ``InfeasibleBudgetError``, and that stopped the user's whole
        compile for a piece no budget could change. Such a piece runs unmodified, with
        :func:`plan_graph`'s warning; a piece that could save memory, only not enough, still
        raises with a budget that fits."""
        def solve(over_budget: str) -> tuple[Plan, Schedule]:
            return plan_graph(graph, budget, solver=self.solver, time_limit=self.time_limit,
                              options=self.options, over_budget=over_budget,
                              reference=reference, candidates=_user_checkpointing(lowered, graph))

        try:
            return solve("lowest" if self.lenient else "raise")
        except InfeasibleBudgetError as exc:
            if not (self.between_breaks and exc.best_bytes is not None
                    and exc.best_bytes >= exc.baseline_bytes):
                raise
            return solve("lowest")

    def _too_big_to_measure(self, graph: RematGraph) -> bool:
        """Whether measuring ``graph``'s ops would run an unmodified step over the budget inside
        a training step (NOTE [ Measuring ops one at a time ] in :mod:`remat.costs`): a later
        size family, or the first capture after the example ran eagerly (NOTE [ A budget the
        eager step fits ])."""
        if not (self.lenient and self.measure):
            return False
        if not self.shapes.families and self.budget.bytes is None:
            return False
        unmodified = simulate(graph, save_all_schedule(graph)).peak_bytes
        limit = self.shapes.new_family_budget(unmodified) if self.shapes.families \
            else self.budget.bytes
        if unmodified <= limit:
            return False
        log.info("remat: measuring these sizes in their unmodified step would peak at %s, over "
                 "the budget %s: their ops are measured one at a time", format_bytes(unmodified),
                 format_bytes(limit))
        return True

    def _eager_sizes(self, sizes: tuple[int, ...], dims: Sequence[tuple[int, int] | None]
                     ) -> tuple[int, ...]:
        """The size symbols' values in the call the eager step was measured on: ``sizes``
        unless that was another call (:attr:`eager_shapes`, NOTE [ A budget the eager step
        fits ]); a symbol no input dimension is known to have keeps its value."""
        shapes = self.eager_shapes
        if shapes is None:
            return sizes
        return tuple(shapes[d[0]][d[1]] if d is not None and d[0] < len(shapes)
                     and shapes[d[0]] is not None and d[1] < len(shapes[d[0]]) else v
                     for v, d in zip(sizes, dims))

    def pin(self, plan: Plan) -> None:
        """After the example call: a graph that cannot fit the budget later runs with its
        lowest-peak schedule (with a warning) instead of raising in the middle of training."""
        self.lenient = True

    def _cached(self, key: str, graph: RematGraph, budget: Budget,
                reference: Reference | None = None) -> tuple[Schedule, Plan] | None:
        """A cached schedule for this graph, re-simulated and checked against the budget asked
        for now; its plan is recomputed, never read from the file (NOTE [ Plan cache ])."""
        if self.cache is None:
            return None
        found = self.cache.get(key)
        if found is None:
            return None
        return self._replanned(graph, *found, budget, reference, "a cached plan",
                               cache_hit=True)

    def _from_static(self, graph: RematGraph, budget: Budget, reference: Reference | None
                     ) -> tuple[Schedule, Plan] | None:
        """The static capture's schedule for ``graph``, its dynamic capture at the same sizes,
        where the two are the same op for op (NOTE [ The static schedule serves the dynamic
        graph ] in :mod:`remat.carry`)."""
        static = self.shapes.families[self.static[0]]
        first = self.shapes.entries[static.entries[0]]
        schedule = carry_schedule(static.sized.graph, first.schedule, graph)
        if schedule is None or first.plan is None:
            return None
        return self._replanned(graph, schedule, first.plan, budget, reference,
                               "the static capture's plan",
                               detail="the static capture's plan, op for op"
                               + (f"; {first.plan.detail}" if first.plan.detail else ""))

    def _replanned(self, graph: RematGraph, schedule: Schedule, stored: Plan, budget: Budget,
                   reference: Reference | None, what: str, *, cache_hit: bool = False,
                   detail: str | None = None) -> tuple[Schedule, Plan] | None:
        """``schedule``, solved before (``stored``), re-simulated on ``graph`` and checked
        against the budget asked for now, with its plan recomputed (its notes ``detail``, else
        the stored plan's); ``None`` if it does not fit. ``what`` names it in warnings."""
        try:
            sim = simulate(graph, schedule)
        except (ScheduleError, IndexError) as exc:
            warnings.warn(f"remat: ignoring {what}, which does not fit this graph: {exc}",
                          stacklevel=3)
            return None
        baseline = simulate(graph, save_all_schedule(graph))
        budget_bytes = budget.resolve(baseline.peak_bytes, reference)
        lowest_is_fine = self.lenient and stored.status == "over_budget"
        if sim.peak_bytes > budget_bytes * (1 + _CACHE_TOLERANCE) and not lowest_is_fine:
            warnings.warn(
                f"remat: ignoring {what}, which peaks at {format_bytes(sim.peak_bytes)}, "
                f"over the budget {budget} = {format_bytes(budget_bytes)}; solving again",
                stacklevel=3)
            return None
        plan = describe(graph, schedule, sim, baseline, budget_bytes=budget_bytes,
                        solver=str(stored.solver), status=str(stored.status),
                        detail=str(stored.detail) if detail is None else detail,
                        cache_hit=cache_hit, reference=reference)
        return schedule, plan

    @staticmethod
    def _primals(gm: fx.GraphModule, real_inputs: list[Any], joint: fx.GraphModule
                 ) -> list[torch.Tensor] | None:
        """Real tensors for the joint graph's primal placeholders (lifted params first)."""
        lifted = [*gm.parameters(), *gm.buffers()]
        candidates = [*lifted, *real_inputs]
        placeholders = [n for n in joint.graph.nodes
                        if n.op == "placeholder" and n.name.startswith("primals")]
        if len(placeholders) != len(candidates):
            log.debug("cannot align %d real inputs with %d primals; modelling op times",
                      len(candidates), len(placeholders))
            return None
        for k, (node, real) in enumerate(zip(placeholders, candidates)):
            fake = node.meta.get("val")
            if isinstance(fake, torch.SymInt) and isinstance(real, (int, torch.SymInt)):
                candidates[k] = hint(real)  # a size input (NOTE [ Dynamic shapes ])
                continue
            if not isinstance(real, torch.Tensor) or not isinstance(fake, torch.Tensor) or \
                    tuple(real.shape) != tuple(hint(d) for d in fake.shape) or \
                    real.dtype != fake.dtype:
                log.debug("input %s does not match its primal; modelling op times", node.name)
                return None
        return candidates


def _user_checkpointing(lowered, graph: RematGraph) -> list[tuple[Schedule, str]]:
    """NOTE [ The user's checkpointing is a candidate ]: the regions AOTAutograd tagged for
    recomputation (``torch.utils.checkpoint`` in the model) as a schedule, if any."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    tags = [node.meta.get("ac_graph_id") if node.meta.get("recompute") in recompute else None
            for node in lowered.op_nodes]
    schedule = checkpoint_schedule(graph, tags)
    return [] if schedule is None else [(schedule, "the model's own torch.utils.checkpoint")]


def backend(budget: str | float | int | Budget = "70%", *, solver: str = DEFAULT_SOLVER,
            time_limit: float = 60.0, measure: bool = True, options: dict | None = None,
            cache: PlanCache | str | bool | None = True) -> RematBackend:
    """A ``torch.compile`` backend that keeps each graph's activation peak under ``budget``.

    Args:
        budget: ``"70%"``, ``0.7``, ``"6GiB"``, ``"512MB"``... (see :func:`remat.parse_budget`).
        solver: One of ``remat.SOLVERS`` (default ``"hierarchical"``).
        time_limit: Seconds each solve may take (finite, > 0); the best schedule found by then
            is used.
        measure: Time ops on the real example inputs (default) or model them from FLOPs.
        options: Solver-specific options.
        cache: Graphs solved before are not solved again: ``True`` (default) keeps schedules
            in the user's cache directory, so every run of a model gets the same ones (NOTE [ The
            same plan every run ] in :mod:`remat.cache`; ``HIREMATE_CACHE_DIR=off`` turns it
            off), ``False`` none, or a directory / :class:`remat.PlanCache`.

    Returns:
        A :class:`RematBackend`; after compilation its ``plans`` hold one :class:`Plan` per graph.

    Example:
        >>> model = torch.compile(model, backend=remat.backend(budget="50%"))
    """
    return RematBackend(budget, solver=solver, time_limit=time_limit, measure=measure,
                        options=options, cache=cache, between_breaks=True)
