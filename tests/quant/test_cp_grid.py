"""The symmetric per-factor grid and its clipping search (quant.cp.grid)."""
from __future__ import annotations

import pytest
import torch

from quant.cp import qbounds, search_scale
from quant.cp.grid import CLIP_HIGH, CLIP_LOW, CLIP_STEPS, project, to_codes


@pytest.mark.parametrize("bits, expected", [(2, (-2, 1)), (4, (-8, 7)), (8, (-128, 127))],
                         ids=["2bit", "4bit", "8bit"])
def test_qbounds(bits, expected):
    assert qbounds(bits) == expected


@pytest.mark.parametrize("bits", [0, 1, 9, 16], ids=lambda b: f"bits{b}")
def test_qbounds_rejects_bits(bits):
    with pytest.raises(ValueError, match=f"bits={bits}: the quantization grid supports 2 to 8"):
        qbounds(bits)


def test_project_is_nearest_grid_point():
    x = torch.linspace(-3, 3, 601, dtype=torch.float64)
    scale, bits = 0.37, 3
    grid = torch.arange(qbounds(bits)[0], qbounds(bits)[1] + 1, dtype=torch.float64) * scale
    nearest = grid[(x[:, None] - grid[None]).abs().argmin(dim=1)]
    # ties (x exactly half-way) may go either way; away from ties the points must agree
    tie = ((x / scale) - (x / scale).floor() - 0.5).abs() < 1e-9
    assert torch.equal(project(x, scale, bits)[~tie], nearest[~tie])
    codes = to_codes(x, scale, bits)
    assert torch.equal(codes, codes.round()) and codes.min() == -4 and codes.max() == 3


@pytest.mark.parametrize("bits", [2, 4, 8], ids=["2bit", "4bit", "8bit"])
def test_search_scale_is_best_candidate(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, generator=gen, dtype=torch.float64) ** 3  # heavy tails: clipping pays
    s = search_scale(x, bits)
    ratios = torch.linspace(CLIP_LOW, CLIP_HIGH, CLIP_STEPS, dtype=torch.float64)
    candidates = ratios * x.abs().max() / -qbounds(bits)[0]
    errors = torch.stack([((x - project(x, c, bits)) ** 2).sum() for c in candidates])
    assert s == pytest.approx(float(candidates[errors.argmin()]), rel=1e-12)
    # clipping beats scaling to the absolute maximum on heavy tails
    full = float(x.abs().max()) / -qbounds(bits)[0]
    def sse(scale):
        return float(((x - project(x, scale, bits)) ** 2).sum())

    assert sse(s) < sse(full)


def test_search_scale_zero_input():
    assert search_scale(torch.zeros(4, 3), 4) == 1.0
