"""The symmetric per-factor quantization grid and the search for its scale.

A factor ``A`` (one matrix of a CP model) is stored as integer codes ``C`` and one float scale
``s``: ``A = s * C`` with ``C`` in ``[-2^(b-1), 2^(b-1) - 1]`` (two's complement range of ``b``
bits, zero point 0). Projecting onto this grid for a fixed scale is rounding and clamping, which
is the exact Euclidean projection the ADMM splitting needs (Cherniuk et al., 2023, Eq. 9).

The scale is chosen by a clipping search (NOTE [ Clipping search ]).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_bits, internal_assert

__all__ = ["qbounds", "project", "to_codes", "search_scale"]

# NOTE [ Clipping search ]
# Scaling the grid to the factor's absolute maximum wastes levels on a few outliers; scaling it
# smaller clips them. Like the reference implementation we try clipping values c = t * absmax for
# t on a uniform grid in [CLIP_LOW, CLIP_HIGH] and keep the one with the least squared error
# ||A - Q_c(A)||^2, with s = c / 2^(b-1) (so the negative end of the grid sits at -c). Ratios above
# 1.0 let the positive end, c (1 - 2^(1-b)), reach the largest positive values: the two's
# complement range is one step shorter on the positive side. CLIP_STEPS = 64 resolves the clip to
# ~1.6% of absmax; 256 steps changed ADMM's error on the digits test conv (32x16x3x3, rank 40) by
# +0.1% at 8 bits, +0.3% at 4 bits and -2.0% at 2 bits (relative), for 4x the search time.
CLIP_LOW = 0.2
CLIP_HIGH = 1.2
CLIP_STEPS = 64
# candidates x elements evaluated per chunk: each scratch tensor of the search holds at most this
# many elements (128 MiB in float64)
_CHUNK_ELEMENTS = 1 << 24


def qbounds(bits: int) -> tuple[int, int]:
    """Smallest and largest integer code of a ``bits``-bit symmetric grid.

    Example:
        >>> qbounds(4)
        (-8, 7)
    """
    check_bits(bits)
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def to_codes(x: Tensor, scale: float | Tensor, bits: int) -> Tensor:
    """Integer codes (in ``x.dtype``) of the nearest grid points: ``clamp(round(x / s))``."""
    qmin, qmax = qbounds(bits)
    return torch.clamp(torch.round(x / scale), qmin, qmax)


def project(x: Tensor, scale: float | Tensor, bits: int) -> Tensor:
    """Nearest point of the grid ``s * {qmin..qmax}`` to every element of ``x`` (same dtype)."""
    return to_codes(x, scale, bits) * scale


def search_scale(x: Tensor, bits: int) -> float:
    """Grid scale that minimises ``||x - Q_s(x)||^2`` over the clipping candidates.

    Args:
        x: the values to quantize (any shape, float).
        bits: bit width in ``[2, 8]``.

    Returns:
        The scale ``s > 0`` (a Python float). An all-zero ``x`` gets ``s = 1``.

    Example:
        >>> search_scale(torch.linspace(-1, 1, 101), 8) > 0
        True
    """
    qmin, _ = qbounds(bits)
    absmax = float(x.abs().max()) if x.numel() else 0.0
    internal_assert(math.isfinite(absmax), f"non-finite values reach the grid search ({absmax})")
    if absmax == 0.0:
        return 1.0
    ratios = torch.linspace(CLIP_LOW, CLIP_HIGH, CLIP_STEPS, dtype=x.dtype, device=x.device)
    scales = ratios * absmax / -qmin
    flat = x.reshape(1, -1)
    per_chunk = max(1, _CHUNK_ELEMENTS // max(flat.shape[1], 1))
    errors = []
    for start in range(0, CLIP_STEPS, per_chunk):
        s = scales[start:start + per_chunk, None]
        errors.append(((flat - project(flat, s, bits)) ** 2).sum(dim=1))
    return float(scales[int(torch.argmin(torch.cat(errors)))])
