"""``estimate``: how much memory a training step needs, and how low remat could take it."""
from __future__ import annotations

from dataclasses import dataclass
import warnings
from typing import Any

import torch.nn as nn

from .budget import NO_LIMIT, format_bytes

__all__ = ["MemoryReport", "estimate"]


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one training step of a module on an example batch.

    Attributes:
        parameter_bytes: Parameters and buffers (exist before the step).
        gradient_bytes: Gradients of the trainable parameters (produced by the step; part of
            the activation peak).
        activation_peak_bytes: Peak of everything the unmodified (compiled, save-everything) step
            allocates: saved activations, temporaries, outputs, gradients.
        lowest_peak_bytes: No schedule can go below this peak: the lowest budget the graph
            allows (in bytes).
        num_ops: Ops in the joint forward+backward graph.
        eager_peak_bytes: Measured peak of the eager step, what a percentage budget is of
            (NOTE [ A budget is what the user measures ]); ``0`` when it could not be measured.
    """

    parameter_bytes: int
    gradient_bytes: int
    activation_peak_bytes: int
    lowest_peak_bytes: int
    num_ops: int
    eager_peak_bytes: int = 0

    @property
    def lowest_budget_fraction(self) -> float:
        """The lowest peak as a budget fraction (of the eager step when it was measured)."""
        return self.lowest_peak_bytes / max(self.eager_peak_bytes or self.activation_peak_bytes, 1)

    def summary(self) -> str:
        rows = [
            ("parameters + buffers", format_bytes(self.parameter_bytes)),
            ("parameter gradients", format_bytes(self.gradient_bytes)),
            *([("eager step peak (measured)", format_bytes(self.eager_peak_bytes))]
              if self.eager_peak_bytes else []),
            ("compiled step peak", format_bytes(self.activation_peak_bytes)),
            ("lowest possible peak", f"{format_bytes(self.lowest_peak_bytes)} "
                                     f"({100 * self.lowest_budget_fraction:.0f}% of the "
                                     f"{'eager ' if self.eager_peak_bytes else ''}step)"),
            ("joint graph ops", str(self.num_ops)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def estimate(module: nn.Module, *example_args: Any, example_kwargs: dict[str, Any] | None = None,
             **call_kwargs: Any) -> MemoryReport:
    """Report the memory of one training step without training (and without changing state).

    Captures and profiles the step exactly like :func:`remat.rematerialize` (so capture errors
    are the same), but solves nothing.

    Args:
        module: The network, in the mode it will train in.
        *example_args: A real example batch.
        example_kwargs: Keyword arguments of the example call, as a dict (for names such as
            ``example_kwargs`` itself; NOTE [ Options that share a name with the model's ] in
            :mod:`remat.example_call`).
        **call_kwargs: Keyword arguments of the example call.

    Returns:
        A :class:`MemoryReport`; ``print(report.summary())`` for a table.

    Raises:
        ValueError: a parameter, buffer or input on the meta device or a device other than the
            CPU and CUDA (NOTE [ Devices remat can run on ] in :mod:`remat.devices`).
        CaptureError: as :func:`remat.rematerialize`; the module's own exceptions propagate
            with a note (NOTE [ The user's own exceptions ] in :mod:`remat.failures`).

    Example:
        >>> print(remat.estimate(model, batch).summary())
    """
    from .devices import step_device
    from .example_call import OWN_OPTION_WARNING, example_call_kwargs
    from .module import rematerialize

    example_kwargs = example_call_kwargs(module, "estimate", {}, {}, example_kwargs, call_kwargs)

    step_device(module, example_args, example_kwargs, owner="estimate")  # before measuring
    # No limit: the unmodified step is what is reported (a percentage could be below it).
    with warnings.catch_warnings():  # the options are estimate's, not the user's
        warnings.filterwarnings("ignore", message=OWN_OPTION_WARNING, category=UserWarning)
        rm = rematerialize(module, *example_args, budget=NO_LIMIT, solver="none",
                           example_kwargs=example_kwargs)
    plan = rm.plan
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    params += sum(b.numel() * b.element_size() for b in module.buffers())
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return MemoryReport(
        parameter_bytes=params,
        gradient_bytes=grads,
        activation_peak_bytes=plan.baseline_bytes,
        lowest_peak_bytes=plan.lower_bound_bytes,
        num_ops=plan.num_ops,
        eager_peak_bytes=plan.eager_bytes,
    )
