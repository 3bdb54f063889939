"""ode.ODEBlock: an nn.Module over odeint, with per-call statistics."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ode
from .problems import MLPDynamics, flat, rel_err


def test_block_trains_and_reports_stats():
    block = ode.ODEBlock(MLPDynamics(dim=4, hidden=16, lam=1.0), (0.0, 1.0), rtol=1e-6,
                         atol=1e-8, n_nodes=9)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert block.last_stats is None
    y = block(x)
    assert y.shape == x.shape
    stats = block.last_stats
    assert stats.grad == "interpolated" and stats.forward_nfe > 0 and stats.backward_nfe == 0
    assert stats.segments == 1 and stats.stored_bytes == 9 * x.numel() * 8
    assert 0 <= stats.interp_error < 1e-2
    y.square().sum().backward()
    assert stats.backward_nfe > 0  # the same container, filled by the backward pass
    assert all(p.grad is not None for p in block.parameters()) and x.grad is not None
    y2 = block(x)
    assert block.last_stats is not stats  # one container per call
    del y2


def test_block_matches_backprop_and_switches_methods():
    func = MLPDynamics(dim=4, hidden=16, lam=1.0)
    block = ode.ODEBlock(func, (0.0, 0.5, 1.0), rtol=1e-9, atol=1e-11, return_trajectory=True)
    x = torch.randn(5, 4, dtype=torch.float64)
    grads = {}
    for grad in ("backprop", "adjoint", "interpolated"):
        block.config = block.config.replace(grad=grad)
        ys = block(x)
        assert ys.shape == (3, 5, 4)
        grads[grad] = flat(torch.autograd.grad(ys.square().sum(), list(block.parameters())))
        assert block.last_stats.grad == grad
    assert rel_err(grads["interpolated"], grads["backprop"]) < 1e-4
    assert rel_err(grads["adjoint"], grads["backprop"]) < 1e-4


def test_block_state_dict_is_the_funcs():
    func = MLPDynamics(dim=4, hidden=16)
    block = ode.ODEBlock(func)
    assert list(block.state_dict()) == [f"func.{k}" for k in func.state_dict()]
    assert "grad='interpolated'" in repr(block) and "n_nodes=17" in repr(block)


def test_block_extra_params_get_gradients():
    scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    class Scaled(nn.Module):
        def forward(self, t, y):
            return -scale * y

    block = ode.ODEBlock(Scaled(), (0.0, 1.0), adjoint_params=[scale], rtol=1e-10, atol=1e-12)
    x = torch.ones(3, dtype=torch.float64)
    block(x).sum().backward()
    # d/ds sum(exp(-s) x) = -3 exp(-s) at s = 0.5
    assert abs(scale.grad.item() - (-3 * math.exp(-0.5))) < 1e-7


@pytest.mark.parametrize("t_span", [(0.0,), (0.0, 0.0), (0.0, 1.0, 0.5), "ab", (0.0, float("nan"))],
                         ids=["short", "repeated", "non-monotone", "string", "nan"])
def test_block_rejects_bad_t_span(t_span):
    with pytest.raises(ValueError, match="t_span="):
        ode.ODEBlock(MLPDynamics(dim=2, hidden=4), t_span)


def test_block_rejects_bad_settings_and_funcs():
    with pytest.raises(ValueError, match="n_nodes=4"):
        ode.ODEBlock(MLPDynamics(dim=2, hidden=4), n_nodes=4)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        ode.ODEBlock(lambda t, y: y)


def test_block_name_in_solve_error():
    class Blowup(nn.Module):
        def forward(self, t, y):
            return y * y

    block = ode.ODEBlock(Blowup(), (0.0, 2.0), name="model.ode1")
    with pytest.raises(ode.ODESolveError, match="model.ode1 during the forward pass"):
        block(torch.ones(1, dtype=torch.float64))
    assert ode.ODEBlock(Blowup()).block_name == "ODEBlock(Blowup)"


def test_block_follows_float32():
    block = ode.ODEBlock(MLPDynamics(dim=4, hidden=16).float(), rtol=1e-5, atol=1e-6)
    y = block(torch.randn(2, 4))
    assert y.dtype == torch.float32
    y.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in block.parameters())


@pytest.mark.gpu
def test_block_on_cuda_matches_cpu():
    torch.manual_seed(0)
    func = MLPDynamics(dim=4, hidden=16, lam=1.0)
    x = torch.randn(5, 4, dtype=torch.float64)
    out = {}
    for device in ("cpu", "cuda"):
        block = ode.ODEBlock(func.to(device), rtol=1e-9, atol=1e-11)
        y = block(x.to(device))
        grads = torch.autograd.grad(y.square().sum(), list(block.parameters()))
        out[device] = (y.cpu(), flat(grads).cpu(), block.last_stats)
    assert torch.allclose(out["cuda"][0], out["cpu"][0], rtol=1e-9, atol=1e-10)
    assert rel_err(out["cuda"][1], out["cpu"][1]) < 1e-6
    assert out["cuda"][2].forward_nfe == out["cpu"][2].forward_nfe
