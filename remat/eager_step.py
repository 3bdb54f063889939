"""The eager training step a budget is a share of: measured as the user runs it.

NOTE [ A budget is what the user measures ] (``remat/budget.py``) says why; this module measures
it (:func:`measure_eager_step`) and turns it into the reference a plan is held to
(:func:`eager_reference`, with NOTE [ The loss head's pulse ] and NOTE [ The loss outside the
module ]).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.nn as nn

from .budget import format_bytes
from .devices import device_mismatch, step_device
from .failures import add_note
from .state import preserve_state

__all__ = ["eager_reference", "eager_step", "measure_eager_step"]


def _differentiable(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors in ``out`` that require grad."""
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten(out)[0]
    if len(leaves) == 1 and not isinstance(leaves[0], torch.Tensor) and hasattr(out, "values"):
        leaves = tree_flatten(list(out.values()))[0]  # a mapping pytree does not know
    elif len(leaves) == 1 and dataclasses.is_dataclass(leaves[0]):  # nor a dataclass
        leaves = tree_flatten([getattr(out, f.name) for f in dataclasses.fields(out)])[0]
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]


def _backward_root(out: Any) -> tuple[torch.Tensor | None, bool]:
    """What a training step differentiates in ``out``, and whether that is the module's own
    loss: its scalar losses when it has any (a Hugging Face model called with labels), else the
    sum of every differentiable output (each output's gradient is then a fresh tensor the
    backward frees after its last use, as a loss outside the module makes it; ones held by the
    caller through the backward would not be)."""
    tensors = _differentiable(out)
    losses = [t for t in tensors if t.dim() == 0]
    parts = losses or [t.mul(1.0).sum() for t in tensors]
    return (sum(parts[1:], parts[0]) if parts else None), bool(losses)


def measure_eager_step(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    """Measure the peak memory of ``module``'s eager training step on this batch.

    The step is what a user's training step does with the module: the forward, then the
    backward of its scalar losses, the rest of its outputs dropped (``model(**batch).loss
    .backward()``, a Lightning ``training_step`` returning ``out.loss``); when it returns no
    scalar, the backward of the sum of every differentiable output while the outputs are held
    (as a loss outside the module holds them). It is measured the way a user measures it (the
    CUDA allocator's peak; the CPU allocator's events). Nothing changes: buffers, RNG streams
    and ``.grad`` are as before. This is what a percentage budget is a percentage of (NOTE [ A
    budget is what the user measures ] in :mod:`remat.budget`).

    Returns:
        Peak bytes allocated during the step above what was live before it.

    Raises:
        ValueError: a parameter, buffer or input on the meta device or another device than the
            CPU and CUDA (NOTE [ Devices remat can run on ] in :mod:`remat.devices`).
        RuntimeError: on CPU inside another ``torch.profiler`` session (see :func:`track_memory`).

    Example:
        >>> remat.measure_eager_step(model, batch)  # doctest: +SKIP
        153092096
    """
    step_device(module, args, kwargs, owner="measure_eager_step")
    return eager_step(module, args, kwargs)[0]


def eager_step(module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """:func:`measure_eager_step`'s ``(peak, held when the forward returns, bytes of the
    differentiable outputs a loss outside reads: none but the loss when the module returns its
    own)``; the last two place the loss head (NOTE [ The loss head's pulse ])."""
    from .memory import track_memory

    device = step_device(module, args, kwargs)  # checked by the caller: no error from here
    with preserve_state(module), torch.enable_grad():
        with track_memory(device) as memory:
            out = module(*args, **kwargs)
            memory.mark()
            root, own_loss = _backward_root(out)
            outputs = sum(t.numel() * t.element_size() for t in _differentiable(out))
            if own_loss:  # ``model(**batch).loss.backward()``: the logits are not held
                outputs = root.numel() * root.element_size()  # the gradient it receives
                del out
                out = None
            if root is not None:  # otherwise the caller holds ``out`` through it
                root.backward()
            del out, root
    return memory.peak_bytes, memory.marks[0], outputs


# NOTE [ The loss outside the module ]: outputs this large next to the module's eager step (a
# loss head over them can add as much again: an nn.TransformerEncoder with cross-entropy outside
# measured 1.154x its budget at "50%", a weight-tied LM 1.251x) get a warning when the whole
# step's peak was not given.
_UNSEEN_OUTPUTS = 0.01


def eager_reference(module: nn.Module, args: tuple, kwargs: dict, eager: int | None,
                    step: int | None) -> tuple[int, int] | None:
    """``(eager_bytes, outside_bytes)`` for NOTE [ A budget is what the user measures ], with
    ``eager_bytes + outside_bytes`` the whole step and ``outside_bytes`` what is charged for the
    rest of it (NOTE [ The loss head's pulse ]).

    NOTE [ The loss head's pulse ]
    Memory outside the module (a loss head over the logits) lives between the module's forward
    and its backward: the loss's activations and the gradient it hands back. The measured step
    peak P is then ``max(M + u, F + u + L)`` for the module's own eager peak M, the bytes F it
    holds when its forward returns, memory u held outside all along and the loss head's pulse L.
    Only P, M and F are known, so when the step measures more than the module (P > M) both
    ``u <= P - M`` and ``L <= P - F - u`` are taken at their worst: a schedule peaking at M' and
    holding F' <= M' - T at the boundary (T: bytes of the output gradients it receives) peaks in
    the step at most ``M' + max(P - M, P - F - T)``, which is what is charged. Charging only
    ``P - M`` missed by the loss head's share of the boundary: a weight-tied LM with its
    cross-entropy outside at "70%" measured 0.717 of eager's step, as the compiled backward's
    first ops need less than eager's and the schedule meets the pulse there.
    When P <= M nothing suggests a pulse and the (signed) difference is used: a step that drops
    outputs the module returns is leaner than the module alone.
    """
    for name, value in (("eager_peak_bytes", eager), ("step_peak_bytes", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):
            raise ValueError(f"rematerialize({name}={value!r}): expected a positive int number "
                             "of bytes measured on the eager step, or None")
    held = outputs = None
    if eager is None or (step is not None and step > eager):
        try:
            measured, held, outputs = eager_step(module, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the model's own, re-raised with a note
            if isinstance(exc, RuntimeError) and torch._C._autograd._profiler_enabled():
                # A profiler session is running (CPU): track_memory cannot measure inside it.
                warnings.warn(f"remat: cannot measure the eager step ({exc}); the budget applies "
                              "to the captured step's unmodified peak instead", stacklevel=3)
                return None
            # NOTE [ The user's own exceptions ]: the devices were checked, so this is the
            # model's own step failing as it does without remat; the capture would too.
            mismatch = device_mismatch(module, args, kwargs)
            fix = ("measure it on a smaller example batch, or pass eager_peak_bytes= measured "
                   "another way" if isinstance(exc, torch.OutOfMemoryError) else
                   "fix the model or the example inputs")
            add_note(exc, f"hiremate: raised by {type(module).__name__}'s own training step "
                           "(forward and backward, run eagerly without remat on the example "
                           "inputs: rematerialize measures it before capturing, as a budget is a "
                           f"share of its peak), so it is not a remat failure: {fix}"
                           + (f". Note that {mismatch}" if mismatch else ""))
            raise
        eager = measured if eager is None else eager
        if eager <= 0:
            return None
    if step is None:
        if outputs is not None and outputs >= _UNSEEN_OUTPUTS * eager:
            warnings.warn(
                f"remat: {type(module).__name__} returns {format_bytes(outputs)} of outputs "
                f"({100 * outputs / eager:.0f}% of its eager step's {format_bytes(eager)}) and no "
                "loss of its own: the loss your training step computes from them is outside "
                "the module, and its memory is in no budget. Measure the whole step and pass "
                "it: `with remat.track_memory() as m: loss_fn(model(*batch)).backward()`, then "
                "rematerialize(..., step_peak_bytes=m.peak_bytes) (the Lightning callback and "
                "the Accelerate plugin do this for you).", stacklevel=3)
        return eager, 0
    outside = step - eager
    if outside > 0 and held is not None:
        outside = max(outside, step - held - outputs)
    return step - outside, outside
