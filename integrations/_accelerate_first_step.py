"""The first training step of an Accelerate loop, measured and reported like the Lightning
callback's.

NOTE [ Measuring the first step of a loop we do not own ]
Like ``HiRemateCallback``, the summary after ``prepare`` gives the measured peak of the
unmodified warmup step (the model's forward and backward on the example batch, which its
percentages are of: ``rematerialize`` measures it for a whole model; with ``module=`` names
the whole model is measured once more, as the callback's warmup does), then the measured peak
of the first training step. Lightning calls the callback around each step; an Accelerate loop
is the user's, so the model carries the hooks: its first forward with gradients enabled in
training mode starts ``remat.track_memory``, which stops at the next optimizer step (torch's
global step pre-hook) or the model's next call, whichever comes first: forward, loss and
backward, not the optimizer step, as in the callback (under gradient accumulation, one
micro-batch). It is reported only if a backward ran through the forward's outputs (a
gradient hook sets a flag). The profiler is never stopped inside the backward itself: the
autograd engine puts back, when the backward ends, the thread-local profiler state it
started with, which would leave a stopped session switched on for the thread. Main process
and ``verbose`` only; the hooks remove themselves once done.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import remat
from integrations._remat_shared import StepMeter, first_step_line

__all__ = ["EAGER_DETAIL", "FirstStepReport", "warmup_peak"]

log = logging.getLogger("integrations.accelerate")  # the summary's logger, as before


# What the unmodified warmup step ran, for the summary (NOTE [ Measuring the first step of a loop
# we do not own ]).
EAGER_DETAIL = "forward + backward of the model on the example batch"


class FirstStepReport:
    """Measures the first training step of ``model`` and logs it with :func:`first_step_line`;
    see NOTE [ Measuring the first step of a loop we do not own ]."""

    def __init__(self, model: nn.Module, device: torch.device, eager_peak_bytes: Optional[int],
                 owner: str) -> None:
        self.meter = StepMeter()
        self.device = device
        self.eager_peak_bytes = eager_peak_bytes
        self.owner = owner
        self.backward_ran = False
        self._handles = [model.register_forward_pre_hook(self._before),
                         model.register_forward_hook(self._after)]

    def _before(self, module: nn.Module, args: Any) -> None:
        if self.meter.running:  # the next call began before any optimizer step
            self._finish()
        elif torch.is_grad_enabled() and module.training:
            if self.meter.start(self.device):
                self._handles.append(register_optimizer_step_pre_hook(self._finish))
            else:  # cannot measure here (another profiler session on CPU, a device type)
                self._remove()

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.meter.running:
            return
        for t in _leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._at_backward)

    def _at_backward(self, grad: torch.Tensor) -> None:
        self.backward_ran = True  # only a flag: the profiler is never stopped inside a backward

    def _finish(self, *args: Any) -> None:
        peak = self.meter.stop()
        self._remove()
        if peak is not None and self.backward_ran:
            log.info(first_step_line(peak, self.eager_peak_bytes, owner=self.owner))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _leaves(output: Any) -> list:
    """The leaves of a model's output (a mapping pytree does not know, e.g. a ``ModelOutput``
    that is not registered, by its values)."""
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten(output)[0]
    if len(leaves) == 1 and isinstance(leaves[0], Mapping):
        leaves = tree_flatten(list(leaves[0].values()))[0]
    return leaves


def warmup_peak(model: nn.Module, args: tuple, kwargs: dict) -> Optional[int]:
    """The measured peak of the model's unmodified warmup step on the example batch, ``None``
    when it cannot be measured (NOTE [ Measuring the first step of a loop we do not own ])."""
    try:
        return remat.measure_eager_step(model, *args, **kwargs)
    except RuntimeError:  # a torch.profiler session is running (CPU)
        return None
