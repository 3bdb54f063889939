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


def test_ops_that_do_the_same_work_share_one_price():
    # Each op's few samples varied by tens of percent on a shared machine: the same op of two
    # identical layers was priced up to 15x apart (6-layer GPT, median spread 1.7x), so the
    # solver chose between layers by noise. Identical layers now get one price per op.
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())]
    model, x = nn.Sequential(*layers), torch.randn(512, 64)
    rm = remat.rematerialize(model, x, budget="90%", options={"progress": False})
    graph = rm.graphs[0]
    forward = [op for op in graph.ops[:graph.num_forward]]
    for kind in ("aten.addmm", "aten.tanh"):
        times = {op.time for op in forward if op.signature.startswith(kind)}
        assert len(times) == 1 and min(times) > 0, (kind, times)


def test_the_work_key_sees_strides_and_constants():
    from remat.costs import _work_key

    a, b = torch.randn(32, 32), torch.randn(32, 32)
    mm = torch.ops.aten.mm.default
    assert _work_key(mm, (a, b), {}) == _work_key(mm, (b, a), {})
    assert _work_key(mm, (a, b), {}) != _work_key(mm, (a, b.t()), {})  # another kernel
    assert _work_key(mm, (a, b), {}) != _work_key(mm, (a, b.double()), {})
    mul = torch.ops.aten.mul.Scalar
    assert _work_key(mul, (a, 2.0), {}) != _work_key(mul, (a, 3.0), {})
    assert _work_key(mul, (a, 2.0), {}) != _work_key(torch.ops.aten.add.Scalar, (a, 2.0), {})
