"""Norm-controlled float CP-ALS (quant.cp.cp_als) and its tensor kernels."""
from __future__ import annotations

import pytest
import torch

from quant.cp import cp_als
from quant.cp._tensor import gram_hadamard, mttkrp, reconstruct
from quant.cp.cp_als import balance_factors
from tests.quant.cp_fixtures import digits_cnn, low_rank_tensor

# float64 identities (einsum vs explicit Khatri-Rao product): rounding only
EXACT_TOL = 1e-10


def _khatri_rao(mats):
    out = mats[0]
    for m in mats[1:]:
        out = (out[:, None, :] * m[None, :, :]).reshape(-1, out.shape[1])
    return out


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_mttkrp_matches_khatri_rao(mode):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64)
    factors = [torch.randn(d, 6, generator=gen, dtype=torch.float64) for d in x.shape]
    others = [factors[m] for m in range(3) if m != mode]
    unfold = x.movedim(mode, 0).reshape(x.shape[mode], -1)
    expected = unfold @ _khatri_rao(others)
    torch.testing.assert_close(mttkrp(x, factors, mode), expected, atol=EXACT_TOL, rtol=0)
    grams = [a.T @ a for a in factors]
    torch.testing.assert_close(gram_hadamard(grams, mode),
                               _khatri_rao(others).T @ _khatri_rao(others), atol=EXACT_TOL, rtol=0)


def test_recovers_exact_low_rank_tensor():
    x = low_rank_tensor(shape=(20, 15, 9), rank=5, noise=0.0).double()
    res = cp_als(x, 5, ridge=0.0, max_iter=500, tol=1e-12)
    assert res.error < 1e-6


def test_balanced_columns_and_same_reconstruction():
    gen = torch.Generator().manual_seed(0)
    factors = [torch.randn(d, 4, generator=gen, dtype=torch.float64) * s
               for d, s in zip((6, 5, 3), (100.0, 1.0, 0.01))]
    balanced = balance_factors(factors)
    torch.testing.assert_close(reconstruct(balanced), reconstruct(factors), atol=EXACT_TOL, rtol=0)
    norms = torch.stack([a.norm(dim=0) for a in balanced])
    torch.testing.assert_close(norms, norms[:1].expand_as(norms), atol=EXACT_TOL, rtol=1e-12)


def test_ridge_controls_degeneracy_on_trained_conv():
    # sum over rank-one terms of their norms, relative to ||X||: ~1 for a healthy model, large
    # when terms cancel. Measured on this conv at rank 40, 150 sweeps: 13.8 with plain ALS vs 6.9
    # with ridge 1e-2, for a float error of 0.2298 vs 0.2350.
    w = digits_cnn()[0][2].weight.detach().reshape(32, 16, 9).double()

    def spread(res):
        return float(torch.stack([a.norm(dim=0) for a in res.factors]).prod(0).sum() / w.norm())

    plain, ridged = cp_als(w, 40, ridge=0.0, max_iter=150), cp_als(w, 40, ridge=1e-2, max_iter=150)
    assert spread(ridged) < 0.7 * spread(plain)
    assert ridged.error < plain.error + 0.01


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank=0"), ({"ridge": -1.0}, "ridge=-1.0"), ({"max_iter": 0}, "max_iter=0"),
], ids=["rank", "ridge", "max-iter"])
def test_bad_arguments(kwargs, match):
    args = {"rank": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        cp_als(torch.randn(4, 3, 2), args.pop("rank"), **args)
