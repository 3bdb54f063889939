"""Small tensor-algebra kernels shared by the CP solvers (float64, any order >= 2).

Notation follows Kolda & Bader, "Tensor Decompositions and Applications" (SIAM Review 2009): a
CP model of an order-N tensor X with factors A_1..A_N (A_n of shape I_n x R) is
X_hat[i_1..i_N] = sum_r prod_n A_n[i_n, r].
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import internal_assert

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reconstruct(factors: Sequence[Tensor]) -> Tensor:
    """Full tensor of the CP model ``[[A_1, ..., A_N]]``; shape ``(I_1, ..., I_N)``.

    ``A_1 @ khatri_rao(A_2..A_N)^T``: one matmul after a Khatri-Rao product of the trailing
    modes (a 3-operand einsum was 7x slower on a 256x256x9 tensor at rank 566).
    """
    rank = factors[0].shape[1]
    kr = factors[-1]
    for a in reversed(factors[1:-1]):
        kr = (a[:, None, :] * kr[None, :, :]).reshape(-1, rank)
    shape = tuple(a.shape[0] for a in factors)
    return (factors[0] @ kr.T).reshape(shape)


def gram_hadamard(grams: Sequence[Tensor], skip: int) -> Tensor:
    """Hadamard product of all Gram matrices ``A_m^T A_m`` except mode ``skip``; ``R x R``."""
    out = None
    for m, g in enumerate(grams):
        if m != skip:
            out = g.clone() if out is None else out * g
    internal_assert(out is not None, "a CP model needs at least two modes")
    return out


def mttkrp(tensor: Tensor, factors: Sequence[Tensor], mode: int) -> Tensor:
    """Matricised tensor times Khatri-Rao product for ``mode``: ``X_(n) (odot_{m != n} A_m)``.

    Contracts one mode at a time (largest first) so no Khatri-Rao matrix is ever formed; the
    result has shape ``(I_mode, R)``.
    """
    n = tensor.dim()
    letters = _LETTERS[:n]
    # first contraction turns the tensor into (..., R); later ones are Hadamard in R
    others = sorted((m for m in range(n) if m != mode), key=lambda m: -tensor.shape[m])
    first = others[0]
    keep = [m for m in range(n) if m != first]
    cur = torch.einsum(f"{letters},{letters[first]}z->{''.join(letters[m] for m in keep)}z",
                       tensor, factors[first])
    for m in others[1:]:
        keep_now = [k for k in keep if k != m]
        src = "".join(letters[k] for k in keep) + "z"
        dst = "".join(letters[k] for k in keep_now) + "z"
        cur = torch.einsum(f"{src},{letters[m]}z->{dst}", cur, factors[m])
        keep = keep_now
    return cur


def relative_error(tensor: Tensor, factors: Sequence[Tensor], norm: float | None = None) -> float:
    """``||X - [[A_1..A_N]]||_F / ||X||_F``, from the full reconstruction (no cancellation)."""
    denom = float(torch.linalg.vector_norm(tensor)) if norm is None else norm
    diff = torch.linalg.vector_norm(tensor - reconstruct(factors))
    return float(diff) / denom if denom > 0 else float(diff)


def error_from_last_update(norm_sq: float, gram_others: Tensor, mttkrp_last: Tensor,
                           factor_last: Tensor) -> float:
    """Relative error of a CP model from the quantities of its last mode update, in O(I R + R^2).

    With ``G`` the Hadamard product of the other modes' Grams, ``F`` their MTTKRP and ``A`` the
    updated factor of that mode: ``||X - X_hat||^2 = ||X||^2 - 2 <F, A> + <G, A^T A>``. Exact up to
    cancellation, which float64 keeps below 1e-7 in relative error for any error above ~1e-8
    (the solvers report the final error from a full reconstruction).
    """
    if norm_sq <= 0:
        return 0.0
    sq = norm_sq - 2.0 * float((mttkrp_last * factor_last).sum()) + \
        float((gram_others * (factor_last.T @ factor_last)).sum())
    return max(sq, 0.0) ** 0.5 / norm_sq ** 0.5
