"""A budget the eager step already fits: nothing to capture, nothing to solve.

NOTE [ A budget the eager step fits ]
A budget at or above the peak the user's eager step measures on the example batch (``"100%"``,
or bytes above it: ``"6GiB"`` for a 120 MiB step) asks remat to save nothing. Capturing anyway
cost the whole setup (28 s on a small encoder) and then ran the compiled unmodified step,
which can be fatter than eager (AOTAutograd's zero gradients for outputs nobody reads, copies
the capture keeps): 1.154x eager's peak for a byte budget 50x above it. So ``rematerialize``
captures nothing and the module runs as it is, measured:

* a fraction of 1 follows the run's largest eager peak (NOTE [ Budgets over many sizes ]), which
  every eager step fits by definition: every batch runs eagerly;
* a byte budget holds for every size, and the eager step was measured at the example only: a
  batch no larger than the example in any dimension (same structure, dtypes and devices, the
  same non-tensor arguments) runs eagerly, as its step needs no more memory; the first larger
  one is captured and solved then, inside that step, after a warning that says so (pass the
  largest batch as the example to have that happen at setup).

``solver="none"`` asks for the captured step itself (a diagnostic, a benchmark row) and is
captured as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .budget import Budget, format_bytes
from .plan import Plan

__all__ = ["EagerOnly", "eager_only"]


@dataclass(frozen=True)
class EagerOnly:
    """Which calls run the module's own eager step (NOTE [ A budget the eager step fits ]).

    Attributes:
        plan: What was decided for the example, in a :class:`Plan`.
        spec: The example call's pytree structure; ``None``: every call runs eagerly.
        leaves: Per leaf of the example call, ``("tensor", shape, dtype, device, requires_grad)``
            or ``("value", value)``.
    """

    plan: Plan
    spec: str | None
    leaves: tuple[tuple, ...] = ()

    def covers(self, spec: str, leaves: Sequence[Any]) -> bool:
        """Whether a call with these leaves needs no more memory than the example's."""
        if self.spec is None:
            return True
        if spec != self.spec or len(leaves) != len(self.leaves):
            return False
        for leaf, bound in zip(leaves, self.leaves):
            if bound[0] == "value":
                if isinstance(leaf, torch.Tensor) or leaf != bound[1]:
                    return False
            elif not isinstance(leaf, torch.Tensor) or leaf.dim() != len(bound[1]) or \
                    (leaf.dtype, leaf.device, leaf.requires_grad) != bound[2:] or \
                    any(n > m for n, m in zip(leaf.shape, bound[1])):
                return False
        return True


def eager_only(budget: Budget, solver: str, reference: tuple[int, int] | None, spec: str,
               leaves: Sequence[Any]) -> EagerOnly | None:
    """An :class:`EagerOnly` when ``budget`` covers the measured eager step ``reference``
    (``(module's eager peak, what the rest of the step adds)``) of the call with ``leaves``;
    ``None`` when the module is to be captured."""
    if reference is None or solver == "none":
        return None
    eager, outside = reference
    step = eager + outside
    if budget.fraction is not None:
        if budget.fraction < 1.0:
            return None
        spec, bounds, allowed = None, (), int(step)
        reach = "every batch runs the module as it is (the budget follows its peak)"
    else:
        if budget.bytes < step:
            return None
        bounds = tuple(("tensor", tuple(x.shape), x.dtype, x.device, x.requires_grad)
                       if isinstance(x, torch.Tensor) else ("value", x) for x in leaves)
        allowed = int(budget.bytes)
        reach = ("batches no larger than the example run the module as it is; the first larger "
                 "one is captured then")
    plan = Plan(baseline_bytes=eager, budget_bytes=int(allowed - outside),
                predicted_peak_bytes=eager, predicted_overhead=0.0, solver=solver,
                status="eager", solve_time_s=0.0, eager_bytes=eager, outside_bytes=outside,
                fingerprint="eager",
                detail=f"the eager step's measured peak, {format_bytes(step)}, fits the budget "
                       f"{budget}: nothing captured; {reach}")
    return EagerOnly(plan, spec, bounds)
