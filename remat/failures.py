"""What a call with remat raises when it fails: a :class:`CaptureError` that says what to do, or
the user's own exception (NOTE [ The user's own exceptions ])."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .devices import device_mismatch
from .errors import CaptureError, RematError
from .state import preserve_state

__all__ = ["add_note", "capture_error", "own_failure"]

log = logging.getLogger(__name__)

_DATA_DEPENDENT = ("data-dependent", "data dependent", "guardondatadependentsymnode")


def capture_error(exc: BaseException) -> RematError:
    """Turn a dynamo failure into a :class:`CaptureError` that says what to do."""
    import torch._dynamo.exc as dynamo_exc

    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, RematError):
        return inner
    cause = inner if inner is not None else exc
    text = [line for line in str(cause).strip().splitlines() if line.strip()]
    first = text[0] if text else ""
    lowered = f"{type(cause).__name__} {cause}".lower()
    workaround = ("or use torch.compile(model, backend=remat.backend(...)), which rematerializes "
                  "each graph dynamo captures between the breaks (code dynamo cannot trace, such "
                  "as pack_padded_sequence, stays eager and is not rematerialized)")
    if any(k in lowered for k in _DATA_DEPENDENT):
        return CaptureError(
            f"cannot capture the model as one graph: control flow or shapes depend on tensor "
            f"values ({first}). Fix: make them independent of tensor values (or move that code "
            f"outside the module, e.g. a mixture-of-experts router's top-k dispatch), "
            f"{workaround}.", reason="data_dependent")
    if isinstance(exc, dynamo_exc.Unsupported):
        return CaptureError(
            f"cannot capture the model as one graph: {first}. Fix: remove this graph break "
            f"(`torch._dynamo.explain(model)(*args)` lists all of them), {workaround}.",
            reason="graph_break")
    return CaptureError(f"cannot capture the model: {type(cause).__name__}: {first}. If the model "
                        "runs eagerly, please report it.", reason="other")


# NOTE [ The user's own exceptions ]
# An exception the model raises itself (a ValueError for a wrong input shape, a RuntimeError from
# an op given mismatched shapes, an IndexError from nn.Embedding given an id out of range) must
# reach the user with its own type and traceback, so that ``except ValueError`` around their code
# keeps working with remat; our context goes in a note (``add_note``), not in a new class. Dynamo
# does not hand such an exception over as it is. On torch 2.13, calling with fullgraph=True:
# - ``raise ValueError("bad shape")`` in forward arrives as ``torch._dynamo.exc.Unsupported``
#   ("Observed exception"), its ``__cause__`` an ``ObservedValueErrorError``: the ValueError was a
#   value in dynamo's symbolic interpreter and no exception object of the user's exists (a
#   KeyError from a dict lookup arrives the same way);
# - a shape mismatch in ``F.linear`` arrives as ``TorchRuntimeError`` ("RuntimeError when making
#   fake tensor call"), with the meta kernel's text ("a and b must have same reduction dim")
#   instead of eager's ("mat1 and mat2 shapes cannot be multiplied (2x5 and 4x4)");
# - ``nn.Embedding`` given an id out of range traces fine (fake tensors hold no values): the
#   compiled graph raises the op's own ``IndexError`` when it runs, unwrapped.
# Sorting these from genuine capture failures by dynamo's classes would be a guess that moves
# with torch versions (``Unsupported`` is also every graph break). An exception is the user's own
# when the model raises it without remat, so that is what is checked: when a call with remat fails
# with anything but one of our own errors, the same call runs once more eagerly on the original
# module, without gradients (no activations kept: less memory than the step being compiled) and
# under ``preserve_state`` (buffers, RNG streams and ``.grad`` unchanged). If it raises, *its*
# exception propagates, with a note saying so and what the capture had stopped at; if it runs,
# the failure is remat's and stays a ``CaptureError`` (graph break, data-dependent control flow,
# unsupported op). The cost, one forward, is paid only by a call that has already failed; Python
# side effects of ``forward`` other than buffers and RNG (a counter, a hook's list) run once more,
# and an error only a forward with gradients would raise is not seen (it stays a CaptureError).
# An out-of-memory error in the re-run says nothing about the model: the remat failure stands.
# The example call's step is measured eagerly before any capture (``remat.eager_step.eager_reference``), so there
# the user's exception comes straight from the model, and gets a note too.


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no notes, the note is kept in
    ``__notes__`` (where 3.11 and the ``exceptiongroup`` backport's traceback printer read it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
    except (AttributeError, TypeError):  # an exception class with __slots__
        log.info("%s: %s", type(exc).__name__, note)


def own_failure(module: nn.Module, args: tuple, kwargs: dict, failure: BaseException
                 ) -> Exception | None:
    """The exception ``module`` raises on this call without remat (NOTE [ The user's own
    exceptions ]), with a note; ``None`` when the eager call runs."""
    try:
        with preserve_state(module), torch.no_grad():
            module(*args, **kwargs)
    except torch.OutOfMemoryError:
        return None  # says nothing about the model: the remat failure stands
    except Exception as exc:  # noqa: BLE001 - whatever the model raises is the model's
        cause = getattr(failure, "inner_exception", None) or failure
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        note = (f"hiremate: {type(module).__name__}'s own forward raises this on these inputs "
                f"without remat too (run again eagerly, without gradients, after the call with "
                f"remat failed with {type(cause).__name__}: {lines[0] if lines else ''}), so it "
                f"is not a remat failure: fix the model or its inputs")
        mismatch = device_mismatch(module, args, kwargs)
        add_note(exc, note + (f". Note that {mismatch}" if mismatch else ""))
        return exc
    return None
