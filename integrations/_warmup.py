"""The warmup step of the integrations: one example batch and the targets' real calls, no trace.

Framework-free (torch only), shared by ``HiRemateCallback`` and the Accelerate integration.

NOTE [ A warmup step that leaves no trace ]
    The example batch and the warmup forward must not change what the training run does next:
    - RNG: every global generator (torch CPU and CUDA, ``random``, NumPy) is restored on exit,
      even on error (:func:`isolated_rng`), so dropout masks and the data order stay those of the
      unmodified run. Creating a ``DataLoader`` iterator draws a seed from the global generator,
      so the batch is drawn inside it as well.
    - Data: the batch comes from a *fresh* iterator of the loader (:func:`first_batch`); the
      iterator the training loop holds is never advanced or reset. A one-shot iterable (a
      generator) cannot be read without taking a batch from training: it is refused.
    - Module state: buffers (BatchNorm statistics), ``.grad`` of every parameter and the state of
      torchmetrics metrics are restored (:func:`preserved_state`).
    The recorded arguments are detached from the warmup's autograd graph but keep their
    ``requires_grad`` flag, shape, stride and dtype, which is what the compiled module is
    specialised on: the first real call then reuses the captured graph instead of re-solving.
"""
from __future__ import annotations

import contextlib
import copy
import random
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from integrations._remat_shared import Target

__all__ = ["CannotDrawBatch", "first_batch", "isolated_rng", "preserved_state",
           "record_first_calls"]


class CannotDrawBatch(RuntimeError):
    """No example batch can be read without changing what the training loop sees."""


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Restore torch (CPU, CUDA), ``random`` and NumPy generators on exit, also on error."""
    py_state = random.getstate()
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        import numpy as np
        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
        np, np_state = None, None
    try:
        yield
    finally:
        random.setstate(py_state)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if np is not None:
            np.random.set_state(np_state)


def _metric_states(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """torchmetrics ``Metric`` states (recognised by their ``_defaults`` registry)."""
    saved = []
    for m in module.modules():
        defaults = getattr(m, "_defaults", None)
        if isinstance(defaults, dict) and hasattr(m, "_update_count"):
            names = [*defaults, "_update_count", "_computed"]
            saved.append((m, {n: copy.deepcopy(getattr(m, n)) for n in names if hasattr(m, n)}))
    return saved


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore ``module``'s buffers, parameter ``.grad`` s and metric states on exit."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
    metrics = _metric_states(module)
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, snapshot in buffers:
                buf.copy_(snapshot)
        for p, grad in grads:
            p.grad = grad
        for m, state in metrics:
            for name, value in state.items():
                object.__setattr__(m, name, value)


def first_batch(iterable: Any) -> Any:
    """The first batch of a fresh iterator over ``iterable``.

    See NOTE [ A warmup step that leaves no trace ].

    A ``DataLoader`` is read through a new iterator of its own (``iter()`` on a loader with
    persistent workers would reset the iterator the training loop holds; a subclass's
    ``__iter__``, e.g. Accelerate's, may also move data or synchronise processes), which is
    closed again. Seeded generators of the loader and its samplers (``generator=``) are restored
    afterwards: the loop's own iteration then shuffles exactly as without the warmup.

    Raises:
        CannotDrawBatch: for an iterable that is its own iterator, or that is empty.
    """
    generators = _generators(iterable)
    states = [g.get_state() for g in generators]
    try:
        return _read_first(iterable)
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader and its samplers draw from (seeded ``generator=`` arguments)."""
    found: list[torch.Generator] = []
    stack, seen = [loader], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and all(g is not generator for g in found):
            found.append(generator)
        stack += [getattr(obj, name, None) for name in ("sampler", "batch_sampler")]
    return found


def _read_first(iterable: Any) -> Any:
    if isinstance(iterable, torch.utils.data.DataLoader) and hasattr(iterable, "_get_iterator"):
        iterator = iterable._get_iterator()
    else:
        iterator = iter(iterable)
        if iterator is iterable:
            raise CannotDrawBatch(
                f"the training data is a one-shot iterator ({type(iterable).__name__}); reading an "
                "example batch from it would remove that batch from training. Use a DataLoader "
                "or another re-iterable object"
            )
    try:
        return next(iterator)
    except StopIteration:
        raise CannotDrawBatch("the training data is empty") from None
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def _detached(value: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """Detached copies (views) of the tensors in ``value``; one tensor passed twice (Hugging
    Face's ``input_ids=batch, labels=batch``) stays one tensor, so the capture sees the same
    aliasing as the training steps (else dynamo would specialise the steps anew)."""
    memo = {} if memo is None else memo

    def detach(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = x.detach().requires_grad_(x.requires_grad)
            return memo[id(x)]
        return x
    return tree_map(detach, value)


@contextlib.contextmanager
def record_first_calls(targets: Sequence[Target]) -> Iterator[dict[str, tuple[tuple, dict]]]:
    """Record the ``(args, kwargs)`` of each target's first call inside the block.

    Yields:
        A dict filled as the targets are called: name -> detached ``(args, kwargs)``.
    """
    calls: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for target in targets:
        def hook(module: nn.Module, args: tuple, kwargs: dict, name: str = target.name) -> None:
            if name not in calls:
                memo: dict[int, torch.Tensor] = {}
                calls[name] = (_detached(args, memo), _detached(kwargs, memo))
        handles.append(target.module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
