"""Optimal piecewise-constant approximations of an activation's derivative.

Few-bit backward (Novikov et al., "Few-Bit Backward: Quantized Gradients of Activation Functions for
Memory Footprint Reduction", ICML 2022) replaces the derivative ``f'`` of a pointwise nonlinearity by a
step function ``q`` with ``K = 2**bits`` pieces. Forward stores only which piece each input fell in
(``bits`` bits per element); backward multiplies the incoming gradient by that piece's level.

This module finds the L2-optimal steps:

    minimise over borders x_1 < ... < x_{K-1} and levels y_1..y_K
        J = integral over [L, R] of (f'(x) - q(x))**2 w(x) dx,    q = y_k on (x_{k-1}, x_k].

For fixed borders the best level of an interval is the w-weighted mean of ``f'`` on it, and the
interval's cost is ``dF2 - dF1**2 / dW`` with the cumulative integrals ``W = int w``,
``F1 = int f' w`` and ``F2 = int f'**2 w``. The borders are then found exactly over a grid of ``n``
candidate points by dynamic programming, ``dp_k(j) = min_{i<j} dp_{k-1}(i) + c(x_i, x_j)``, in
``O(K n**2)`` time.

# NOTE [ Default weight ]
``weight="uniform"`` (``w = 1`` on the domain ``[-10, 10]``) is the default, as in the paper; it
reproduces the reference values of shared/notes/quant-ode-prior-art.md. The alternative
``weight="normal"`` (the N(0, 1) input density) is better *when inputs really are N(0, 1)* and worse
when they are wider, because it fits the outer levels only near the inner borders. Relative gradient
error :func:`gradient_error` for inputs ~ N(0, sigma**2), uniform / normal weight (script:
``python -m quant.fewbit.generate --compare-weights``)::

                    sigma = 1        sigma = 3
    GELU     2 bit  0.136 / 0.132    0.095 / 0.091
    GELU     4 bit  0.042 / 0.036    0.027 / 0.071
    SiLU     2 bit  0.155 / 0.144    0.100 / 0.135
    Tanh     2 bit  0.242 / 0.182    0.280 / 0.447
    Sigmoid  2 bit  0.182 / 0.098    0.249 / 0.476
    ELU      2 bit  0.090 / 0.065    0.071 / 0.131

The scale of pre-activations in a network is not known in advance and changes during training, so
the shipped tables use the weight that never fails badly. Fit with ``weight="normal"`` or a callable
density when the input distribution is known. (Uniform-weight 1-bit tables of Tanh and Sigmoid are
poor, 0.79 / 0.67 relative error: their derivative is a bump that one border cannot follow; use
2 bits or more for them.)
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Union

import numpy as np
import torch

from quant.fewbit._checks import check_bits, internal_assert

__all__ = [
    "DEFAULT_DOMAIN",
    "DEFAULT_GRID",
    "METHODS",
    "StepwiseTable",
    "WEIGHTS",
    "fit_stepwise",
    "gradient_error",
]

#: Domain the default tables are fitted on; inputs outside it fall in the first or last interval.
DEFAULT_DOMAIN = (-10.0, 10.0)
#: Candidate border points of the default grid: a spacing of 0.01 on [-10, 10], so every integer
#: (where Hardswish, ELU and friends have kinks) is a grid point.
DEFAULT_GRID = 2001
#: Gauss-Legendre nodes per grid cell for the cumulative integrals: exact for polynomials of degree
#: 15 on each cell; the supported derivatives are smooth inside cells (kinks sit on grid points), so
#: the integrals are accurate to ~1e-13.
QUADRATURE_NODES = 8
#: Largest grid accepted: the DP holds a few n x n float64 matrices (4097 -> ~400 MB).
MAX_GRID = 4097

WeightFn = Callable[[torch.Tensor], torch.Tensor]


def _uniform_weight(x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(x)


def _normal_weight(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


#: Named weight functions ``w(x)`` for :func:`fit_stepwise`; see NOTE [ Default weight ].
WEIGHTS: Mapping[str, WeightFn] = {"uniform": _uniform_weight, "normal": _normal_weight}


@dataclasses.dataclass(frozen=True)
class StepwiseTable:
    """A piecewise-constant approximation ``q`` of an activation's derivative.

    ``q(x) = levels[k]`` where ``k`` is the number of borders strictly below ``x``
    (``torch.bucketize(x, borders)``): interval ``k`` is ``(borders[k-1], borders[k]]``.

    Attributes:
        bits: Code width; there are ``2**bits`` levels.
        borders: ``2**bits - 1`` increasing inner borders.
        levels: ``2**bits`` derivative values, one per interval.
        objective: The weighted L2 error ``int (f' - q)**2 w dx`` over ``domain``.
        weight: Name of the weight (``"custom"`` for a callable).
        domain: ``(lo, hi)`` the objective was integrated over.
        grid: Number of candidate border points on ``domain``.
        method: ``"dp"`` (optimal) or ``"equal_width"`` (naive baseline).
    """

    bits: int
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    objective: float
    weight: str = "uniform"
    domain: tuple[float, float] = DEFAULT_DOMAIN
    grid: int = DEFAULT_GRID
    method: str = "dp"

    def __post_init__(self) -> None:
        k = 2**self.bits
        internal_assert(len(self.levels) == k, f"{len(self.levels)} levels for {self.bits} bits")
        internal_assert(len(self.borders) == k - 1, f"{len(self.borders)} borders for {k} levels")
        internal_assert(
            all(a < b for a, b in zip(self.borders, self.borders[1:])),
            f"borders not increasing: {self.borders}",
        )

    def derivative(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluate ``q(x)`` elementwise, in ``x``'s dtype and on its device."""
        borders = torch.tensor(self.borders, dtype=x.dtype, device=x.device)
        levels = torch.tensor(self.levels, dtype=x.dtype, device=x.device)
        return levels[torch.bucketize(x, borders)]


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _check_domain(domain: object) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in domain)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise TypeError(
            f"domain={domain!r}: expected a pair (lo, hi) of finite numbers; pass e.g. "
            f"domain=(-10, 10)"
        ) from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(
            f"domain={domain!r}: expected finite lo < hi; pass e.g. domain=(-10, 10)"
        )
    return lo, hi


def _check_grid(grid: object, bits: int) -> int:
    pieces = 2**bits
    if isinstance(grid, bool) or not isinstance(grid, int):
        raise TypeError(f"grid={grid!r}: expected an int number of points; pass e.g. grid=2001")
    if not pieces + 1 <= grid <= MAX_GRID:
        raise ValueError(
            f"grid={grid}: {2**bits} pieces need between {pieces + 1} and {MAX_GRID} grid points "
            f"(the DP is O(2**bits * grid**2)); pass e.g. grid={DEFAULT_GRID}"
        )
    return grid


def _resolve_weight(weight: Union[str, WeightFn]) -> tuple[str, WeightFn]:
    if isinstance(weight, str):
        if weight not in WEIGHTS:
            raise ValueError(
                f"weight={weight!r}: unknown weight; choose one of {sorted(WEIGHTS)} or pass a "
                f"callable w(x) >= 0"
            )
        return weight, WEIGHTS[weight]
    if callable(weight):
        return "custom", weight
    raise TypeError(
        f"weight={weight!r}: expected one of {sorted(WEIGHTS)} or a callable w(x) >= 0"
    )


def _derivative(fn: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray) -> np.ndarray:
    """``fn'`` at ``x`` by autograd in float64 (``fn`` must be elementwise)."""
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        y = fn(xt)
        if not isinstance(y, torch.Tensor) or y.shape != xt.shape:
            raise TypeError(
                f"fn={fn!r}: expected an elementwise function returning a tensor of the input's "
                f"shape; got {type(y).__name__} {getattr(y, 'shape', '')}"
            )
        if not y.requires_grad:
            raise TypeError(
                f"fn={fn!r}: its output does not depend differentiably on the input; pass a "
                f"function built from differentiable torch operations"
            )
        (grad,) = torch.autograd.grad(y.sum(), xt)
    d = grad.detach().numpy()
    if not np.all(np.isfinite(d)):
        raise ValueError(f"fn={fn!r}: its derivative is not finite on the fitting domain")
    return d


def _weight_values(weight_fn: WeightFn, x: np.ndarray) -> np.ndarray:
    w = weight_fn(torch.tensor(x, dtype=torch.float64))
    w = np.asarray(w.detach().cpu().numpy() if isinstance(w, torch.Tensor) else w, dtype=np.float64)
    if w.shape != x.shape or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(
            "weight: a weight function must return finite values >= 0 of the input's shape"
        )
    return w


# --------------------------------------------------------------------------------------------------
# Cumulative integrals and interval costs
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Integrals:
    """Cumulative integrals at the grid points: W = int w, F1 = int f' w, F2 = int f'^2 w."""

    grid: np.ndarray
    W: np.ndarray
    F1: np.ndarray
    F2: np.ndarray
    f: np.ndarray  # fn at the grid points, for the level of a zero-weight interval

    def cost(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Cost of the intervals [grid[i], grid[j]] with their optimal level (broadcasting)."""
        dW = self.W[j] - self.W[i]
        dF1 = self.F1[j] - self.F1[i]
        dF2 = self.F2[j] - self.F2[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(dW > 0, dF2 - dF1 * dF1 / dW, dF2)
        return np.maximum(c, 0.0)  # cancellation can leave -1e-17

    def cost_matrix(self) -> np.ndarray:
        """``C[j, i]`` = cost of the interval [grid[i], grid[j]]; ``inf`` where ``i >= j``.

        Row ``j`` holds every interval ending at ``grid[j]``, so the DP's minimum over the start
        ``i`` runs along contiguous rows.
        """
        n = self.grid.size
        cost = np.subtract.outer(self.F2, self.F2)
        d1 = np.subtract.outer(self.F1, self.F1)
        dw = np.subtract.outer(self.W, self.W)
        positive = dw > 0
        np.multiply(d1, d1, out=d1)
        np.divide(d1, dw, out=d1, where=positive)
        d1[~positive] = 0.0  # zero-weight interval: cost dF2 (zero too)
        cost -= d1
        np.maximum(cost, 0.0, out=cost)  # cancellation can leave -1e-17
        idx = np.arange(n)
        cost[idx[None, :] >= idx[:, None]] = np.inf  # intervals must be non-empty
        return cost

    def level(self, i: int, j: int) -> float:
        """Optimal level on [grid[i], grid[j]]: the w-weighted mean of f'."""
        dW = self.W[j] - self.W[i]
        if dW > 0:
            return float((self.F1[j] - self.F1[i]) / dW)
        # zero weight: any level is optimal; take the plain mean of f'
        return float((self.f[j] - self.f[i]) / (self.grid[j] - self.grid[i]))


def _grid_points(lo: float, hi: float, n: int) -> np.ndarray:
    g = np.linspace(lo, hi, n)
    pretty = np.round(g, 12)  # 0.47 rather than 0.47000000000000064 in the shipped tables
    step = (hi - lo) / (n - 1)
    if pretty[0] == lo and pretty[-1] == hi and np.all(np.diff(pretty) > 0.5 * step):
        return pretty
    return g


def _integrals(fn, weight_fn: WeightFn, lo: float, hi: float, n: int) -> _Integrals:
    grid = _grid_points(lo, hi, n)
    nodes, qw = np.polynomial.legendre.leggauss(QUADRATURE_NODES)
    a, b = grid[:-1, None], grid[1:, None]
    x = (0.5 * (b - a) * nodes + 0.5 * (a + b)).ravel()
    scale = (0.5 * (b - a) * qw).ravel()
    d = _derivative(fn, x)
    w = _weight_values(weight_fn, x) * scale
    cells = n - 1
    zero = np.zeros(1)
    W = np.concatenate([zero, np.cumsum((w).reshape(cells, -1).sum(1))])
    F1 = np.concatenate([zero, np.cumsum((w * d).reshape(cells, -1).sum(1))])
    F2 = np.concatenate([zero, np.cumsum((w * d * d).reshape(cells, -1).sum(1))])
    with torch.no_grad():
        f = fn(torch.tensor(grid, dtype=torch.float64)).numpy()
    return _Integrals(grid=grid, W=W, F1=F1, F2=F2, f=f)


# --------------------------------------------------------------------------------------------------
# Border search methods
# --------------------------------------------------------------------------------------------------


def _dp_borders(integrals: _Integrals, pieces: int) -> list[int]:
    """Optimal border indices by dynamic programming over the grid, O(pieces * n**2)."""
    n = integrals.grid.size
    cost = integrals.cost_matrix()  # cost[j, i]: interval [g_i, g_j]
    rows = np.arange(n)
    best = cost[:, 0].copy()  # best[j]: one piece covering [g_0, g_j]
    total = np.empty_like(cost)
    back = []
    for _ in range(2, pieces):  # best[j] for k pieces covering [g_0, g_j], k = 2 .. pieces - 1
        np.add(cost, best[None, :], out=total)
        arg = np.argmin(total, axis=1)
        best = total[rows, arg]
        back.append(arg)
    j = int(np.argmin(best + cost[n - 1]))  # the last piece ends at the domain's end
    borders = [j]
    for arg in reversed(back):
        j = int(arg[j])
        borders.append(j)
    borders.reverse()
    internal_assert(
        len(borders) == pieces - 1
        and all(0 < b < n - 1 for b in borders)
        and all(a < b for a, b in zip(borders, borders[1:])),
        f"DP produced invalid border indices {borders}",
    )
    return borders


def _equal_width_borders(integrals: _Integrals, pieces: int) -> list[int]:
    """Naive baseline: borders equally spaced over the domain, snapped to the grid."""
    n = integrals.grid.size
    raw = np.round(np.arange(1, pieces) * (n - 1) / pieces).astype(int)
    return sorted(set(int(v) for v in np.clip(raw, 1, n - 2)))


#: Border search methods for :func:`fit_stepwise`.
METHODS: Mapping[str, Callable[[_Integrals, int], list[int]]] = {
    "dp": _dp_borders,
    "equal_width": _equal_width_borders,
}


def fit_stepwise(
    fn: Callable[[torch.Tensor], torch.Tensor],
    bits: int,
    *,
    weight: Union[str, WeightFn] = "uniform",
    domain: Sequence[float] = DEFAULT_DOMAIN,
    grid: int = DEFAULT_GRID,
    method: str = "dp",
) -> StepwiseTable:
    """Fit the L2-optimal step approximation of ``fn'`` with ``2**bits`` levels.

    Implements the optimal quantization of Novikov et al., "Few-Bit Backward" (ICML 2022): borders
    by an exact O(2**bits * grid**2) dynamic program over ``grid`` candidate points, levels as
    the weighted mean of ``fn'`` on each interval (the optimum for given borders). See the module
    docstring for the objective and NOTE [ Default weight ] for the choice of ``weight``.

    Args:
        fn: Elementwise activation, a torch function (``torch.nn.functional.gelu``); its derivative
            is taken by autograd in float64.
        bits: Code width, 1-4 (2, 4, 8 or 16 levels).
        weight: ``"uniform"`` (default), ``"normal"`` (N(0, 1) density) or a callable ``w(x) >= 0``
            taking and returning a float64 tensor.
        domain: ``(lo, hi)`` interval of the objective; borders lie strictly inside it.
        grid: Number of equally spaced candidate border points on ``domain`` (ends included).
        method: ``"dp"`` (optimal) or ``"equal_width"`` (naive baseline with optimal levels).

    Returns:
        The fitted :class:`StepwiseTable` with its objective value.

    Raises:
        ValueError: ``bits`` outside 1-4, an empty or infinite ``domain``, ``grid`` too small or too
            large, an unknown ``weight`` or ``method``, or a non-finite derivative.
        TypeError: ``fn`` is not an elementwise differentiable torch function.

    Example:
        >>> import torch.nn.functional as F
        >>> table = fit_stepwise(F.gelu, 2)
        >>> [round(b, 2) for b in table.borders]
        [-0.47, 0.0, 0.47]
    """
    bits = check_bits(bits)
    lo, hi = _check_domain(domain)
    n = _check_grid(grid, bits)
    weight_name, weight_fn = _resolve_weight(weight)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: unknown method; choose one of {sorted(METHODS)}")
    integrals = _integrals(fn, weight_fn, lo, hi, n)
    pieces = 2**bits
    inner = METHODS[method](integrals, pieces)
    ends = [0, *inner, n - 1]
    starts, stops = np.array(ends[:-1]), np.array(ends[1:])
    return StepwiseTable(
        bits=bits,
        borders=tuple(float(integrals.grid[i]) for i in inner),
        levels=tuple(integrals.level(i, j) for i, j in zip(ends[:-1], ends[1:])),
        objective=float(integrals.cost(starts, stops).sum()),
        weight=weight_name,
        domain=(lo, hi),
        grid=n,
        method=method,
    )


def gradient_error(
    fn: Callable[[torch.Tensor], torch.Tensor],
    table: StepwiseTable,
    *,
    sigma: float = 1.0,
    cells: int = 8192,
) -> float:
    """Expected relative gradient error of ``table`` for inputs ``x ~ N(0, sigma**2)``.

    ``sqrt(E[(f'(x) - q(x))**2] / E[f'(x)**2])``, by Gauss-Legendre quadrature over
    ``[-12 sigma, 12 sigma]`` with the table's borders and every integer as cell ends (the kinks of
    the supported activations). For a backward ``grad_in = g * q(x)`` with ``g`` independent of
    ``x`` this is also the expected relative error of the input gradient.

    Args:
        fn: The activation the table approximates (see :func:`fit_stepwise`).
        table: The step approximation.
        sigma: Standard deviation of the inputs (> 0).
        cells: Number of quadrature cells before inserting breakpoints.

    Returns:
        The relative error (0 for an exact table).

    Raises:
        ValueError: ``sigma`` not positive and finite, or ``fn'`` is zero almost everywhere.
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r}: expected a positive finite standard deviation")
    lo, hi = -12.0 * sigma, 12.0 * sigma
    breaks = [b for b in table.borders if lo < b < hi]
    breaks += [float(k) for k in range(math.ceil(lo), math.floor(hi) + 1)]
    edges = np.unique(np.concatenate([np.linspace(lo, hi, cells + 1), breaks]))
    nodes, qw = np.polynomial.legendre.leggauss(QUADRATURE_NODES)
    a, b = edges[:-1, None], edges[1:, None]
    x = (0.5 * (b - a) * nodes + 0.5 * (a + b)).ravel()
    w = (0.5 * (b - a) * qw).ravel() * np.exp(-0.5 * (x / sigma) ** 2)
    d = _derivative(fn, x)
    q = table.derivative(torch.tensor(x, dtype=torch.float64)).numpy()
    denom = float(np.sum(w * d * d))
    if denom <= 0:
        raise ValueError(f"fn={fn!r}: its derivative is zero almost everywhere; no relative error")
    return math.sqrt(float(np.sum(w * (d - q) ** 2)) / denom)
