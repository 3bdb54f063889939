"""Barycentric interpolant and nested error estimate (ode.interp)."""
from __future__ import annotations

import pytest
import torch

import ode
from ode.interp import LobattoInterpolant, barycentric_matrix, nested_error
from ode.nodes import lobatto_weights, segment_nodes


def test_interpolant_is_exact_at_nodes_and_follows_value_dtype():
    tau = segment_nodes(0.0, 2.0, 9)
    values = torch.randn(9, 3, dtype=torch.float32)
    interp = LobattoInterpolant(tau, values)
    assert interp.nodes.dtype == torch.float64 and interp.weights.dtype == torch.float64
    for j in (0, 4, 8):
        out = interp(tau[j])
        assert out.dtype == torch.float32
        assert torch.equal(out, values[j])


def test_interpolant_refuses_to_extrapolate():
    tau = segment_nodes(1.0, 0.0, 5)  # reversed segment
    interp = LobattoInterpolant(tau, torch.randn(5, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="outside"):
        interp(torch.tensor(1.001, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="bug"):
        interp(torch.tensor(-1e-3, dtype=torch.float64))


def test_interpolant_accepts_rounding_to_float32_and_denormal_nudges():
    tau = segment_nodes(0.1, 0.7, 9)
    values = torch.randn(9, 2, dtype=torch.float32)
    interp = LobattoInterpolant(tau, values)
    end32 = torch.tensor(0.7, dtype=torch.float32)  # 0.699999988 or 0.700000048 in float32
    assert torch.allclose(interp(end32), values[-1], atol=1e-5)
    tau0 = segment_nodes(0.0, 1.0, 5)
    values0 = torch.randn(5, 2, dtype=torch.float64)
    # torchdiffeq nudges a stage at t = 0 to the smallest denormal; w / diff would overflow
    out = LobattoInterpolant(tau0, values0)(torch.tensor(5e-324, dtype=torch.float64))
    assert torch.isfinite(out).all() and torch.equal(out, values0[0])


def _true_subgrid_error(f, start, end, n, atol, points=4001):
    m = (n + 1) // 2
    tau_c = segment_nodes(start, end, m)
    t = torch.linspace(start, end, points, dtype=torch.float64)
    approx = torch.tensordot(barycentric_matrix(tau_c, lobatto_weights(m), t), f(tau_c), dims=1)
    exact = f(t)
    return float((approx - exact).abs().max() / (f(segment_nodes(start, end, n)).abs().max() + atol))


CASES = {
    # name: (A of y' = A y, T, n_nodes) — exact solution expm(A t) y0
    "decay-lam20": (torch.tensor([[-20.0, 0.0], [0.0, -1.0]]), 1.0, 17),
    "rotation": (torch.tensor([[0.0, 6.0], [-6.0, 0.0]]), 2.0, 17),
    "mixed-n9": (torch.tensor([[-3.0, 4.0], [-4.0, -3.0]]), 1.5, 9),
    "slow-n33": (torch.tensor([[-30.0, 1.0], [0.0, -0.5]]), 1.0, 33),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_estimate_within_2x_of_true_interpolation_error(case):
    """The nested-grid estimate (stats.interp_error, from the solver's nodes) against the true
    max error of the sub-grid interpolant of the exact solution on a dense grid."""
    a, T, n = CASES[case]
    a = a.double()
    y0 = torch.tensor([[1.0, 0.5]], dtype=torch.float64)
    exact = lambda t: torch.stack([y0[0] @ torch.linalg.matrix_exp(a * s).T for s in t])  # noqa
    func = lambda t, y: y @ a.T  # noqa: E731
    stats = ode.ODEStats(grad="interpolated", method="dopri5")
    ode.odeint(func, y0.clone().requires_grad_(), torch.tensor([0.0, T], dtype=torch.float64),
               rtol=1e-12, atol=1e-14, n_nodes=n, adjoint_params=(), stats=stats,
               on_interp_error="warn", interp_tol=1.0)
    true = _true_subgrid_error(lambda t: exact(t)[:, :], 0.0, T, n, 1e-14)
    assert true > 1e-9, "the case must be interpolation-dominated to test the estimate"
    assert 0.5 * true <= stats.interp_error <= 2.0 * true, (stats.interp_error, true)


def test_nested_error_is_zero_for_low_degree():
    tau = segment_nodes(0.0, 1.0, 9)
    values = torch.stack([1 + 2 * tau + tau**3, tau**4], dim=1)  # degree <= m-1 = 4
    assert nested_error(tau, values, atol=1e-12) < 1e-14
