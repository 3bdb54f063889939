"""fit_stepwise: the O(K n^2) dynamic program of Novikov et al. (ICML 2022) and its objective."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quant.fewbit import StepwiseTable, fit_stepwise, gradient_error

# Reference values measured with an independent prototype (shared/notes/quant-ode-prior-art.md):
# GELU, uniform weight on [-10, 10].
GELU_2BIT_BORDERS = (-0.469, 0.0, 0.469)
GELU_2BIT_LEVELS = (-0.0157, 0.3196, 0.6804, 1.0157)
GELU_REL_ERRORS = {1: 0.320, 2: 0.136, 3: 0.086, 4: 0.042}
#: Our default grid has spacing 0.01, so a border can sit one grid step from the prototype's.
BORDER_TOL = 0.011
#: A border moved by 0.001 moves the adjacent levels by about 0.001 * f'' / width ~ 5e-4.
LEVEL_TOL = 1e-3
#: The notes give the errors to three decimals.
REL_ERROR_TOL = 0.0015


def test_gelu_2bit_matches_reference_prototype():
    table = fit_stepwise(F.gelu, 2)
    assert table.borders == pytest.approx(GELU_2BIT_BORDERS, abs=BORDER_TOL)
    assert table.levels == pytest.approx(GELU_2BIT_LEVELS, abs=LEVEL_TOL)


@pytest.mark.parametrize("bits", [1, 2, 3, 4], ids=lambda b: f"{b}bit")
def test_gelu_relative_gradient_error_matches_reference(bits):
    table = fit_stepwise(F.gelu, bits)
    assert gradient_error(F.gelu, table) == pytest.approx(GELU_REL_ERRORS[bits], abs=REL_ERROR_TOL)


def _objective_brute_force(fn, borders, levels, lo=-10.0, hi=10.0, n=400_001):
    """int (f' - q)^2 dx by the trapezoid rule on a fine grid, independent of fit.py."""
    x = torch.linspace(lo, hi, n, dtype=torch.float64, requires_grad=True)
    (d,) = torch.autograd.grad(fn(x).sum(), x)
    q = torch.tensor(levels, dtype=torch.float64)[
        torch.bucketize(x.detach(), torch.tensor(borders, dtype=torch.float64))
    ]
    return float(torch.trapezoid((d - q) ** 2, x.detach()))


#: Trapezoid rule with spacing 5e-5 over jumps of q: error ~ h * jump^2 per border.
BRUTE_FORCE_RTOL = 1e-3


@pytest.mark.parametrize("fn", [F.gelu, torch.tanh, F.silu], ids=["gelu", "tanh", "silu"])
def test_objective_is_the_integral_of_the_squared_error(fn):
    table = fit_stepwise(fn, 2)
    expected = _objective_brute_force(fn, table.borders, table.levels)
    assert table.objective == pytest.approx(expected, rel=BRUTE_FORCE_RTOL)


def test_levels_are_interval_means_of_the_derivative():
    # uniform weight: the optimal level is (f(b) - f(a)) / (b - a)
    table = fit_stepwise(F.gelu, 3)
    ends = (-10.0, *table.borders, 10.0)
    f = F.gelu(torch.tensor(ends, dtype=torch.float64)).tolist()
    means = [(f[i + 1] - f[i]) / (ends[i + 1] - ends[i]) for i in range(len(ends) - 1)]
    assert table.levels == pytest.approx(means, abs=1e-10)


def _cumulative(weight, grid_points, nodes=40):
    """W, F1, F2 at the grid points by Gauss-Legendre per cell (independent of fit.py)."""
    x_nodes, w_nodes = np.polynomial.legendre.leggauss(nodes)
    a, b = grid_points[:-1, None], grid_points[1:, None]
    xs = (0.5 * (b - a) * x_nodes + 0.5 * (a + b)).ravel()
    ws = (0.5 * (b - a) * w_nodes).ravel()
    if weight == "normal":
        ws = ws * np.exp(-0.5 * xs**2) / math.sqrt(2 * math.pi)
    x = torch.tensor(xs, requires_grad=True)
    (d,) = torch.autograd.grad(F.gelu(x).sum(), x)
    d = d.numpy()
    cells = len(grid_points) - 1
    zero = np.zeros(1)
    return [
        np.concatenate([zero, np.cumsum(v.reshape(cells, -1).sum(1))])
        for v in (ws, ws * d, ws * d * d)
    ]


@pytest.mark.parametrize("weight", ["uniform", "normal"])
@pytest.mark.parametrize("bits", [1, 2], ids=lambda b: f"{b}bit")
def test_dp_equals_exhaustive_search_on_a_small_grid(bits, weight):
    grid = 41
    table = fit_stepwise(F.gelu, bits, grid=grid, domain=(-4, 4), weight=weight)
    points = np.linspace(-4, 4, grid)
    W, F1, F2 = _cumulative(weight, points)
    inner = np.array(list(itertools.combinations(range(1, grid - 1), 2**bits - 1)))
    ends = np.concatenate(
        [np.zeros((len(inner), 1), int), inner, np.full((len(inner), 1), grid - 1)], axis=1
    )
    i, j = ends[:, :-1], ends[:, 1:]
    cost = (F2[j] - F2[i] - (F1[j] - F1[i]) ** 2 / (W[j] - W[i])).sum(axis=1)
    best = inner[np.argmin(cost)]
    assert table.objective == pytest.approx(cost.min(), rel=1e-9)
    assert table.borders == pytest.approx(tuple(points[best]), abs=1e-12)


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"{b}bit")
def test_dp_beats_equal_width_split(bits):
    dp = fit_stepwise(F.gelu, bits)
    naive = fit_stepwise(F.gelu, bits, method="equal_width")
    assert naive.method == "equal_width"
    assert dp.objective < 0.5 * naive.objective  # measured: 0.29x (2 bit) .. 0.03x (4 bit)


def test_borders_stable_across_grids():
    # the notes: borders stable for grids of 512-4096 points
    reference = fit_stepwise(F.gelu, 2, grid=4001).borders
    for grid in (513, 1001, 2001):
        assert fit_stepwise(F.gelu, 2, grid=grid).borders == pytest.approx(reference, abs=0.04)


def test_normal_weight_differs_and_callable_weight_matches_named():
    uniform = fit_stepwise(torch.tanh, 2)
    normal = fit_stepwise(torch.tanh, 2, weight="normal")
    custom = fit_stepwise(
        torch.tanh, 2, weight=lambda x: torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    )
    assert normal.borders != uniform.borders
    assert custom.borders == normal.borders and custom.weight == "custom"
    assert custom.levels == pytest.approx(normal.levels, rel=1e-12)
    # the normal-weight table is better for N(0, 1) inputs (what it optimises)
    assert gradient_error(torch.tanh, normal) < gradient_error(torch.tanh, uniform)


def test_table_derivative_evaluates_steps():
    table = StepwiseTable(bits=1, borders=(0.5,), levels=(-1.0, 2.0), objective=0.0)
    x = torch.tensor([-3.0, 0.5, 0.6, 7.0], dtype=torch.float64)
    assert table.derivative(x).tolist() == [-1.0, -1.0, 2.0, 2.0]  # right-closed like bucketize


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"bits": 0}, ValueError, "bits=0"),
        ({"bits": 5}, ValueError, "bits=5"),
        ({"bits": 2.0}, TypeError, "bits=2.0"),
        ({"bits": True}, TypeError, "bits=True"),
        ({"bits": 2, "domain": (1, -1)}, ValueError, "domain"),
        ({"bits": 2, "domain": (-math.inf, 1)}, ValueError, "domain"),
        ({"bits": 2, "domain": 3}, TypeError, "domain"),
        ({"bits": 2, "grid": 4}, ValueError, "grid=4"),
        ({"bits": 2, "grid": 100_000}, ValueError, "grid=100000"),
        ({"bits": 2, "weight": "laplace"}, ValueError, "weight='laplace'"),
        ({"bits": 2, "method": "lloyd"}, ValueError, "method='lloyd'"),
    ],
    ids=["bits0", "bits5", "bits-float", "bits-bool", "domain-reversed", "domain-inf",
         "domain-scalar", "grid-small", "grid-large", "weight", "method"],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        fit_stepwise(F.gelu, **kwargs)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.sum(), lambda x: x.detach(), lambda x: torch.sqrt(x)],
    ids=["not-elementwise", "not-differentiable", "non-finite-derivative"],
)
def test_bad_functions_raise(fn):
    with pytest.raises((TypeError, ValueError), match="fn="):
        fit_stepwise(fn, 2)
