"""grad="interpolated": gradients against gradcheck, analytic solutions and backprop; nodes from
dense output; landing on segment ends; the error policies."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchdiffeq

import ode
from .problems import LinearDynamics, MLPDynamics, flat, rel_err

# Interpolated gradients vs direct backprop, both at rtol 1e-9 with n_nodes=17: the bar.
AGREE_RTOL = 1e-4
# Linear ODE vs the exact gradient through matrix_exp, at rtol 1e-10: solver-limited, measured
# ~1e-9; 1e-6 leaves room for platform differences.
ANALYTIC_RTOL = 1e-6


def _grads(func, y0, t, *, wrt_t=False, **kwargs):
    y0 = y0.detach().clone().requires_grad_(True)
    t = t.detach().clone().requires_grad_(wrt_t)
    ys = ode.odeint(func, y0, t, **kwargs)
    weights = torch.linspace(0.5, 1.5, ys.shape[0], dtype=ys.dtype).view(-1, *[1] * (ys.ndim - 1))
    loss = (weights * ys.square()).sum() + ys.sin().sum()
    inputs = [y0, *func.parameters()] + ([t] if wrt_t else [])
    return ys, torch.autograd.grad(loss, inputs)


def test_gradcheck_float64():
    """Every input of the autograd.Function: y0, the output times and adjoint_params."""
    w = torch.tensor([[-0.5, 1.0], [-1.0, -0.3]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.1, -0.2], dtype=torch.float64, requires_grad=True)

    def fn(y0, t, w, b):
        func = lambda s, y: torch.tanh(y @ w.T + b) + 0.1 * s  # noqa: E731 - not an nn.Module
        return ode.odeint(func, y0, t, rtol=1e-12, atol=1e-12, n_nodes=17, adjoint_params=(w, b),
                          on_interp_error="raise")

    y0 = torch.tensor([[0.7, -0.4]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.0, 0.4, 1.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (y0, t, w, b), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_linear_ode_matches_analytic_gradient():
    """y' = A y: y(T) = expm(A T) y0, differentiated exactly through torch.linalg.matrix_exp."""
    a = torch.tensor([[-1.0, 2.0, 0.0], [-2.0, -1.0, 0.5], [0.0, 0.3, -4.0]], dtype=torch.float64)
    y0 = torch.tensor([[1.0, -1.0, 0.5], [0.2, 0.3, -0.7]], dtype=torch.float64)
    c = torch.tensor([[0.3, -1.2, 2.0], [1.0, 0.5, -0.4]], dtype=torch.float64)
    T = 1.3

    a_ref = a.clone().requires_grad_(True)
    y0_ref = y0.clone().requires_grad_(True)
    T_ref = torch.tensor(T, dtype=torch.float64, requires_grad=True)
    exact = y0_ref @ torch.linalg.matrix_exp(a_ref * T_ref).T
    expected = torch.autograd.grad((c * exact).sum(), (y0_ref, a_ref, T_ref))

    func = LinearDynamics(a)
    y0_ = y0.clone().requires_grad_(True)
    t = torch.tensor([0.0, T], dtype=torch.float64, requires_grad=True)
    ys = ode.odeint(func, y0_, t, rtol=1e-10, atol=1e-12, n_nodes=17)
    got = torch.autograd.grad((c * ys[-1]).sum(), (y0_, func.a, t))
    assert rel_err(ys[-1], exact) < ANALYTIC_RTOL
    assert rel_err(got[0], expected[0]) < ANALYTIC_RTOL
    assert rel_err(got[1], expected[1]) < ANALYTIC_RTOL
    assert abs(float(got[2][1] - expected[2])) < ANALYTIC_RTOL * abs(float(expected[2]))
    # moving t0 forward by d shortens the flow by d: dL/dt0 = -dL/dT for autonomous dynamics
    assert abs(float(got[2][0] + expected[2])) < ANALYTIC_RTOL * abs(float(expected[2]))


TIMES = {
    "two-times": [0.0, 1.0],
    "decreasing": [1.0, -0.5],
    "five-times": [0.0, 0.2, 0.5, 0.6, 1.5],
    "decreasing-four": [2.0, 1.5, 0.3, 0.0],
}


@pytest.mark.parametrize("times", list(TIMES.values()), ids=list(TIMES))
def test_agrees_with_backprop_at_tight_tolerance(times):
    func = MLPDynamics(dim=4, hidden=16, lam=1.0)
    y0 = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    ys_ref, ref = _grads(func, y0, t, grad="backprop", rtol=1e-9, atol=1e-11, wrt_t=True)
    ys, got = _grads(func, y0, t, grad="interpolated", rtol=1e-9, atol=1e-11, n_nodes=17,
                     wrt_t=True, on_interp_error="raise")
    assert torch.equal(ys, ys_ref)  # same solver steps: NOTE [ Nodes from dense output ... ]
    for g, r in zip(got, ref):
        assert rel_err(g, r) < AGREE_RTOL


def test_float32_state_follows_input_dtype():
    func64 = MLPDynamics(dim=4, hidden=16, lam=1.0)
    func32 = copy.deepcopy(func64).float()
    y0 = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0.0, 0.7, 1.0])
    _, ref = _grads(func64, y0, t.double(), grad="backprop", rtol=1e-9, atol=1e-11)
    ys, got = _grads(func32, y0.float(), t, grad="interpolated", rtol=1e-6, atol=1e-7)
    assert ys.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    # float32 arithmetic and rtol 1e-6: measured ~1e-6
    assert rel_err(flat(got).double(), flat(ref)) < 1e-4


def test_error_falls_geometrically_with_nodes():
    """Interpolation-dominated regime (solver at rtol 1e-10): errors measured 9.2e-3, 7.2e-4,
    1.3e-5, 2.5e-9 for 3, 5, 9, 17 nodes."""
    func = MLPDynamics(dim=4, hidden=16)
    y0 = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0.0, 2.0], dtype=torch.float64)
    _, ref = _grads(func, y0, t, grad="backprop", rtol=1e-11, atol=1e-13)
    errors = []
    for n in (3, 5, 9, 17):
        _, got = _grads(func, y0, t, grad="interpolated", rtol=1e-10, atol=1e-12, n_nodes=n,
                        on_interp_error="warn", interp_tol=1.0)
        errors.append(rel_err(flat(got), flat(ref)))
    for coarse, fine in zip(errors[:-1], errors[1:]):
        assert fine < 0.2 * coarse, errors
    assert errors[-1] < 1e-7, errors


class _Recorder(torch.nn.Module):
    """Dynamics that record the time of every evaluation."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.times: list[float] = []

    def forward(self, t, y):
        self.times.append(float(t))
        return self.inner(t, y)


@pytest.mark.parametrize("times", [[0.0, 1.0], [0.0, 0.37, 1.0], [1.0, 0.0]],
                         ids=["one-interval", "two-intervals", "decreasing"])
def test_backward_lands_on_segment_ends_overshoot_regression(times):
    """torchdiffeq's adaptive solve steps past the end of its interval and reads dense output there
    (shown first); ours must never evaluate the interpolant outside its segment — every state it
    reads would otherwise be an extrapolated polynomial (and LobattoInterpolant raises)."""
    inner = MLPDynamics(dim=4, hidden=16, lam=2.0)
    probe = _Recorder(inner)
    with torch.no_grad():  # a plain backwards solve, as torchdiffeq's own adjoint does it
        torchdiffeq.odeint(probe, torch.randn(3, 4, dtype=torch.float64),
                           torch.tensor([times[-1], times[0]], dtype=torch.float64),
                           rtol=1e-6, atol=1e-8)
    lo, hi = min(times), max(times)
    assert min(probe.times) < lo or max(probe.times) > hi, "the overshoot case must be exercised"

    func = _Recorder(inner)
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    stats = ode.ODEStats(grad="interpolated", method="dopri5")
    ys = ode.odeint(func, y0, torch.tensor(times, dtype=torch.float64), rtol=1e-6, atol=1e-8,
                    n_nodes=9, stats=stats, on_interp_error="warn")
    n_forward = len(func.times)
    ys.square().sum().backward()
    backward_times = func.times[n_forward:]
    assert len(backward_times) == stats.backward_nfe > 0
    assert lo <= min(backward_times) and max(backward_times) <= hi
    # each segment's solve starts exactly at its end (f0) and its last step lands on its start
    for end in times[1:]:
        assert end in backward_times
    assert y0.grad is not None and torch.isfinite(y0.grad).all()


def test_forward_matches_plain_solve_at_no_extra_evaluations():
    """Nodes come from dense output: same outputs and function evaluations as torchdiffeq."""
    func = _Recorder(MLPDynamics(dim=4, hidden=16))
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.0, 0.5, 1.5], dtype=torch.float64)
    with torch.no_grad():
        plain = torchdiffeq.odeint(func, y0, t, rtol=1e-7, atol=1e-9)
    plain_nfe = len(func.times)
    stats = ode.ODEStats(grad="interpolated", method="dopri5")
    ys = ode.odeint(func, y0, t, rtol=1e-7, atol=1e-9, n_nodes=33, stats=stats)
    assert torch.equal(ys.detach(), plain)
    assert stats.forward_nfe == plain_nfe == len(func.times) - plain_nfe
    assert stats.backward_nfe == 0  # backward has not run
    assert stats.stored_bytes == (2 * 32 + 1) * y0.numel() * 8
    ys.sum().backward()
    assert stats.backward_nfe > 0


def test_inference_stores_nothing():
    func = MLPDynamics(dim=4, hidden=16)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    y0 = torch.randn(3, 4, dtype=torch.float64)
    stats = ode.ODEStats(grad="interpolated", method="dopri5")
    with torch.no_grad():
        ys = ode.odeint(func, y0, t, stats=stats)
    assert stats.stored_bytes == 0 and stats.segments == 0
    assert torch.equal(ys, torchdiffeq.odeint(func, y0, t, rtol=1e-7, atol=1e-9))


def test_gradients_for_every_output_time_and_parameter():
    """Never a silent None: y0, every t entry and every parameter get a gradient."""
    func = MLPDynamics(dim=4, hidden=16)
    _, got = _grads(func, torch.randn(3, 4, dtype=torch.float64),
                    torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), wrt_t=True)
    assert all(g is not None and torch.isfinite(g).all() for g in got)
    assert bool((got[-1] != 0).all())


def _contracting_setup():
    func = MLPDynamics(dim=4, hidden=16, lam=20.0)
    y0 = torch.randn(3, 4, dtype=torch.float64)
    return func, y0, torch.tensor([0.0, 1.0], dtype=torch.float64)


def test_policy_raise():
    func, y0, t = _contracting_setup()
    with pytest.raises(ode.InterpolationError, match="sub-grid") as info:
        ode.odeint(func, y0.requires_grad_(), t, rtol=1e-6, atol=1e-8, n_nodes=5,
                   on_interp_error="raise")
    assert info.value.estimate > info.value.interp_tol == pytest.approx(1e-2)
    assert info.value.interval == (0.0, 1.0)


def test_policy_warn_names_the_fix():
    func, y0, t = _contracting_setup()
    with pytest.warns(ode.InterpolationWarning, match="n_nodes=9 instead of 5") as record:
        ode.odeint(func, y0.requires_grad_(), t, rtol=1e-6, atol=1e-8, n_nodes=5)
    assert record[0].filename == __file__  # points at the caller


def test_policy_refine_and_fallback_recover_accuracy():
    func, y0, t = _contracting_setup()
    _, ref = _grads(func, y0, t, grad="backprop", rtol=1e-10, atol=1e-12)
    errs, stats = {}, {}
    for policy in ("warn", "refine", "fallback"):
        stats[policy] = ode.ODEStats(grad="interpolated", method="dopri5")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ode.InterpolationWarning)
            _, got = _grads(func, y0, t, rtol=1e-7, atol=1e-9, n_nodes=9, on_interp_error=policy,
                            stats=stats[policy])
        errs[policy] = rel_err(flat(got), flat(ref))
    assert stats["warn"].interp_error > 1e-2 and errs["warn"] > 1e-5, errs  # measured 1.5e-5
    assert stats["refine"].refined >= 1 and stats["refine"].segments > 1
    assert stats["refine"].interp_error <= 1e-7 ** (1 / 3)
    assert stats["refine"].forward_nfe > stats["warn"].forward_nfe  # the price of refining
    assert stats["fallback"].fallback_segments == 1 and stats["fallback"].interp_error is None
    assert max(errs["refine"], errs["fallback"]) < min(1e-6, errs["warn"] / 10), errs


def test_refine_warns_when_bisections_run_out():
    func, y0, t = _contracting_setup()
    stats = ode.ODEStats(grad="interpolated", method="dopri5")
    with pytest.warns(ode.InterpolationWarning, match="after 1 bisections"):
        ode.odeint(func, y0.requires_grad_(), t, rtol=1e-6, atol=1e-8, n_nodes=5,
                   on_interp_error="refine", max_refine=1, stats=stats)
    assert stats.refined == 1 and stats.segments == 2


def test_parameters_changed_before_backward_raise():
    func = MLPDynamics(dim=4, hidden=16)
    ys = ode.odeint(func, torch.randn(3, 4, dtype=torch.float64, requires_grad=True),
                    torch.tensor([0.0, 1.0], dtype=torch.float64))
    with torch.no_grad():
        func.l1.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        ys.sum().backward()


def test_double_backward_is_refused():
    func = MLPDynamics(dim=4, hidden=16)
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ys = ode.odeint(func, y0, torch.tensor([0.0, 1.0], dtype=torch.float64))
    (g,) = torch.autograd.grad(ys.sum(), y0, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        g.sum().backward()
