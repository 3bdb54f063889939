"""Running a module without changing its state (buffers, RNG streams, ``.grad``)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["preserve_state"]


@contextlib.contextmanager
def preserve_state(module: nn.Module) -> Iterator[None]:
    """Run code without changing the module's buffers, any RNG stream or any ``.grad``: the
    parameters' gradients are set aside (``None`` inside, as after ``zero_grad``) and put back."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
    devices = sorted({b.device.index for b, _ in buffers if b.device.type == "cuda"} |
                     {p.device.index for p, _ in grads if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            for p, _ in grads:
                p.grad = None
            yield
        finally:
            with torch.no_grad():
                for buf, snapshot in buffers:
                    buf.copy_(snapshot)
            for p, grad in grads:
                p.grad = grad
