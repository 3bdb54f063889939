"""Chebyshev–Lobatto nodes and weights (ode.nodes)."""
from __future__ import annotations

import math

import pytest
import torch

from ode.interp import barycentric_matrix
from ode.nodes import lobatto_nodes, lobatto_weights, segment_nodes

# A degree n-1 polynomial through n nodes must be reproduced to rounding; 1e-12 leaves room for
# the ~1e-14 cancellation of the alternating barycentric sums at n = 33.
POLY_TOL = 1e-12


@pytest.mark.parametrize("n", [3, 9, 17, 33], ids=lambda n: f"n{n}")
def test_nodes_are_lobatto_points_with_exact_ends(n):
    s = lobatto_nodes(n)
    assert s.dtype == torch.float64
    assert s[0].item() == 0.0 and s[-1].item() == 1.0
    expected = [(1 - math.cos(math.pi * j / (n - 1))) / 2 for j in range(n)]
    assert torch.allclose(s, torch.tensor(expected, dtype=torch.float64), atol=1e-15, rtol=0)
    assert bool((s[1:] > s[:-1]).all())


def test_weights_are_second_kind():
    assert lobatto_weights(5).tolist() == [0.5, -1.0, 1.0, -1.0, 0.5]
    assert lobatto_weights(4).tolist() == [0.5, -1.0, 1.0, -0.5]


@pytest.mark.parametrize("n", [3, 9, 17, 33], ids=lambda n: f"n{n}")
def test_nested_grid_even_nodes_are_coarse_nodes(n):
    m = (n + 1) // 2
    assert torch.equal(lobatto_nodes(n)[0::2], lobatto_nodes(m)) or torch.allclose(
        lobatto_nodes(n)[0::2], lobatto_nodes(m), atol=2e-16, rtol=0)


@pytest.mark.parametrize("start,end", [(0.0, 1.0), (2.0, -1.5), (1e3, 1e3 + 0.25)],
                         ids=["unit", "reversed", "offset"])
@pytest.mark.parametrize("n", [5, 17], ids=lambda n: f"n{n}")
def test_barycentric_reproduces_polynomials(start, end, n):
    tau = segment_nodes(start, end, n)
    assert tau[0].item() == start and tau[-1].item() == end
    gen = torch.Generator().manual_seed(n)
    coef = torch.randn(n, dtype=torch.float64, generator=gen)
    mid, half = (start + end) / 2, (end - start) / 2

    def poly(t):  # degree n-1 in the segment's own coordinate
        x = (t - mid) / half
        return sum(c * x**k for k, c in enumerate(coef))

    t_eval = torch.linspace(min(start, end), max(start, end), 101, dtype=torch.float64)
    approx = barycentric_matrix(tau, lobatto_weights(n), t_eval) @ poly(tau)
    assert torch.allclose(approx, poly(t_eval), atol=POLY_TOL * float(poly(t_eval).abs().max()),
                          rtol=0)


@pytest.mark.parametrize("n", [9, 17], ids=lambda n: f"n{n}")
def test_first_kind_weights_with_lobatto_nodes_are_not_the_polynomial(n):
    """The reference code pairs these nodes with first-kind weights: a rational function that
    neither reproduces degree n-1 nor resolves a fast transient (the NOTE in ode.nodes)."""
    tau = segment_nodes(0.0, 1.0, n)
    j = torch.arange(n, dtype=torch.float64)
    first_kind = (-1.0) ** j * torch.sin((2 * j + 1) * math.pi / (2 * n))
    t_eval = torch.linspace(0, 1, 1001, dtype=torch.float64)

    def err(weights, f):
        return float((barycentric_matrix(tau, weights, t_eval) @ f(tau) - f(t_eval)).abs().max())

    monomial = lambda t: t ** (n - 1)  # noqa: E731
    assert err(lobatto_weights(n), monomial) < POLY_TOL
    assert err(first_kind, monomial) > 1e-4
    transient = lambda t: torch.exp(-20 * t)  # noqa: E731
    # measured 1.17x at n=9 (both too few nodes), 732x at n=17
    assert err(first_kind, transient) > (1.1 if n == 9 else 100) * err(lobatto_weights(n), transient)
