"""Which device a training step runs on, checked before anything is measured.

NOTE [ Devices remat can run on ]
remat runs the user's step eagerly and measures it (:func:`remat.track_memory`: the CPU
allocator's events or the CUDA caching allocator's counters), then times every op of the captured
graph on the real example batch. Both need real tensors on the CPU or a CUDA device. A model
built on the ``meta`` device (shapes only, as ``init_empty_weights``-style loading leaves it) or
on another backend (``mps``, ``xpu``) used to fail inside ``track_memory`` with a message about a
function the user never called; it is now refused by the call the user made, before any
measurement, naming the parameter, buffer or input found there and how to move it.

Tensors on two devices (a model on ``cuda:0`` and a batch on the CPU) are not refused: a model
may move its inputs itself. When such a step fails, :func:`device_mismatch` names the two
devices in the note added to the error (NOTE [ The user's own exceptions ] in
``remat/failures.py``). The step is measured on the module's own device.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["SUPPORTED_DEVICE_TYPES", "device_mismatch", "step_device"]

# What track_memory measures (remat/memory.py).
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def _tensors(module: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``(what, tensor)`` for the module's parameters and buffers, then the call's inputs,
    each described as the user would find it (``parameter 'lin.weight'``, ``input args[0]``)."""
    from torch.utils._pytree import keystr, tree_flatten_with_path

    for name, p in module.named_parameters():
        yield f"the module's parameter {name!r}", p
    for name, b in module.named_buffers():
        yield f"the module's buffer {name!r}", b
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            where = keystr(path)  # "[0][1]" for args[1], "[1]['mask']" for kwargs['mask']
            kind, _, rest = where.partition("]")
            yield f"input {'args' if kind == '[0' else 'kwargs'}{rest}", leaf


def step_device(module: nn.Module, args: tuple, kwargs: dict, *,
                owner: str = "rematerialize") -> torch.device:
    """The device the step is measured on: the module's (else the first input's, else CPU).

    Raises:
        ValueError: a parameter, buffer or input on a device remat cannot run and measure on
            (NOTE [ Devices remat can run on ]), naming it and how to fix it.
    """
    first = None
    for what, t in _tensors(module, args, kwargs):
        if t.device.type == "meta":
            raise ValueError(
                f"{owner}: {what} is on the meta device (a shape without data); remat runs and "
                f"measures the training step, so the model and the batch must hold real tensors "
                f"on the CPU or a CUDA GPU. Materialize the model first, e.g. "
                f"model.to_empty(device='cpu') (or device='cuda') and then load its weights with "
                f"model.load_state_dict(...), and pass a real batch")
        if t.device.type not in SUPPORTED_DEVICE_TYPES:
            raise ValueError(
                f"{owner}: {what} is on {t.device.type!r}; remat measures the training step's "
                f"memory on the CPU and CUDA devices only (remat.track_memory). Move the model "
                f"and the batch to one of them, e.g. model.to('cuda') and batch.to('cuda'), or "
                f"model.to('cpu')")
        if first is None:
            first = t.device
    return first if first is not None else torch.device("cpu")


def device_mismatch(module: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """A sentence naming two tensors of the step on different devices, or ``None``.

    CPU scalars (0-dim tensors) are left out: PyTorch mixes them with any device.
    """
    first: tuple[str, torch.device] | None = None
    for what, t in _tensors(module, args, kwargs):
        if t.device.type == "cpu" and t.dim() == 0:
            continue
        if first is None:
            first = (what, t.device)
        elif t.device != first[1]:
            return (f"{first[0]} is on {first[1]} but {what} is on {t.device}: move the model and "
                    f"the batch to one device, e.g. model.to('{first[1]}') and "
                    f"batch.to('{first[1]}')")
    return None
