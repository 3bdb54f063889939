"""A call of a :class:`~remat.module.RematModule` as the capture sees it: its leaves and the key
that tells calls apart, a name for each leaf (NOTE [ Naming sizes ]), input views without their
bases (NOTE [ Views reach the capture without their base ]), and the stamp AOTAutograd leaves
on the user's tensors (NOTE [ The user's tensors leave as they came ]).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PROPAGATED_DIMS", "flatten_call", "leaf_names", "without_view_bases"]


# NOTE [ The user's tensors leave as they came ]
# AOTAutograd stamps ``_dynamo_propagated_dynamic_indices`` on tensors it sees with symbolic
# sizes (a hint for the next graph after a graph break; dynamo does not guard on it), the call's
# own inputs included. A later capture that meets the same tensor (the user's example batch,
# passed to a second ``rematerialize`` after ``torch._dynamo.reset()``) then gives that dimension
# a symbol of its own instead of sharing one with its equal sizes: a graph with one more size
# input, another structure, and a plan cache miss where the same model and batch had been
# solved (the plan cache test failed this way). The stamp is removed from the call's tensors
# that did not carry one before.
PROPAGATED_DIMS = "_dynamo_propagated_dynamic_indices"


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
    """The call's leaves and a key of what makes a call different for remat (shapes, dtypes,
    devices of its tensors, and the structure of its arguments)."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((args, kwargs))
    key = tuple((tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
                if isinstance(x, torch.Tensor) else type(x) for x in leaves)
    return leaves, (str(spec), key)


def without_view_bases(args: tuple, kwargs: dict, leaves: list[Any]
                        ) -> tuple[tuple, dict, list[Any]]:
    """The call with its input views, that need no gradient, detached from their bases.

    NOTE [ Views reach the capture without their base ]
    Dynamo guards an input that is a view on its ``_base``, and the guard fails with an error
    (``'NoneType' object has no attribute 'size'``) when a later input is not one: a batch cut
    from a longer one (``ids[:, :n]``, a view even when it keeps every column) followed by a
    freshly collated one recompiled the step, as a new graph structure: one more capture, and
    one more solve in the step that met it (a 40-step dynamic-padding run under Lightning made 3
    structures instead of 1). Such inputs (token ids, masks: nothing that needs a gradient)
    reach the compiled step detached, the same storage without the base; one tensor passed
    twice (``input_ids=batch, labels=batch``) stays one.
    """
    if not any(isinstance(x, torch.Tensor) and x._base is not None and not x.requires_grad
               for x in leaves):
        return args, kwargs, leaves
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten((args, kwargs))
    plain: dict[int, torch.Tensor] = {}
    for k, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x._base is not None and not x.requires_grad:
            flat[k] = plain.setdefault(id(x), x.detach())
    args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs, flat


def leaf_names(module: nn.Module, args: tuple, kwargs: dict) -> list[str] | None:
    """A name for each leaf of the call ``module(*args, **kwargs)``, in :func:`flatten_call`'s order.

    NOTE [ Naming sizes ]
    A size symbol of the captured graph (``s52``) means nothing to a person; the input dimension
    it stands for does. Where the call is known (:class:`RematModule`'s own calls), each leaf is
    named as the user wrote it: a keyword argument by its key (``input_ids``), a positional one by
    its parameter name in ``module.forward``'s signature (``x``; ``arg0`` where the signature does
    not say, e.g. ``*args``), a nested leaf by its path (``batch['x']``, ``pair[1]``). The backend
    adds the axis (``input_ids[1]``) and :class:`~remat.sizes.ShapePlans` prints every size that
    way. Graphs compiled through ``torch.compile(backend=remat.backend(...))`` are handed to us by
    dynamo without the call, so their sizes read ``size s52``. Returns ``None`` when the call's
    structure has no key paths (a custom pytree node registered without them).
    """
    import inspect
    from torch.utils._pytree import keystr, tree_flatten_with_path

    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # no signature to read (a builtin, a C extension)
        params = []
    try:
        paths = [path for path, _ in tree_flatten_with_path((args, kwargs))[0]]
    except (ValueError, TypeError):
        return None
    names = []
    for path in paths:
        where, first, rest = path[0], path[1], path[2:]
        if getattr(where, "idx", None) == 0:  # a positional argument
            head = params[first.idx] if first.idx < len(params) else f"arg{first.idx}"
        else:
            head = str(first.key)
        names.append(head + keystr(rest))
    return names
