"""What an FSDP2 training step peaks at, from what each unit's plan holds and peaks at: the
model that :func:`integrations._fsdp.share_step_budget` searches with, and the marks that measure
its three phases on a real step. Framework-free (torch only).

NOTE [ The step's peak over a chain of units ]
    Unit ``i`` holds its input activations ``x_i`` and what its plan saves ``S_i`` (a
    checkpointed unit: ``x_i`` alone) from its forward to its backward, and peaks at ``P_i +
    x_i`` while its backward runs (``P_i``, its own schedule's peak, leaves its inputs out).
    The step has three moments, each measured on the warmup step by marks where the gradient
    reaches each unit's output and input (:func:`step_phases`):
    - forward and loss head, up to the gradient reaching the last unit: every unit holds what
      it saved, ``F + sum(held_i)``;
    - the units' backward, the last first: unit ``i`` runs while the units before it still
      hold theirs, those after it have freed theirs but keep their reduced gradients ``G_j``
      (this rank's shard), and the next unit's unsharded gradients ``U_{i+1}`` are still being
      reduced: ``B + max_i(sum_{j<i} held_j + P_i + x_i + sum_{j>i} G_j + U_{i+1})``;
    - after the first unit (the embedding's backward): ``T``, whatever the units run.
    ``F``, ``B`` and ``T`` (the loss head, gathered parameters, FSDP's buffers) come from the
    unmodified step's measured phases, so the model predicts that step exactly. Each term was
    read off the measured stretches between marks: on a 4-layer Llama (one rank) with three
    units checkpointed, the last unit's backward measured what the model said and every other
    one 0.79 MB more, a unit's unsharded gradients, until ``U_{i+1}`` was added. On a 12-layer
    Llama (2 gloo ranks) the unmodified step peaks in the loss head (38.0 MB; the units'
    backward 36.9 MB); at 30% the peak moves to the second unit's backward, where ten units'
    gradients are kept. Predicted against measured: 17.25 against 17.29 MB at 50%, 11.76
    against 11.59 at checkpoint_wrapper's peak; the 4-layer Llama at 50/60/70% of its step
    4.7%/4.0% over and 0.1% under (the units' own schedules predict their peaks high), each
    planned once where the first plan had missed before ``U`` was in. The model it replaces,
    ``R + sum(S_i) + max(P_i - S_i)`` with one ``R`` from the whole eager step, held every
    unit's saved values at the largest unit's backward and missed the inputs and gradients:
    17.58 predicted for 14.02 MB measured at 50%, so it checkpointed 9 of 12 units where 8 fit.
    A trial over the budget calibrates the model again on its own phases (also when nothing
    seemed to fit: at 30% the lowest plan predicted 10.62 MB and measured 10.50, and the next
    round found 0.272 of the step). What FSDP holds beyond the model on other steps (buffers
    gloo releases late: NOTE [ Buffers gloo's workers release late ] in
    ``integrations/_fsdp.py``) is what the trial and
    its headroom are for. Without marks (a step whose units' outputs need no gradient), the
    looser model is used.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat.memory import MemoryTracker, open_tracker

__all__ = ["StepModel", "StepPhases", "activation_bytes", "gradient_bytes", "step_phases"]


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """The unmodified step's measured peak in each of its three phases, cut where the gradient
    reaches the last unit's output and where it reaches the first unit's input.

    Attributes:
        forward_bytes: The peak up to the first cut: the units' forwards and the loss head,
            while every unit holds what it saved.
        backward_bytes: The peak from then until the gradient reaches the first unit's input:
            the units' backwards, the last unit first.
        tail_bytes: The peak after (the layers before the first unit, their gradients).
    """

    forward_bytes: int
    backward_bytes: int
    tail_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StepModel:
    """The step's predicted peak from each unit's ``(peak, saved)``, in the order the units run
    (NOTE [ The step's peak over a chain of units ]).

    Attributes:
        forward_rest: What the step holds beside the units' saved values when its forward and
            loss head peak (``None``: the phases were not measured).
        backward_rest: What it holds beside the units while their backward peaks; without
            phases, beside every unit's saved values and the largest unit's extra.
        tail: The peak after the units' backward (the same whatever they run).
        grads: Each unit's gradient bytes on this rank: ``(kept, reducing)``, its shard, which
            stays once its backward has reduced it, and the whole unsharded gradients while
            the reduce-scatter runs.
    """

    forward_rest: int | None
    backward_rest: int
    tail: int = 0
    grads: tuple[tuple[int, int], ...] = ()

    @classmethod
    def calibrated(cls, eager: Sequence[tuple[int, int]], eager_step_bytes: int,
                   phases: StepPhases | None,
                   grads: Sequence[tuple[int, int]] = ()) -> StepModel:
        """The model whose prediction for the unmodified units' ``eager`` sizes is the measured
        step (each phase's peak, when measured)."""
        if phases is None:
            return cls(None, eager_step_bytes - _all_held(eager))
        grads = tuple(grads) or ((0, 0),) * len(eager)
        return cls(phases.forward_bytes - sum(saved for _, saved in eager),
                   phases.backward_bytes - _in_order(eager, grads), phases.tail_bytes, grads)

    def __call__(self, units: Sequence[tuple[int, int]]) -> int:
        if self.forward_rest is None:
            return self.backward_rest + _all_held(units)
        return max(self.forward_rest + sum(saved for _, saved in units),
                   self.backward_rest + _in_order(units, self.grads), self.tail)


def _all_held(units: Sequence[tuple[int, int]]) -> int:
    """``sum(saved) + max(peak - saved)``: every unit's saved values held while the largest
    extra runs (the bound without phases)."""
    if not units:
        return 0
    return sum(saved for _, saved in units) + max(peak - saved for peak, saved in units)


def _in_order(units: Sequence[tuple[int, int]], grads: Sequence[tuple[int, int]]) -> int:
    """``max_i(sum(held_j, j < i) + peak_i + sum(kept_j, j > i) + reducing_{i+1})``: a unit's
    backward runs while the units before it still hold what they saved, those after it have
    freed that and keep their gradients' shards, and the next one's unsharded gradients are
    still being reduced."""
    top, held, after = 0, 0, sum(kept for kept, _ in grads)
    for i, ((peak, saved), (kept, _)) in enumerate(zip(units, grads, strict=True)):
        after -= kept
        reducing = grads[i + 1][1] if i + 1 < len(grads) else 0
        top = max(top, held + peak + after + reducing)
        held += saved
    return top


@contextlib.contextmanager
def step_phases(units: Sequence[nn.Module]) -> Iterator[_Phases]:
    """Inside a measured step (a :func:`remat.track_memory` block open when the units run),
    mark where the gradient reaches each unit's output and input; yields what is filled once
    that block exits (:attr:`_Phases.measured`)."""
    found = _Phases()

    def mark(kind: str) -> None:
        tracker = open_tracker()
        if tracker is None or found.tracker not in (None, tracker):
            return
        found.tracker = tracker
        found.marks.append((kind, tracker.mark()))

    def on_gradient(values: Any, kind: str) -> None:
        x = next((t for t in tree_leaves(values)
                  if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if x is not None:
            x.register_hook(lambda grad: mark(kind))

    handles = []
    for unit in units:
        handles.append(unit.register_forward_pre_hook(
            lambda module, args, kwargs: on_gradient((args, kwargs), "input"), with_kwargs=True))
        handles.append(unit.register_forward_hook(
            lambda module, args, output: on_gradient(output, "output")))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass
class _Phases:
    tracker: MemoryTracker | None = None
    marks: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (kind, index)

    @property
    def measured(self) -> StepPhases | None:
        """The phases, once the tracker's block has exited (``None``: not measured)."""
        tracker, marks = self.tracker, self.marks
        outputs = [k for kind, k in marks if kind == "output"]
        inputs = [k for kind, k in marks if kind == "input"]
        if tracker is None or not outputs or not inputs or len(tracker.peaks) <= marks[-1][1]:
            return None
        # peaks[k] ends at mark k; the first unit's input gets its gradient last
        first, last = outputs[0], inputs[-1]
        peaks = tracker.peaks
        return StepPhases(max(peaks[:first + 1]), max(peaks[first + 1:last + 1], default=0),
                          max(peaks[last + 1:]))


def activation_bytes(call: tuple[tuple, dict]) -> int:
    """The bytes of the tensors a unit is called with that need a gradient (its input
    activations, counted once by storage; masks and rotary tables are shared by every unit)."""
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                for x in tree_leaves(call) if isinstance(x, torch.Tensor) and x.requires_grad}
    return sum(storages.values())


def gradient_bytes(unit: nn.Module) -> tuple[int, int]:
    """The bytes of ``unit``'s gradients on this rank: its parameters' local shards, and the
    whole parameters (a DTensor's shape is the whole tensor's)."""
    trained = [p for p in unit.parameters() if p.requires_grad]
    local = [getattr(p, "_local_tensor", p) for p in trained]
    return (sum(t.numel() * t.element_size() for t in local),
            sum(p.numel() * p.element_size() for p in trained))
