"""``rematerialize``: swap a module for an equivalent one that keeps activations under a budget.

NOTE [ Later input shapes ]
The first call of other shapes captures the step with dynamic dimensions (NOTE [ Static first ],
NOTE [ Dynamic shapes ]), so a batch of another size (dynamic padding, a short last batch,
another image size) is the same graph at other sizes: it runs the fastest schedule that fits the
budget there, re-priced by the simulator, and a new schedule is solved only for a size bucket
none fits (NOTE [ Shape-generic plans ] in ``remat/sizes.py``). A byte budget holds for every
size; a fraction follows the largest unmodified-step peak seen (NOTE [ Budgets over many
sizes ]). A size that no schedule can fit runs with the lowest-peak schedule found and one
warning, instead of failing in the middle of training. A graph dynamo has to specialise (a size
of 1, eval mode) is profiled and solved on its own.

NOTE [ Static first ]
Tracing with symbolic sizes is what makes a capture slow: ``torch.compile(backend="aot_eager")``
of a 4-layer GPT (8x256) took 2.9 s with static shapes and 9.9 s with ``dynamic=True`` on 2
cores, the symbolic arithmetic spread over every op; our own capture of it 2.3 s against ~6 s.
``rematerialize`` therefore captures the example's shapes as they are (``dynamic=None``, the
default), as ``torch.compile`` does by default, and a run whose shapes never change pays nothing
for sizes it never sees. The first call of another shape (dtype or mode: any call the static
graphs do not serve) captures once more with dynamic dimensions; that graph does the same work
as the static one at the example's sizes, so it takes the static graph's measured op costs and,
where it is the static graph op for op, its schedule; otherwise it is solved at the example's
sizes, as if it had been captured first (NOTE [ Costs carried to the dynamic capture ] and NOTE
[ The static schedule serves the dynamic graph ] in ``remat/carry.py``): nothing is measured
inside that training step, and the plan does not depend on which shape came second. From then
on that family serves every size (``ShapePlans.serving``). ``dynamic=True`` captures with
dynamic dimensions at once; ``False`` captures every new shape on its own. The integrations use
the default (NOTE [ Budgets over many batch sizes ] in ``integrations/_remat_shared.py``).

A run whose shapes vary pays the static capture on top of the dynamic one. Measured on the
40-step dynamic-padding run of ``tests/remat/test_shapes.py`` (2-layer GPT-2, 2 cores): setup
plus the time inside steps 15.3 s against 12.7 s captured dynamic at once, the static capture
itself 3.9 s against 7.3 s. That was 19.5 s (5 schedules compiled, against 3) until the dynamic
capture compiled a schedule later batches run rather than the unmodified step its first batch
chose (NOTE [ A capture compiles a schedule that needs one ] in ``remat/sizes.py``). Captured at
whatever shape came second, the dynamic graph can also take a coincidence for a rule (dynamo
gives equal sizes one symbol: a batch of 32 through a layer 32 wide), which a capture of the
user's example rarely does.

NOTE [ Sharing the original's state ]
``RematModule`` registers the *same* child modules, parameters and buffers as the module it
replaces (the dict entries are copied, the objects are shared), so ``state_dict`` keys are
identical, an optimizer created before the swap keeps training the same ``Parameter`` objects,
and ``load_state_dict`` into either module updates both. The original module is kept (not
registered) to be compiled and to serve calls that need no backward (``no_grad``/inference).
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as _checkpoint

from .dynamo_backend import DEFAULT_SOLVER, RematBackend
from .budget import Budget
from .cache import PlanCache
from .calls import PROPAGATED_DIMS, flatten_call, leaf_names, without_view_bases
from .devices import step_device
from .eager_only import EagerOnly, eager_only
from .eager_step import eager_reference, eager_step
from .errors import CaptureError, InfeasibleBudgetError, RematError
from .example_call import example_call_kwargs
from .failures import add_note, capture_error, own_failure
from .frames import (RECOMPILE_LIMIT, capture_config, eager_algorithms, forget_backends, own_step,
                     switched_algorithms)
from .plan import Plan
from .state import preserve_state

__all__ = ["RematModule", "rematerialize"]

log = logging.getLogger(__name__)


# NOTE [ The unmodified step runs eagerly ]
# A batch whose unmodified step fits the budget (a short sequence, a small last batch: a fraction
# follows the run's largest batch) runs the module's own eager step, not a compiled copy of it.
# The copy cost a whole capture (dynamo + AOTAutograd, seconds for a 2-layer GPT-2, minutes for
# a large model), and a batch of 1, which dynamo specialises, cost another capture and a solve:
# the 40-step dynamic-padding test set up in 3.1-3.4x the single-shape time, over the 3x bound.
# Eager gives the same numbers (nothing is recomputed) and is the memory the user measures today.
# Its peak cannot be simulated exactly, so it is priced from the compiled unmodified step's: the
# simulated peak at the batch's sizes times the eager/compiled ratio measured at the example
# (where eager is the leaner, only below the example's peak), plus ``_EAGER_HEADROOM`` for how
# that ratio moves with the sizes (``ShapePlans.eager_peak``); a batch runs eagerly only where
# that fits the budget. Without an eager measurement (``remat.backend``, or a profiler already
# running) the unmodified step stays compiled, with its exact simulated peak.


class RematModule(nn.Module):
    """An ``nn.Module`` equivalent to the one it wraps, with a rematerialized backward.

    Calls with gradients enabled run a compiled schedule; calls without gradients run the
    original module. The graph is captured with the example's shapes, then once with dynamic
    dimensions when other shapes come (NOTE [ Static first ]), and each batch runs the
    fastest schedule that fits the budget at its sizes: see NOTE [ Shape-generic plans ] and
    NOTE [ Later input shapes ] in :mod:`remat.module`. NOTE [ Sharing the original's state ].

    Attributes:
        plan: The :class:`Plan` solved for the example inputs.
        plans: Every plan solved so far (the first, then one per size bucket that needed its own).
        shapes: The :class:`~remat.sizes.ShapePlans`; ``shapes.summary()`` lists every batch
            size seen, the schedule it ran and its predicted peak.
    """

    def __init__(self, module: nn.Module, backend: RematBackend,
                 eager: EagerOnly | None = None, *, dynamic: bool | None = None) -> None:
        super().__init__()
        self._modules.update(module._modules)
        self._parameters.update(module._parameters)
        self._buffers.update(module._buffers)
        self._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        self.training = module.training
        object.__setattr__(self, "_remat_original", module)
        # NOTE [ The algorithm eager runs ]
        object.__setattr__(self, "_remat_switched", switched_algorithms(module))
        object.__setattr__(self, "_remat_backend", backend)
        object.__setattr__(self, "_remat_slots", {})  # schedule entry (or None) -> compiled step
        object.__setattr__(self, "_remat_decisions", {})  # call key -> schedule entry
        # NOTE [ A call runs what its first call ran ]: call keys whose entry is the unmodified
        # step but whose first call ran its compiled copy
        object.__setattr__(self, "_remat_compiled_keys", set())
        # NOTE [ A budget the eager step fits ]: the calls that run eagerly without a capture
        object.__setattr__(self, "_remat_eager", eager)
        # NOTE [ Static first ]: whether the next capture has dynamic dimensions, and whether
        # that changes by itself when a call of other shapes comes (``dynamic=None``)
        object.__setattr__(self, "_remat_dynamic", dynamic is True)
        object.__setattr__(self, "_remat_auto", dynamic is None)
        # NOTE [ Owning the compiled frames ]: dynamo also remembers every backend it was given
        # (for its reset); forget ours with the module so its graphs and plans are freed.
        weakref.finalize(self, forget_backends, self._remat_slots)

    @property
    def original(self) -> nn.Module:
        """The module this one replaces (sharing its parameters and buffers)."""
        return self._remat_original

    @property
    def plans(self) -> list[Plan]:
        eager = self._remat_eager
        return ([] if eager is None else [eager.plan]) + list(self._remat_backend.plans)

    @property
    def graphs(self) -> list:
        """The :class:`~remat.graph.RematGraph` of each plan (for inspection)."""
        return list(self._remat_backend.graphs)

    @property
    def shapes(self):
        """Every schedule and which one each batch size runs (:class:`remat.sizes.ShapePlans`)."""
        return self._remat_backend.shapes

    @property
    def plan(self) -> Plan:
        plans = self.plans
        if not plans:
            raise RuntimeError("no plan yet: call the module once with gradients enabled")
        return plans[0]

    def plan_for(self, budget: str | float | Budget, *, solver: str | None = None) -> Plan | None:
        """The plan a solve of the example's graph under ``budget`` gives, the budget read as
        ``rematerialize(budget=...)`` reads it (of this module's measured eager step); nothing
        is compiled or swapped. ``None`` when no schedule fits. For sharing one step's budget
        among several modules (NOTE [ One step budget over FSDP units ] in
        ``integrations/_fsdp.py``).

        Args:
            budget: As :func:`rematerialize`'s.
            solver: The solver (default: this module's; a module made with ``solver="none"``,
                as :func:`remat.estimate` makes one, needs another).
        """
        from .budget import parse_budget
        from .planner import plan_graph

        backend = self._remat_backend
        if not backend.graphs:
            raise RuntimeError("no captured graph: this module runs its eager step "
                               "(its budget fits it), so it has no other plan")
        try:
            plan, _ = plan_graph(backend.graphs[0], parse_budget(budget),
                                 solver=solver or backend.solver, time_limit=backend.time_limit,
                                 options=backend.options, reference=backend.shapes.reference)
        except InfeasibleBudgetError:
            return None
        return plan

    def train(self, mode: bool = True) -> "RematModule":
        super().train(mode)
        self._remat_original.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Attributes of the original that are not submodules/parameters/buffers
            # (``model.config``, helper methods) read through, as on the original.
            original = self.__dict__.get("_remat_original")
            if original is None:
                raise
            return getattr(original, name)

    def _slot(self, entry: int | None):
        """The compiled step that runs schedule ``entry`` (``None``: whichever the backend
        picks when it compiles; see NOTE [ Owning the compiled frames ])."""
        slots = self._remat_slots
        if entry not in slots:
            backend = self._remat_backend
            slot_backend = functools.partial(backend, request=entry)
            slot_backend.__name__ = "remat_backend"  # type: ignore[attr-defined]
            step = own_step("auto" if entry is None else str(entry + 1))  # numbered as shown
            slots[entry] = (torch.compile(step, backend=slot_backend, fullgraph=True,
                                          dynamic=self._remat_dynamic,
                                          recompile_limit=RECOMPILE_LIMIT,
                                          isolate_recompiles=True), slot_backend, step.__code__)
        return slots[entry][0]

    def _decide(self, leaves: list[Any]) -> tuple[int | None, bool]:
        """Which schedule a call with these inputs runs (NOTE [ Shape-generic plans ]), and
        whether that is settled: an over-budget choice is not (NOTE [ An over-budget choice is
        revisited ] in :mod:`remat.sizes`)."""
        backend = self._remat_backend
        shapes = backend.shapes
        first = shapes.serving
        if first is None:
            return None, True
        if not first.sized.symbols:
            # NOTE [ Static first ]: only static captures so far, and this call is none of
            # theirs (its shapes, dtypes or mode are new): capture it, with dynamic dimensions
            # from now on unless the user asked for static ones.
            if self._remat_auto and not self._remat_dynamic:
                object.__setattr__(self, "_remat_dynamic", True)
                log.info("remat: a call of new shapes; capturing the step once more, with dynamic "
                         "dimensions that serve every later size (NOTE [ Static first ]): "
                         "seconds, inside this step")
            return None, True
        found = shapes.family_for(leaves)
        if found is None:
            log.debug("remat: no captured graph serves this call's sizes; compiling it anew")
            return None, True
        family, sizes = found
        choice = shapes.choose(family.key, sizes)
        return choice.entry, choice.settled

    def _run_compiled(self, entry: int | None, leaves: list[Any], args: tuple,
                      kwargs: dict) -> Any:
        """Run schedule ``entry``'s compiled step (compiling it on first use)."""
        backend = self._remat_backend
        step = self._slot(entry)
        args, kwargs, leaves = without_view_bases(args, kwargs, leaves)
        backend.current_leaves = leaves
        # NOTE [ Naming sizes ]: read only when the step is compiled
        backend.current_names = functools.partial(leaf_names, self._remat_original, args, kwargs)
        unmarked = [x for x in leaves if isinstance(x, torch.Tensor)
                    and not hasattr(x, PROPAGATED_DIMS)]
        try:
            # NOTE [ Log calls inside the captured forward ], NOTE [ Floats are constants of
            # the capture ]
            with capture_config(leaves), eager_algorithms(self._remat_switched):
                return step(self._remat_original, args, kwargs)
        finally:
            backend.current_leaves = []
            backend.current_names = None
            for x in unmarked:  # NOTE [ The user's tensors leave as they came ]
                if hasattr(x, PROPAGATED_DIMS):
                    delattr(x, PROPAGATED_DIMS)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Frameworks set ``.training`` on every registered submodule directly (Lightning after
        # validation); the original is not registered, so copy the flag here.
        if self._remat_original.training != self.training:
            self._remat_original.training = self.training
        if not torch.is_grad_enabled():
            return self._remat_original(*args, **kwargs)
        leaves, key = flatten_call(args, kwargs)
        backend = self._remat_backend
        eager_only = self._remat_eager
        if eager_only is not None and not backend.shapes.families:
            if eager_only.covers(key[0], leaves):  # NOTE [ A budget the eager step fits ]
                return self._remat_original(*args, **kwargs)
            self._measure_before_capture(args, kwargs, key[0])
        key = (self.training, key)
        decisions = self._remat_decisions
        try:
            entry, settled = (decisions[key], True) if key in decisions else self._decide(leaves)
            eager = entry is not None and backend.shapes.entries[entry].eager \
                and key not in self._remat_compiled_keys
            out = None if eager else self._run_compiled(entry, leaves, args, kwargs)
        except (RematError, *_CONTROL_FLOW):
            raise
        except Exception as exc:  # noqa: BLE001 - dynamo/AOT failures become CaptureError
            error = capture_error(exc)
            if error is getattr(exc, "inner_exception", None):
                raise error.with_traceback(None) from None  # our own error, raised in the backend
            own = own_failure(self._remat_original, args, kwargs, exc)
            if own is not None:  # NOTE [ The user's own exceptions ]
                raise own from None
            raise error from exc
        if eager:
            decisions.setdefault(key, entry)  # NOTE [ The unmodified step runs eagerly ]
            return self._remat_original(*args, **kwargs)  # the model's own errors, as they are
        if entry is None and backend.last_entry is not None:
            # The step compiled for "whichever fits" now runs a known schedule: file it there.
            entry = backend.last_entry
            slots = self._remat_slots
            compiled, slot_backend, code = slots.pop(None)
            slot_backend.keywords["request"] = entry
            if entry in slots:  # already compiled for this schedule: keep both, free both later
                slots[("auto", id(code))] = (compiled, slot_backend, code)
            else:
                slots[entry] = (compiled, slot_backend, code)
            if backend.shapes.entries[entry].eager:
                self._remat_compiled_keys.add(key)  # NOTE [ A call runs what its first call ran ]
        if settled:
            decisions.setdefault(key, entry)
        return out

    # NOTE [ A call runs what its first call ran ]
    # A call that captures a new graph runs the compiled step it captured, whichever schedule it
    # is filed under; when that is the unmodified step, which later calls of those sizes run
    # eagerly (NOTE [ The unmodified step runs eagerly ]), calls of the same shapes keep running
    # the compiled copy instead. Otherwise a layer under ``torch.utils.checkpoint`` (FSDP2 units
    # that keep only their inputs: NOTE [ One step budget over FSDP units ]) met a new shape in
    # forward, ran the compiled unmodified step, and was recomputed in backward by the eager
    # step, whose saved tensors differ: ``CheckpointError: Recomputed values ... have different
    # metadata``, and the rank died (a 20-step dynamic-padding run under Lightning's FSDP2).

    def _measure_before_capture(self, args: tuple, kwargs: dict, spec: str) -> None:
        """NOTE [ A budget the eager step fits ]: a batch larger than the example is captured
        now, inside its step. The example's eager step stays the reference, at the example's
        sizes (the backend prices the captured step there), and where the new sizes' unmodified
        step would not fit the budget their ops are measured one at a time (NOTE [ Measuring
        ops one at a time ] in :mod:`remat.costs`): running that step, or the larger eager step
        to measure it, peaked at 1.48-1.57x a "3MiB" or "4MiB" budget in a Lightning run whose
        first batch was small."""
        from torch.utils._pytree import tree_flatten

        backend = self._remat_backend
        if self._remat_auto:  # NOTE [ Static first ]: this run's shapes vary
            object.__setattr__(self, "_remat_dynamic", True)
        sizes = [tuple(x.shape) for x in tree_flatten((args, kwargs))[0]
                 if isinstance(x, torch.Tensor)]
        warnings.warn(
            f"remat: a batch larger than the example (tensor shapes {sizes}) needs a schedule; "
            f"the example's eager step fit the budget {backend.budget}, so nothing was captured "
            "then: capturing and solving now, inside this step (seconds), measuring its ops one "
            "at a time where its unmodified step would not fit the budget. Pass your largest "
            "batch as the example to do this at setup.",
            stacklevel=3)
        if spec == self._remat_eager.spec:
            backend.eager_shapes = [leaf[1] if leaf[0] == "tensor" else None
                                    for leaf in self._remat_eager.leaves]
            return
        # Another call structure: the example's sizes say nothing of this one; its eager step
        # is measured (the rest of the step charged in proportion).
        if torch._C._autograd._profiler_enabled():
            return  # track_memory cannot measure inside a profiler: the example's figures stay
        eager, outside = backend.eager
        try:
            now = eager_step(self._remat_original, args, kwargs)[0]
        except Exception as exc:  # noqa: BLE001 - NOTE [ The user's own exceptions ]
            add_note(exc, f"hiremate: raised by {type(self._remat_original).__name__}'s own "
                          "training step, run eagerly without remat to measure it before this "
                          "batch is captured, so it is not a remat failure: fix the model or "
                          "its inputs")
            raise
        backend.eager = (now, round(outside * now / max(eager, 1)))

    def capture(self, *args: Any, **kwargs: Any) -> Plan:
        """Compile and solve for these inputs without changing any state (buffers, RNG)."""
        before = len(self._remat_backend.plans)
        with preserve_state(self._remat_original), torch.enable_grad():
            out = self.forward(*args, **kwargs)
        del out
        if len(self._remat_backend.plans) == before and not self._remat_backend.plans:
            raise CaptureError(
                "nothing to rematerialize: no parameter or input of the example call requires "
                "grad, so there is no backward. Call rematerialize on a module in training "
                "with parameters that require grad.",
                reason="no_grad",
            )
        return self._remat_backend.plans[-1]

    def extra_repr(self) -> str:
        b = self._remat_backend
        return f"budget={b.budget}, solver={b.solver!r}"


def rematerialize(
    module: nn.Module,
    *example_args: Any,
    budget: str | float | int | Budget = "70%",
    solver: str = DEFAULT_SOLVER,
    time_limit: float = 60.0,
    measure: bool = True,
    options: dict | None = None,
    cache: PlanCache | str | bool | None = True,
    eager_peak_bytes: int | None = None,
    step_peak_bytes: int | None = None,
    dynamic: bool | None = None,
    example_kwargs: dict[str, Any] | None = None,
    **call_kwargs: Any,
) -> RematModule:
    """Return an equivalent module whose training step keeps activation memory under ``budget``.

    The module is captured on the example inputs as one joint forward+backward graph
    (dynamo + AOTAutograd), each op is timed on them, a schedule that fits the budget with the
    least recomputation is solved, and the result is compiled. Gradients are exactly the
    original module's (random ops are never re-drawn; BatchNorm statistics are updated once).
    Papers: Rockmate (Zhao et al., ICML 2023), HiRemate (Gusak et al., ICML 2025), Checkmate
    (Jain et al., MLSys 2020).

    Args:
        module: The network to wrap (an ``nn.Module`` in the mode it will train in).
        *example_args: A real example batch, as positional arguments of ``module``.
        budget: Memory budget of the training step: ``"70%"``/``0.7`` of the peak the eager
            step measures on the example batch, or bytes of that peak, with a unit (``"6GiB"``,
            ``"512MB"``); see NOTE [ A budget is what the user measures ] and NOTE [ A bare
            number is a fraction ].
        solver: One of ``remat.SOLVERS``.
        time_limit: Seconds the solver may spend; the best schedule found by then is used.
        measure: Time ops on the example (default) or model them from FLOPs and bytes.
        options: Solver-specific options.
        cache: Where solved schedules are kept: ``True`` (default) in the user's cache
            directory, so every run of this model, batch and budget on this machine runs the
            same schedule (NOTE [ The same plan every run ] in :mod:`remat.cache`;
            ``HIREMATE_CACHE_DIR`` moves it, ``HIREMATE_CACHE_DIR=off`` turns it off); a
            directory or a :class:`remat.PlanCache`; ``False`` for none. A graph solved before
            with the same settings is not solved again.
        eager_peak_bytes: The module's eager step peak on the example, if already measured
            (:func:`measure_eager_step`); measured here when ``None``.
        step_peak_bytes: The measured eager peak of the whole training step the module runs
            in, when part of the step is outside it (a loss head): percentages are of it, and
            what it adds to the module's peak is charged against the budget.
        dynamic: ``None`` (default) captures the example's shapes, as ``torch.compile`` does
            by default (a 4-layer GPT's setup 11.5 -> 8.3 s against ``True``), and when a call
            of other sizes comes captures once more with dynamic dimensions, taking the first
            capture's op costs and, where the graphs match op for op, its schedule (a varying
            run pays that second capture: 15.3 s against 12.7 s over a 40-step dynamic-padding
            run); ``True`` captures with dynamic dimensions at once, one graph for every batch
            size and length; ``False`` captures every new shape on its own. See NOTE [ Static
            first ].
        example_kwargs: Keyword arguments of the example call, as a dict: for a module whose
            forward takes a name that is also one of these options (``cache``, ``budget``...),
            which would otherwise go to remat (NOTE [ Options that share a name with the
            model's ]).
        **call_kwargs: Keyword arguments of the example call.

    Returns:
        A :class:`RematModule` sharing ``module``'s parameters and buffers; ``.plan`` says what
        was decided.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: for a malformed budget, solver name or time limit; for a parameter, buffer
            or input on the meta device or a device other than the CPU and CUDA (before
            anything is measured: NOTE [ Devices remat can run on ] in :mod:`remat.devices`).
        CaptureError: if the model cannot be captured as one graph (graph break, data-dependent
            control flow, unsupported op) — the message names the reason and the workaround.
        Exception: whatever the module's own forward or backward raises on the example inputs
            without remat (a ``ValueError`` for a wrong shape), with its own type and traceback
            and a note saying where it was raised (NOTE [ The user's own exceptions ] in
            :mod:`remat.failures`); later calls of the returned module do the same.
        InfeasibleBudgetError: if no schedule fits the budget (it gives the lowest feasible peak).

    Example:
        >>> net = remat.rematerialize(net, x, budget="50%")
        >>> net(x).sum().backward()      # same gradients, smaller activation peak
        >>> print(net.plan.summary())
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"rematerialize(module=...): expected an nn.Module, got "
                        f"{type(module).__name__}; pass the network itself, e.g. "
                        "rematerialize(model, batch)")
    if isinstance(module, RematModule):
        raise TypeError("rematerialize(module=...): this module is already a RematModule; pass "
                        "its .original to solve again with other settings")
    given = {"budget": budget, "solver": solver, "time_limit": time_limit, "measure": measure,
             "options": options, "cache": cache, "eager_peak_bytes": eager_peak_bytes,
             "step_peak_bytes": step_peak_bytes, "dynamic": dynamic}
    if dynamic not in (None, True, False):
        raise TypeError(f"rematerialize(dynamic={dynamic!r}): expected None (static shapes "
                        "first, dynamic ones once shapes vary), True or False")
    example_kwargs = example_call_kwargs(module, "rematerialize", given, _DEFAULTS,
                                         example_kwargs, call_kwargs)
    backend = RematBackend(budget, solver=solver, time_limit=time_limit, measure=measure,
                           options=options, cache=cache)
    step_device(module, example_args, example_kwargs)  # NOTE [ Devices remat can run on ]
    backend.eager = eager_reference(module, example_args, example_kwargs, eager_peak_bytes,
                                     step_peak_bytes)
    leaves, (spec, _) = flatten_call(example_args, example_kwargs)
    eager = eager_only(backend.budget, solver, backend.eager, spec, leaves)
    if eager is not None:  # NOTE [ A budget the eager step fits ]
        backend.pin(eager.plan)
        return RematModule(module, backend, eager, dynamic=dynamic)
    rm = RematModule(module, backend, dynamic=dynamic)
    plan = rm.capture(*example_args, **example_kwargs)
    rm._remat_backend.pin(plan)  # NOTE [ Later input shapes ]
    return rm


# Exceptions that are torch's control flow, not failures: non-reentrant ``torch.utils.checkpoint``
# around a RematModule stops its recomputation early by raising one through the forward.
_CONTROL_FLOW: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(_checkpoint, "_StopRecomputationError", None),) if t)


# rematerialize's own options and their defaults, read from its signature
_DEFAULTS = {name: p.default for name, p in inspect.signature(rematerialize).parameters.items()
             if p.kind is p.KEYWORD_ONLY and name != "example_kwargs"}


