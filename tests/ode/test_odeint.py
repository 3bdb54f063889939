"""ode.odeint: the three gradient methods side by side, input checks, solve errors, stats."""
from __future__ import annotations

import math

import pytest
import torch

import ode
from .problems import MLPDynamics, flat, rel_err


class _Counting(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, t, y):
        self.calls += 1
        return self.inner(t, y)


def _loss_grads(func, y0, t, **kwargs):
    y0 = y0.clone().requires_grad_(True)
    stats = ode.ODEStats(grad=kwargs.get("grad", "interpolated"), method="dopri5")
    ys = ode.odeint(func, y0, t, stats=stats, **kwargs)
    grads = torch.autograd.grad(ys.square().sum(), [y0, *func.parameters()])
    return flat(grads), stats


@pytest.mark.parametrize("grad", list(ode.GRAD_METHODS), ids=list(ode.GRAD_METHODS))
def test_every_method_gives_the_same_gradient(grad):
    func = MLPDynamics(dim=4, hidden=16, lam=1.0)
    y0 = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    ref, _ = _loss_grads(func, y0, t, grad="backprop", rtol=1e-10, atol=1e-12)
    got, stats = _loss_grads(func, y0, t, grad=grad, rtol=1e-8, atol=1e-10)
    assert rel_err(got, ref) < 1e-5  # all three measured <= 3e-8
    assert stats.grad == grad and stats.forward_nfe > 0
    if grad == "backprop":
        assert stats.backward_nfe == 0 and stats.stored_bytes is None
    else:
        assert stats.backward_nfe > 0 and stats.backward_steps > 0
    if grad == "adjoint":
        assert stats.stored_bytes == 3 * y0.numel() * 8  # the outputs at the 3 times


def test_non_module_func_needs_adjoint_params():
    w = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    func = lambda t, y: y @ w  # noqa: E731
    y0 = torch.randn(1, 2, dtype=torch.float64)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="adjoint_params"):
        ode.odeint(func, y0, t)
    ys = ode.odeint(func, y0, t, adjoint_params=[w])
    (g,) = torch.autograd.grad(ys[-1].sum(), w)
    assert g.abs().sum() > 0


T01 = torch.tensor([0.0, 1.0], dtype=torch.float64)
BAD_T = {
    "non-monotone": ([0.0, 1.0, 0.5], "not monotone"),
    "repeated": ([0.0, 0.5, 0.5, 1.0], r"t\[1\] == t\[2\]"),
    "single": ([0.0], "at least 2"),
    "nan": ([0.0, math.nan], "NaN or Inf"),
}


@pytest.mark.parametrize("case", list(BAD_T), ids=list(BAD_T))
def test_bad_t_raises_before_solving(case):
    times, match = BAD_T[case]
    func = _Counting(MLPDynamics(dim=2, hidden=4))
    with pytest.raises(ValueError, match=match):
        ode.odeint(func, torch.ones(2, dtype=torch.float64), torch.tensor(times, dtype=torch.float64))
    assert func.calls == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_y0_raises_before_solving(value):
    func = _Counting(MLPDynamics(dim=2, hidden=4))
    y0 = torch.tensor([[1.0, value]], dtype=torch.float64)
    with pytest.raises(ValueError, match="y0 has 1 NaN/Inf"):
        ode.odeint(func, y0, T01)
    assert func.calls == 0


BAD_SETTINGS = {
    "n_nodes-even": (dict(n_nodes=8), "n_nodes=8: must be an odd integer"),
    "n_nodes-one": (dict(n_nodes=1), "n_nodes=1"),
    "n_nodes-huge": (dict(n_nodes=1001), "n_nodes=1001"),
    "n_nodes-float": (dict(n_nodes=9.0), "n_nodes=9.0"),
    "n_nodes-bool": (dict(n_nodes=True), "n_nodes=True"),
    "grad": (dict(grad="magic"), "grad='magic'.*'backprop', 'adjoint', 'interpolated'"),
    "method": (dict(method="rk45"), "method='rk45': not a torchdiffeq solver"),
    "fixed-grid-interpolated": (dict(method="rk4"), "needs an adaptive Runge-Kutta solver"),
    "rtol": (dict(rtol=-1e-3), "rtol=-0.001: must be a finite positive number"),
    "policy": (dict(on_interp_error="ignore"), "on_interp_error='ignore'.*'refine'"),
    "interp_tol": (dict(interp_tol=0.0), "interp_tol=0.0"),
    "reserved-option": (dict(options={"step_t": torch.tensor([0.5])}), "sets these itself"),
    "max_steps": (dict(max_steps=0), "max_steps=0"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS), ids=list(BAD_SETTINGS))
def test_bad_settings_raise_before_solving(case):
    kwargs, match = BAD_SETTINGS[case]
    func = _Counting(MLPDynamics(dim=2, hidden=4))
    with pytest.raises(ValueError, match=match):
        ode.odeint(func, torch.ones(2, dtype=torch.float64), T01, **kwargs)
    assert func.calls == 0


def test_times_too_close_for_the_nodes():
    func = _Counting(MLPDynamics(dim=2, hidden=4))
    t = torch.tensor([1.0, 1.0 + 4e-16], dtype=torch.float64)
    with pytest.raises(ValueError, match="too close for n_nodes=17"):
        ode.odeint(func, torch.ones(2, dtype=torch.float64, requires_grad=True), t)
    assert func.calls == 0


def test_non_tensor_inputs():
    func = MLPDynamics(dim=2, hidden=4)
    with pytest.raises(TypeError, match="y0"):
        ode.odeint(func, [1.0, 2.0], T01)
    with pytest.raises(TypeError, match="t="):
        ode.odeint(func, torch.ones(2, dtype=torch.float64), [0.0, 1.0])


class _Blowup(torch.nn.Module):
    """y' = y^2, y(0) = 1: y = 1 / (1 - t) blows up at t = 1."""

    def forward(self, t, y):
        return y * y


@pytest.mark.parametrize("grad", list(ode.GRAD_METHODS), ids=list(ode.GRAD_METHODS))
def test_blowup_raises_solve_error_naming_phase_time_and_step(grad):
    with pytest.raises(ode.ODESolveError) as info:
        ode.odeint(_Blowup(), torch.ones(1, dtype=torch.float64, requires_grad=True),
                   torch.tensor([0.0, 2.0], dtype=torch.float64), grad=grad, name="encoder.ode")
    err = info.value
    assert err.block == "encoder.ode" and err.phase == "forward"
    assert 0.99 < err.t < 1.01 and err.dt < 1e-6
    assert "encoder.ode" in str(err) and "forward pass at t=" in str(err)


def test_step_budget_forward():
    with pytest.raises(ode.ODESolveError, match=r"step budget is spent \(max_steps=3") as info:
        ode.odeint(MLPDynamics(dim=2, hidden=4, lam=30.0), torch.ones(2, dtype=torch.float64),
                   T01, max_steps=3)
    assert info.value.phase == "forward" and info.value.steps == 4


@pytest.mark.parametrize("grad", ["adjoint", "interpolated"])
def test_step_budget_backward(grad):
    """The budget is per pass: a forward that fits and a backward that does not (11 output
    times: each backward interval restarts its step size; measured 12 forward, 35-44 backward
    steps)."""
    func = MLPDynamics(dim=2, hidden=4)
    y0 = torch.ones(1, 2, dtype=torch.float64, requires_grad=True)
    t = torch.linspace(0.0, 2.0, 11, dtype=torch.float64)
    stats = ode.ODEStats(grad=grad, method="dopri5")
    ode.odeint(func, y0, t, grad=grad, rtol=1e-8, atol=1e-10, stats=stats).sum().backward()
    assert stats.backward_steps > stats.forward_steps
    ys = ode.odeint(func, y0, t, grad=grad, rtol=1e-8, atol=1e-10,
                    max_steps=stats.forward_steps)
    with pytest.raises(ode.ODESolveError, match="during the backward pass") as info:
        ys.sum().backward()
    assert info.value.phase == "backward" and info.value.steps == stats.forward_steps + 1
    assert 0.0 <= info.value.t <= 2.0


def test_solve_error_pickles():
    import pickle

    err = ode.ODESolveError(block="b", phase="backward", t=0.5, dt=1e-20, steps=7, reason="r")
    again = pickle.loads(pickle.dumps(err))
    assert (again.block, again.phase, again.t, again.steps, str(again)) == (
        "b", "backward", 0.5, 7, str(err))
