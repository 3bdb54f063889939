"""Quantization-aware CP decomposition by alternating optimisation with ADMM sub-problems.

Implements the factorization of Cherniuk, Abukhovich, Phan, Oseledets, Cichocki, Gusak,
"Quantization Aware Factorization for Deep Neural Network Compression" (2023): find CP factors
``A_1..A_N`` of a weight tensor ``X``, each constrained to a ``b``-bit grid with one scale per
factor, minimising ``||X - [[A_1..A_N]]||_F``. The outer loop cycles over the modes (AO); each
mode's sub-problem

    min_H ||X_(n) - H K_n^T||^2   s.t.  H on the grid,   K_n = Khatri-Rao of the other factors

is split into a least-squares copy ``H~`` and a grid copy ``H`` (AO-ADMM, Huang, Sidiropoulos &
Liavas, IEEE TSP 2016):

    H~^T <- (G + rho I)^-1 (F + rho (H + U))^T     G = Hadamard of the other Grams, F = MTTKRP
    H    <- Q_s(H~ - U)                            round onto the grid of scale s, clamp
    U    <- U + H - H~                             scaled dual

with ``rho = trace(G) / R`` and the Cholesky factor of ``G + rho I`` computed once per
sub-problem. See NOTE [ Fixed scale per sub-problem ], NOTE [ Dual across outer iterations ] and
NOTE [ Guard and keep-best ].
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import (
    check_bits,
    check_positive_float,
    check_positive_int,
    check_rank,
    internal_assert,
)
from ._tensor import (
    error_from_last_update,
    gram_hadamard,
    mttkrp,
    reconstruct,
    relative_error,
)
from .cp_als import INIT_RIDGE, balance_factors, cp_als
from .grid import project, search_scale, to_codes

__all__ = ["CPResult", "quantized_cp", "cp_then_quantize", "INITS"]

# NOTE [ Fixed scale per sub-problem ]
# ADMM's projection step assumes a fixed set. The reference code re-runs the clipping search at
# every projection, so the set moves at every step; a prototype (shared notes) diverged at 4 bits
# that way. Here the scale of mode n is chosen once per sub-problem, by the clipping search on the
# unconstrained least-squares solution F G^-1 of that sub-problem (what H would be without the
# grid), and held fixed during the inner iterations. Measured side by side
# (benchmarks/bench_cp.py --section scale, 3 tensors x {4, 2} bits): re-searching at every
# projection ends within -1.2%..+2.9% of this rule's error and costs about 2-4x the time; neither
# rule diverged under the guard below.
#
# NOTE [ Dual across outer iterations ]
# U_n is the scaled dual (y / rho) of mode n. It is kept from one outer iteration to the next (a
# warm start: the sub-problem changes little once the other factors settle), and rescaled by
# rho_old / rho_new because rho = trace(G)/R moves with the other factors.
#
# NOTE [ Guard and keep-best ]
# The iteration is a heuristic on a non-convex set: the error is not monotone. The result is the
# best iterate seen (the quantized initialisation, i.e. CP-then-quantize, included), so ADMM never
# returns something worse than its own starting point. If the error of an iterate is non-finite or
# exceeds DIVERGENCE_FACTOR x the best, the iterate is discarded, the duals are reset and the
# iteration restarts from the best factors; after MAX_RESTARTS such events the solve stops with
# status "diverged" (still returning the best iterate).
DIVERGENCE_FACTOR = 2.0
MAX_RESTARTS = 2
# Stop when the best error has not improved by a relative PATIENCE_GAIN for PATIENCE iterations
# (quantized iterates can cycle between nearby grid points forever).
PATIENCE = 10
PATIENCE_GAIN = 1e-4
# Relative ridge used only to choose the scale from F G^-1 (G can be singular for tiny modes).
_SCALE_RIDGE = 1e-10


@dataclass(frozen=True)
class CPResult:
    """A CP model with factors on a symmetric ``bits``-bit grid, one scale per factor.

    ``factor n = scales[n] * codes[n]`` and the tensor is ``sum_r prod_n factor_n[i_n, r]``.

    Attributes:
        codes: integer codes, one ``int8`` tensor of shape ``(I_n, R)`` per mode.
        scales: one positive float per mode.
        bits: bit width of the grid.
        shape: shape of the decomposed tensor ``(I_1, ..., I_N)``.
        error: relative reconstruction error ``||X - X_hat|| / ||X||`` of these quantized factors.
        history: the error after each outer iteration (empty for :func:`cp_then_quantize`).
        float_error: relative error of the float CP model used as the initialisation.
        baseline_error: error of that float model with its factors rounded to the grid
            (CP-then-quantize); ``error <= baseline_error`` always (keep-best).
        status: ``"converged"``, ``"stalled"``, ``"max_iter"``, ``"diverged"`` or ``"ptq"``.
    """

    codes: tuple[Tensor, ...]
    scales: tuple[float, ...]
    bits: int
    shape: tuple[int, ...]
    error: float
    history: tuple[float, ...]
    float_error: float
    baseline_error: float
    status: str

    @property
    def rank(self) -> int:
        """The CP rank ``R``."""
        return int(self.codes[0].shape[1])

    @property
    def iterations(self) -> int:
        """Outer iterations run."""
        return len(self.history)

    def factors(self, dtype: torch.dtype = torch.float64) -> tuple[Tensor, ...]:
        """Dequantized factors ``scales[n] * codes[n]`` in ``dtype``."""
        return tuple(c.to(dtype) * s for c, s in zip(self.codes, self.scales))

    def reconstruct(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The tensor ``X_hat`` of shape :attr:`shape`, computed in float64, cast to ``dtype``."""
        return reconstruct(self.factors(torch.float64)).to(dtype)


def _init_cp_als(x: Tensor, rank: int, seed: int) -> tuple[list[Tensor], float]:
    res = cp_als(x, rank, ridge=INIT_RIDGE, seed=seed)
    return list(res.factors), res.error


def _init_random(x: Tensor, rank: int, seed: int) -> tuple[list[Tensor], float]:
    gen = torch.Generator().manual_seed(seed)
    factors = [torch.randn(d, rank, dtype=x.dtype, generator=gen).to(x.device) for d in x.shape]
    # scale so that the model's norm matches the tensor's: each term ~ ||X|| / sqrt(R)
    est = float(torch.linalg.vector_norm(reconstruct(factors)))
    if est > 0:
        factors = [a * (float(torch.linalg.vector_norm(x)) / est) ** (1 / x.dim()) for a in factors]
    factors = balance_factors(factors)
    return factors, relative_error(x, factors)


#: Initialisations by name: ``name -> fn(tensor_f64, rank, seed) -> (factors, float_error)``.
INITS: dict[str, Callable[[Tensor, int, int], tuple[list[Tensor], float]]] = {
    "cp_als": _init_cp_als,
    "random": _init_random,
}


def _check_tensor(weight: Tensor) -> Tensor:
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight={type(weight).__name__}: expected a torch.Tensor")
    if weight.dim() < 2:
        raise ValueError(
            f"weight.shape={tuple(weight.shape)}: CP needs a tensor with at least 2 modes; "
            "reshape a conv kernel to (C_out, C_in, kh*kw) first"
        )
    if not weight.is_floating_point():
        raise TypeError(f"weight.dtype={weight.dtype}: expected a floating-point tensor")
    x = weight.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError("weight contains NaN or Inf; CP of a non-finite tensor is undefined")
    return x


def _initial_factors(
    x: Tensor, rank: int, init: str | Sequence[Tensor], seed: int
) -> tuple[list[Tensor], float]:
    if isinstance(init, str):
        fn = INITS.get(init)
        if fn is None:
            raise ValueError(
                f"init={init!r}: unknown initialisation; choose one of {sorted(INITS)} or pass a "
                "sequence of float factors (one (I_n, R) matrix per mode)"
            )
        return fn(x, rank, seed)
    factors = [torch.as_tensor(a).detach().to(dtype=torch.float64, device=x.device) for a in init]
    expected = [(d, rank) for d in x.shape]
    got = [tuple(a.shape) for a in factors]
    if got != expected:
        raise ValueError(
            f"init: factor shapes {got} do not match the tensor's modes and rank; "
            f"expected {expected}"
        )
    factors = balance_factors(factors)
    return factors, relative_error(x, factors)


def _quantize_all(factors: Sequence[Tensor], bits: int) -> tuple[list[Tensor], list[float]]:
    scales = [search_scale(a, bits) for a in factors]
    return [project(a, s, bits) for a, s in zip(factors, scales)], scales


def _result(
    x: Tensor,
    factors: Sequence[Tensor],
    scales: Sequence[float],
    bits: int,
    *,
    error: float,
    history: Sequence[float],
    float_error: float,
    baseline_error: float,
    status: str,
) -> CPResult:
    codes = tuple(to_codes(a, s, bits).to(torch.int8) for a, s in zip(factors, scales))
    for c, a, s in zip(codes, factors, scales):
        internal_assert(torch.equal(c.to(a.dtype) * s, a), "a factor left the quantization grid")
    return CPResult(
        codes=codes,
        scales=tuple(float(s) for s in scales),
        bits=bits,
        shape=tuple(x.shape),
        error=error,
        history=tuple(history),
        float_error=float_error,
        baseline_error=baseline_error,
        status=status,
    )


def _check_common(weight: Tensor, rank: int, bits: int) -> Tensor:
    x = _check_tensor(weight)
    check_rank(rank)
    check_bits(bits)
    return x


def cp_then_quantize(
    weight: Tensor,
    rank: int,
    bits: int,
    *,
    init: str | Sequence[Tensor] = "cp_als",
    seed: int = 0,
) -> CPResult:
    """Baseline: float CP, then each factor rounded to its grid (post-training quantization).

    Uses the same initialisation and the same clipping search as :func:`quantized_cp`, so the two
    differ only by the ADMM iterations.

    Args:
        weight: tensor with at least 2 modes (a conv kernel reshaped to ``(C_out, C_in, kh*kw)``).
        rank: CP rank ``R > 0``.
        bits: bit width in ``[2, 8]``.
        init: ``"cp_als"`` (norm-controlled float CP), ``"random"``, or float factors.
        seed: seed for the initialisation's random parts.

    Returns:
        A :class:`CPResult` with ``status="ptq"`` and an empty history.

    Raises:
        ValueError: bits outside ``[2, 8]``, ``rank <= 0``, or a bad ``weight``/``init``.
    """
    x = _check_common(weight, rank, bits)
    factors, float_error = _initial_factors(x, rank, init, seed)
    q, scales = _quantize_all(factors, bits)
    err = relative_error(x, q)
    return _result(x, q, scales, bits, error=err, history=(), float_error=float_error,
                   baseline_error=err, status="ptq")


def _solve_mode(
    x: Tensor,
    h: list[Tensor],
    duals: list[Tensor],
    rhos: list[float | None],
    scales: list[float],
    mode: int,
    bits: int,
    inner_iter: int,
) -> tuple[Tensor, Tensor]:
    """One AO-ADMM sub-problem for ``mode``; updates ``h``, ``duals``, ``rhos``, ``scales``.

    Returns ``(G, F)`` of the sub-problem (for :func:`error_from_last_update`).
    """
    rank = h[0].shape[1]
    eye = torch.eye(rank, dtype=x.dtype, device=x.device)
    g = gram_hadamard([a.T @ a for a in h], mode)
    f = mttkrp(x, h, mode)
    rho = float(torch.trace(g)) / rank
    if rho <= 0 or not math.isfinite(rho):
        return g, f  # every other factor is zero: nothing to fit for this mode
    u = duals[mode]
    if rhos[mode] is not None:
        u *= rhos[mode] / rho  # NOTE [ Dual across outer iterations ]
    rhos[mode] = rho
    # NOTE [ Fixed scale per sub-problem ]
    ls = torch.cholesky_solve(f.T, torch.linalg.cholesky(g + _SCALE_RIDGE * rho * eye)).T
    s = search_scale(ls, bits)
    chol = torch.linalg.cholesky(g + rho * eye)  # cached for the whole sub-problem
    hn = h[mode]
    for _ in range(inner_iter):
        h_ls = torch.cholesky_solve((f + rho * (hn + u)).T, chol).T
        hn = project(h_ls - u, s, bits)
        u += hn - h_ls
    h[mode] = hn
    scales[mode] = s
    return g, f


def quantized_cp(
    weight: Tensor,
    rank: int,
    bits: int,
    *,
    init: str | Sequence[Tensor] = "cp_als",
    max_iter: int = 50,
    inner_iter: int = 10,
    tol: float = 1e-6,
    seed: int = 0,
) -> CPResult:
    """CP decomposition with every factor on a ``bits``-bit grid, by AO-ADMM.

    Cherniuk et al., "Quantization Aware Factorization for Deep Neural Network Compression"
    (2023), Algorithm 1. Everything runs in float64 on ``weight.device``.

    Args:
        weight: tensor with at least 2 modes. For a ``Conv2d`` kernel pass
            ``w.reshape(C_out, C_in, kh * kw)`` (what :class:`~quant.cp.CPConv2d` uses); a
            ``Linear`` weight ``(out, in)`` is used as is.
        rank: CP rank ``R > 0``.
        bits: bit width of the symmetric grid, in ``[2, 8]``.
        init: ``"cp_als"`` (norm-controlled float CP, the default), ``"random"``, or a sequence of
            float factors, one ``(I_n, R)`` matrix per mode.
        max_iter: maximum outer iterations (sweeps over all modes).
        inner_iter: ADMM iterations per sub-problem.
        tol: stop when the error changes by less than ``tol`` (relative) between iterations.
        seed: seed for the initialisation's random parts (the result is deterministic).

    Returns:
        A :class:`CPResult`: ``int8`` codes and one scale per mode, ``.error`` the final relative
        error ``||W - W_hat|| / ||W||`` of the quantized factors, ``.history`` that error per
        outer iteration, and ``.baseline_error`` the CP-then-quantize error of the same init.

    Raises:
        ValueError: ``bits`` outside ``[2, 8]``, ``rank <= 0``, a non-finite ``weight``, an
            unknown ``init`` or invalid iteration options.
        TypeError: ``weight`` is not a floating-point tensor, or ``bits``/``rank`` not ints.

    Example:
        >>> w = torch.randn(32, 16, 9)
        >>> res = quantized_cp(w, 8, 4)
        >>> res.codes[0].dtype, res.error <= res.baseline_error
        (torch.int8, True)
    """
    x = _check_common(weight, rank, bits)
    check_positive_int(max_iter, name="max_iter", allow_zero=True)
    check_positive_int(inner_iter, name="inner_iter")
    check_positive_float(tol, name="tol")
    norm = float(torch.linalg.vector_norm(x))
    norm_sq = float((x * x).sum())
    factors, float_error = _initial_factors(x, rank, init, seed)
    h, scales = _quantize_all(factors, bits)
    baseline = relative_error(x, h, norm)
    best_err, best_h, best_scales = baseline, [a.clone() for a in h], list(scales)
    duals = [torch.zeros_like(a) for a in h]
    rhos: list[float | None] = [None] * x.dim()
    history: list[float] = []
    status, restarts, since_gain = "max_iter", 0, 0
    for _ in range(max_iter):
        for mode in range(x.dim()):
            g, f = _solve_mode(x, h, duals, rhos, scales, mode, bits, inner_iter)
        err = error_from_last_update(norm_sq, g, f, h[-1])
        history.append(err)
        if not math.isfinite(err) or err > DIVERGENCE_FACTOR * best_err:
            # NOTE [ Guard and keep-best ]
            restarts += 1
            if restarts > MAX_RESTARTS:
                status = "diverged"
                break
            h, scales = [a.clone() for a in best_h], list(best_scales)
            duals = [torch.zeros_like(a) for a in h]
            rhos = [None] * x.dim()
            continue
        if err < best_err * (1 - PATIENCE_GAIN):
            since_gain = 0
        else:
            since_gain += 1
        if err < best_err:
            best_err, best_h, best_scales = err, [a.clone() for a in h], list(scales)
        if len(history) > 1 and abs(history[-2] - err) <= tol * max(history[-2], 1e-300):
            status = "converged"
            break
        if since_gain >= PATIENCE:
            status = "stalled"
            break
    # the history comes from the Gram identity; report the kept iterate's error exactly
    return _result(x, best_h, best_scales, bits, error=relative_error(x, best_h, norm),
                   history=history, float_error=float_error, baseline_error=baseline,
                   status=status)
