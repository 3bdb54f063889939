"""The compiled frames a :class:`~remat.module.RematModule` owns, and dynamo's settings while it
captures: a code object per schedule (NOTE [ Owning the compiled frames ]), forgotten with the
module, the ``torch._dynamo.config`` a capture runs under, and the module attributes a compiled
step runs with (NOTE [ The algorithm eager runs ]).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Iterator

import torch
from torch import nn

from .experts import one_op_switches

__all__ = ["RECOMPILE_LIMIT", "capture_config", "eager_algorithms", "forget_backends", "own_step",
           "switched_algorithms"]

# NOTE [ The algorithm eager runs ]
# Some modules pick another algorithm when ``torch.compiler.is_compiling()`` is true: Hugging
# Face's Mamba, FalconMamba, Jamba and Zamba mixers (``use_associative_scan``, on by default)
# run ``associative_scan`` under dynamo and a sequential loop in eager. Captured as dynamo
# sees it, the step was another computation: a 2-layer HF Mamba's gradients differed from
# eager's by 1.2e-8, its captured unmodified peak was 1.67x eager's step (20.26 vs 12.14 MiB)
# and 50% was out of reach (bound 54%, lowest schedule 77%; with eager's loop: bound 38%,
# lowest 56%, and bitwise). So these attributes take eager's value while a compiled step runs,
# at every call (dynamo guards on them: a capture alone would recompile at the next call) and
# are restored after it: the user's module, called outside the step, is as they left it.
_EAGER_VALUES = {"use_associative_scan": False}


def _logging_methods() -> set:
    """``logging.Logger`` methods, including the ``*_once`` ones libraries attach to it.

    NOTE [ Log calls inside the captured forward ]
    A log call in ``forward`` (Hugging Face models warn through ``logger.warning_once``) is a
    graph break for dynamo. We capture with these methods marked as no-ops instead: the step is
    captured as one graph and only the log line is lost.
    """
    names = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
    names |= {n for n in vars(logging.Logger) if n.endswith("_once")}
    return {getattr(logging.Logger, n) for n in names if callable(getattr(logging.Logger, n, None))}


def capture_config(leaves: list[Any]):
    """Dynamo's settings for capturing a step.

    NOTE [ Floats are constants of the capture ]
    Captured with ``dynamic=True``, every Python float dynamo meets (a dropout probability, a
    LayerNorm epsilon, an attention scale from the model's config) becomes a symbolic input.
    Those that feed ops taking a Python number (``native_dropout``'s ``p``) cannot be turned into
    tensors after AOTAutograd has traced the joint graph, and dynamo then throws the whole trace
    away and captures again with them specialized: a 2-layer GPT-2 took 18.8 s to set up, 7 s of
    it a discarded first attempt, and every later capture (a new schedule, a size of 1) paid the
    same. Floats are therefore constants of the capture (guarded like any constant), unless the
    call itself passes a float: an argument that changes from call to call (a schedule's
    coefficient) stays symbolic, as before, rather than recompiling per value.
    """
    import torch._dynamo

    ignored = set(torch._dynamo.config.ignore_logging_functions) | _logging_methods()
    floats_in_call = any(type(leaf) is float for leaf in leaves)
    return torch._dynamo.config.patch(ignore_logging_functions=ignored,
                                      specialize_float=not floats_in_call,
                                      # NOTE [ Recurrent layers as eager runs them ]
                                      allow_rnn=True)


def switched_algorithms(module: nn.Module) -> list[tuple[Any, str, Any]]:
    """The ``(object, attribute, value)`` triples :func:`eager_algorithms` sets: eager's
    algorithms (NOTE [ The algorithm eager runs ]) and Hugging Face's eager expert loops as one
    op (NOTE [ An expert loop as one op ] in :mod:`remat.experts`)."""
    return [(m, name, value) for m in module.modules() for name, value in _EAGER_VALUES.items()
            if name in vars(m) and vars(m)[name] != value] + one_op_switches(module)


@contextlib.contextmanager
def eager_algorithms(switched: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """NOTE [ The algorithm eager runs ]: ``switched`` (see :func:`switched_algorithms`) at
    their values inside the block, as they were after it."""
    before = [getattr(obj, name) for obj, name, _ in switched]
    try:
        for obj, name, value in switched:
            setattr(obj, name, value)
        yield
    finally:
        for (obj, name, _), value in zip(switched, before):
            setattr(obj, name, value)


def _step(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    return module(*args, **kwargs)


_STEP_NUMBERS = itertools.count(1)


def own_step(label: str):
    """A function like :func:`_step` with a code object of its own.

    NOTE [ Owning the compiled frames ]
    Dynamo keeps compiled graphs on the code object it compiled and counts recompilations there:
    compiling ``model.forward`` directly shares one cache (and one ``recompile_limit``) between
    every instance of the class, every rematerialized copy and every input shape, so the ninth
    shape or the ninth ``rematerialize`` of a model class failed. Each schedule of a
    :class:`RematModule` runs through its own copy of this function: its dynamo cache holds
    only that schedule's graphs, recompilations are counted there (``isolate_recompiles``),
    and it is freed with the module.

    Dynamo also remembers, by a code's file, line and *name*, which input sizes changed between
    its compilations, and makes those dimensions dynamic, one symbol each, in the next compile of
    any code of that name. Every copy is therefore named apart (``_remat_step_2_17``): a dynamic
    capture after a static one of the same name gave the two inputs' batch dimensions two
    symbols instead of one, a graph of another structure than the one later schedules compiled,
    and one more capture and solve inside a training step.
    """
    import types

    code = _step.__code__.replace(co_name=f"_remat_step_{label}_{next(_STEP_NUMBERS)}")
    return types.FunctionType(code, _step.__globals__, code.co_name)


# A recompilation happens per dynamo specialisation of one schedule (a size of 1, a new mode),
# never per input shape (NOTE [ Dynamic shapes ]); this only bounds a pathological model.
RECOMPILE_LIMIT = 64


def forget_backends(slots: dict) -> None:
    from torch._dynamo import eval_frame

    ours = {id(slot_backend) for _, slot_backend, _ in slots.values()}
    for key, value in list(eval_frame.cached_backends.items()):
        if id(getattr(value, "compiler_fn", value)) in ours:
            eval_frame.cached_backends.pop(key, None)
    for _, _, code in slots.values():
        torch._C._dynamo.eval_frame.reset_code(code)  # the compiled graphs kept on the code
    slots.clear()
