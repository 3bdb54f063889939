"""Norm-controlled float CP by alternating least squares (the initialisation of the ADMM solver).

Plain CP-ALS on a weight tensor at a rank near or above its "natural" rank often drifts towards a
degenerate solution: a few rank-one terms with huge norms that nearly cancel. The float error is
fine, but the factors' dynamic range is enormous, so rounding them onto a few-bit grid destroys
the reconstruction. This is the main reason decompose-then-quantize fails (Cherniuk et al.,
"Quantization Aware Factorization for Deep Neural Network Compression", 2023, Sec. 3).

See NOTE [ Norm control ] for the two measures used here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_positive_float, check_positive_int, check_rank
from ._tensor import error_from_last_update, gram_hadamard, mttkrp, relative_error

__all__ = ["CPALSResult", "cp_als", "balance_factors", "DEFAULT_RIDGE", "INIT_RIDGE"]

# NOTE [ Norm control ]
# 1. Ridge: every least-squares update solves (G + lam I) A^T = F^T with lam = ridge * trace(G)/R,
#    i.e. it adds lam * ||A||^2 to the objective. A small relative ridge barely moves the error of a
#    healthy solution but makes "two huge cancelling terms" strictly worse than "two small terms",
#    so the iterates cannot drift to a degenerate solution.
# 2. Balancing: CP has a scaling freedom (a_r -> c a_r, b_r -> b_r / c). After each sweep the
#    columns of every rank-one term are rescaled to equal norms (the geometric mean), which leaves
#    the reconstruction unchanged and gives every factor the same dynamic range -- what a
#    one-scale-per-factor quantization grid wants.
#
# Measured (benchmarks/bench_cp.py --section ridge, 300 sweeps) on the recipes' digits CNN, conv
# 64x32x3x3 at rank 87 -- float error / error after rounding the factors to 4 bits / ADMM at 4
# bits started from these factors / spread (sum of the rank-one terms' norms over ||X||; large =
# cancelling terms):
#   ridge 0:    0.3467 / 0.654 / 0.422 / 29.2
#   ridge 1e-3: 0.3425 / 0.486 / 0.393 / 18.0
#   ridge 1e-2: 0.3445 / 0.410 / 0.376 / 11.8
# On an exactly rank-10 40x30x9 tensor with 1% noise ridge 1e-2 biases the float fit (0.0141 vs
# 0.0096 at ridge <= 1e-3) while ADMM's 4-bit error barely moves (0.167 vs 0.165). cp_als defaults
# to the mild DEFAULT_RIDGE; the ADMM solver starts from INIT_RIDGE.
DEFAULT_RIDGE = 1e-3
INIT_RIDGE = 1e-2


@dataclass(frozen=True)
class CPALSResult:
    """A float CP model found by :func:`cp_als`.

    Attributes:
        factors: ``A_1..A_N`` in float64, ``A_n`` of shape ``(I_n, R)``, columns balanced.
        error: relative reconstruction error ``||X - [[A]]|| / ||X||``.
        history: that error after each sweep (from the Gram identity, see
            ``_tensor.error_from_last_update``).
        iterations: sweeps run.
    """

    factors: tuple[Tensor, ...]
    error: float
    history: tuple[float, ...]
    iterations: int


def balance_factors(factors: Sequence[Tensor]) -> list[Tensor]:
    """Rescale each rank-one term so its N columns have equal norm (reconstruction unchanged).

    Args:
        factors: ``A_1..A_N``, ``A_n`` of shape ``(I_n, R)``.

    Returns:
        New factors with ``||A_n[:, r]|| = (prod_m ||A_m[:, r]||)^(1/N)`` for every ``n``.
    """
    norms = torch.stack([torch.linalg.vector_norm(a, dim=0) for a in factors])  # (N, R)
    tiny = torch.finfo(norms.dtype).tiny
    dead = (norms == 0).any(dim=0)  # a zero column makes the whole term zero: zero it everywhere
    target = torch.exp(torch.log(norms.clamp_min(tiny)).mean(dim=0))
    return [
        a * torch.where(dead, torch.zeros_like(target), target / nrm.clamp_min(tiny))
        for a, nrm in zip(factors, norms)
    ]


def _svd_init(tensor: Tensor, rank: int, generator: torch.Generator) -> list[Tensor]:
    """Leading left singular vectors of each unfolding, padded with random columns if R > I_n."""
    factors = []
    for mode in range(tensor.dim()):
        unfold = tensor.movedim(mode, 0).reshape(tensor.shape[mode], -1)
        u, s, _ = torch.linalg.svd(unfold, full_matrices=False)
        take = min(rank, u.shape[1])
        cols = u[:, :take] * s[:take].sqrt()
        if take < rank:
            extra = torch.randn(tensor.shape[mode], rank - take, dtype=tensor.dtype,
                                generator=generator).to(tensor.device)
            # random columns at the size of the weakest singular direction kept
            extra *= s[take - 1].sqrt() / tensor.shape[mode] ** 0.5
            cols = torch.cat([cols, extra], dim=1)
        factors.append(cols)
    return factors


def cp_als(
    tensor: Tensor,
    rank: int,
    *,
    max_iter: int = 300,
    tol: float = 1e-7,
    ridge: float = DEFAULT_RIDGE,
    seed: int = 0,
) -> CPALSResult:
    """Float CP decomposition by ridge-regularised alternating least squares.

    Computes ``A_1..A_N`` minimising ``||X - [[A_1..A_N]]||^2 + lam * sum_n ||A_n||^2`` by exact
    block updates, balancing the rank-one terms after every sweep (NOTE [ Norm control ]). All
    arithmetic is float64 whatever the input dtype.

    Args:
        tensor: order-N tensor (N >= 2), any float dtype and device.
        rank: CP rank ``R`` (> 0).
        max_iter: maximum number of sweeps over the modes.
        tol: stop when the relative error changes by less than ``tol`` between sweeps.
        ridge: relative ridge; ``lam = ridge * trace(G)/R`` per update. ``0`` is plain ALS.
        seed: seed of the random columns used when ``R`` exceeds a mode size.

    Returns:
        A :class:`CPALSResult` with float64 factors on ``tensor.device``.

    Raises:
        ValueError: if ``tensor`` has fewer than two modes, ``rank <= 0`` or an option is invalid.

    Example:
        >>> w = torch.randn(16, 8, 9)
        >>> cp_als(w, 4).factors[0].shape
        torch.Size([16, 4])
    """
    if tensor.dim() < 2:
        raise ValueError(
            f"tensor.shape={tuple(tensor.shape)}: CP needs a tensor with at least 2 modes; "
            "reshape a conv kernel to (C_out, C_in, kh*kw) first"
        )
    check_rank(rank)
    check_positive_int(max_iter, name="max_iter")
    check_positive_float(tol, name="tol")
    if not isinstance(ridge, (int, float)) or ridge < 0:
        raise ValueError(f"ridge={ridge!r}: expected a float >= 0; pass e.g. ridge={DEFAULT_RIDGE}")
    x = tensor.detach().to(torch.float64)
    norm = float(torch.linalg.vector_norm(x))
    norm_sq = float((x * x).sum())
    generator = torch.Generator().manual_seed(seed)
    factors = _svd_init(x, rank, generator)
    eye = torch.eye(rank, dtype=x.dtype, device=x.device)
    history: list[float] = []
    for _ in range(max_iter):
        grams = [a.T @ a for a in factors]
        for mode in range(x.dim()):
            g = gram_hadamard(grams, mode)
            f = mttkrp(x, factors, mode)
            lam = ridge * float(torch.trace(g)) / rank
            # (G + lam I) is symmetric positive definite for lam > 0; lstsq covers lam == 0
            if lam > 0:
                chol = torch.linalg.cholesky(g + lam * eye)
                factors[mode] = torch.cholesky_solve(f.T, chol).T
            else:
                factors[mode] = torch.linalg.lstsq(g, f.T).solution.T
            grams[mode] = factors[mode].T @ factors[mode]
        # balancing below leaves the model unchanged, so the last update gives its error
        history.append(error_from_last_update(norm_sq, g, f, factors[-1]))
        factors = balance_factors(factors)
        if len(history) > 1 and abs(history[-2] - history[-1]) < tol:
            break
    return CPALSResult(factors=tuple(factors), error=relative_error(x, factors, norm),
                       history=tuple(history), iterations=len(history))
