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

import dataclasses
import functools
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .budget import Budget, parse_budget
from .cache import PlanCache, graph_key
from .errors import ScheduleError
from .codegen import boxed, generate_modules
from .costs import measure_op_times, model_op_times
from .graph import RematGraph
from .lowering import lower_joint_graph
from .passes import split_dropout
from .plan import Plan
from .planner import plan_graph
from .schedule import Schedule, simulate
from .solvers import get_solver

__all__ = ["RematBackend", "backend", "DEFAULT_SOLVER"]

log = logging.getLogger(__name__)

DEFAULT_SOLVER = "hierarchical"


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return boxed(gm)


class RematBackend:
    """A ``torch.compile`` backend that rematerializes every graph it compiles.

    Args:
        budget: Activation-memory budget (see :func:`remat.parse_budget`). A fraction applies to
            each captured graph's own baseline; a byte budget to each graph separately.
        solver: Name of a registered solver (see ``remat.SOLVERS``).
        time_limit: Seconds each solve may take.
        measure: Time ops on the real example inputs (default) instead of modelling them.
        options: Solver-specific options.
        cache: A :class:`remat.PlanCache` to reuse schedules solved before.

    Attributes:
        plans: The :class:`Plan` of every graph compiled so far, in order.
        graphs: The :class:`RematGraph` each plan was solved on (for inspection and debugging).
    """

    def __init__(self, budget: str | float | int | Budget = "70%", *, solver: str = DEFAULT_SOLVER,
                 time_limit: float = 60.0, measure: bool = True, options: dict | None = None,
                 cache: PlanCache | None = None) -> None:
        self.budget = parse_budget(budget)
        get_solver(solver)  # validates the name now, not at the first step
        if not isinstance(time_limit, (int, float)) or isinstance(time_limit, bool) or time_limit <= 0:
            raise ValueError(f"time_limit={time_limit!r}: must be a positive number of seconds; "
                             "pass e.g. time_limit=60")
        self.solver = solver
        self.time_limit = float(time_limit)
        self.measure = measure
        self.options = dict(options or {})
        if cache is not None and not isinstance(cache, PlanCache):
            raise TypeError(f"cache={cache!r}: expected a remat.PlanCache or None; pass "
                            "cache=remat.PlanCache('path/to/dir')")
        self.cache = cache
        self.plans: list[Plan] = []
        self.graphs: list[RematGraph] = []  # the solved graphs, parallel to `plans`
        self.lenient = False  # after pin(): over-budget new shapes warn instead of raising
        self.__name__ = "remat_backend"  # dynamo reads a backend's name

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        real_inputs = list(example_inputs)
        partition = functools.partial(self._partition, gm=gm, real_inputs=real_inputs)
        return aot_autograd(
            fw_compiler=_compile_graph,
            bw_compiler=_compile_graph,
            inference_compiler=_compile_graph,
            partition_fn=partition,
        )(gm, example_inputs)

    def _partition(self, joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                   gm: fx.GraphModule, real_inputs: list[Any], **_: Any
                   ) -> tuple[fx.GraphModule, fx.GraphModule]:
        split_dropout(joint)
        lowered = lower_joint_graph(joint, num_fwd_outputs=num_fwd_outputs)
        key = graph_key(lowered.graph, self.budget, self.solver, self.options)
        hit = self._cached(key, lowered.graph)
        if hit is not None:
            schedule, plan = hit
            graph = lowered.graph
        else:
            primals = self._primals(gm, real_inputs, joint)
            workspaces = None
            if self.measure and primals is not None:
                times, workspaces = measure_op_times(lowered, joint, primals)
            else:
                times = model_op_times(lowered)
            graph = lowered.graph.with_times(times, workspaces)
            plan, schedule = plan_graph(graph, self.budget, solver=self.solver,
                                        time_limit=self.time_limit, options=self.options,
                                        over_budget="lowest" if self.lenient else "raise")
            if self.cache is not None:
                self.cache.put(key, schedule, plan)
        self.plans.append(plan)
        self.graphs.append(graph)
        return generate_modules(lowered, schedule, joint)

    def pin(self, plan: Plan) -> None:
        """Fix a fraction budget to ``plan``'s bytes for the graphs compiled from now on, and
        let a graph that cannot fit run with its lowest-peak schedule (with a warning)."""
        if self.budget.fraction is not None:
            self.budget = Budget(bytes=plan.budget_bytes,
                                 text=f"{self.budget} of the example = {plan.budget_bytes} bytes")
        self.lenient = True

    def _cached(self, key: str, graph: RematGraph) -> tuple[Schedule, Plan] | None:
        """A cached schedule for this graph, checked by the simulator (NOTE [ Plan cache ])."""
        if self.cache is None:
            return None
        found = self.cache.get(key)
        if found is None:
            return None
        schedule, plan = found
        try:
            simulate(graph, schedule)
        except (ScheduleError, IndexError) as exc:
            log.warning("ignoring a cached plan that does not fit this graph: %s", exc)
            return None
        return schedule, dataclasses.replace(plan, cache_hit=True, solve_time_s=0.0)

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
        for node, real in zip(placeholders, candidates):
            fake = node.meta.get("val")
            if not isinstance(real, torch.Tensor) or not isinstance(fake, torch.Tensor) or \
                    tuple(real.shape) != tuple(fake.shape) or real.dtype != fake.dtype:
                log.debug("input %s does not match its primal; modelling op times", node.name)
                return None
        return candidates


def backend(budget: str | float | int | Budget = "70%", *, solver: str = DEFAULT_SOLVER,
            time_limit: float = 60.0, measure: bool = True, options: dict | None = None,
            cache: PlanCache | None = None) -> RematBackend:
    """A ``torch.compile`` backend that keeps each graph's activation peak under ``budget``.

    Args:
        budget: ``"70%"``, ``0.7``, ``"6GiB"``, ``1_500_000_000``... (see :func:`remat.parse_budget`).
        solver: One of ``remat.SOLVERS`` (default ``"hierarchical"``).
        time_limit: Seconds each solve may take; the best schedule found by then is used.
        measure: Time ops on the real example inputs (default) or model them from FLOPs.
        options: Solver-specific options.
        cache: A :class:`remat.PlanCache`: graphs solved before are not solved again.

    Returns:
        A :class:`RematBackend`; after compilation its ``plans`` hold one :class:`Plan` per graph.

    Example:
        >>> model = torch.compile(model, backend=remat.backend(budget="50%"))
    """
    return RematBackend(budget, solver=solver, time_limit=time_limit, measure=measure,
                        options=options, cache=cache)
