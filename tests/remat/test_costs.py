"""Op times are measured as the training step will run the ops (NOTE [ Timing outside the
tracer's dispatch ] in remat/costs.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

import remat

# What the probe op saw each time its real kernel ran: was the Python dispatcher on?
_SEEN: list[bool] = []


@torch.library.custom_op("hiremate_test::dispatch_probe", mutates_args=())
def dispatch_probe(x: torch.Tensor) -> torch.Tensor:
    _SEEN.append(torch._C._dispatch_tls_is_dispatch_key_included(
        torch._C.DispatchKey.PythonDispatcher))
    return x.clone()


@dispatch_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


dispatch_probe.register_autograd(lambda ctx, grad: grad)


class Probed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(dispatch_probe(torch.tanh(self.a(x)))).square().sum()


def test_ops_are_timed_without_the_tracers_python_dispatcher():
    # The capture runs inside AOTAutograd's trace, where the Python dispatcher is on; it added
    # ~18 us to every profiled op (4 us -> 23 us for a view), so a graph of many small ops was
    # priced at 3-5x its real time and views looked as costly as arithmetic.
    torch.manual_seed(0)
    model, x = Probed(), torch.randn(512, 64)
    _SEEN.clear()
    rm = remat.rematerialize(model, x, budget="70%", options={"progress": False})
    profiled = len(_SEEN)
    assert profiled >= 4, "the capture should run the probe's kernel (warm-up + timed repeats)"
    assert not any(_SEEN), f"{sum(_SEEN)} of {profiled} profiled runs had the Python dispatcher on"
    assert rm.graphs[0].baseline_time > 0
