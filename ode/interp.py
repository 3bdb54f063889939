"""Barycentric Lagrange interpolation of a stored trajectory segment, and the nested-grid estimate
of its error (Daulbaev et al., NeurIPS 2020, Sec. 3; Berrut & Trefethen, SIAM Review 2004).

NOTE [ Never extrapolate ]
    A :class:`LobattoInterpolant` refuses to be evaluated outside its segment. Polynomial
    interpolants of degree 16 grow like ``|t - t_j|^16`` just outside the nodes, so a solver stage
    that reads the interpolant a step past the segment end gets a wildly wrong state (this crashed
    training with "underflow in dt" in the reference code, and clamping the time alone gave a 32%
    wrong adjoint). The backward solve is set up to land exactly on every segment end
    (:mod:`ode.interpolated`); what is left is rounding of the time to the state dtype inside
    torchdiffeq, a few ulps, which we clamp. Anything further out is a bug in this package.
"""
from __future__ import annotations

import torch

from .errors import internal_assert
from .nodes import lobatto_weights

__all__ = ["barycentric_matrix", "LobattoInterpolant", "nested_error"]

# torchdiffeq hands the dynamics a time cast to the state's dtype (its _PerturbFunc), and nudges
# stage times at a step end by one ulp. A time this many ulps (of the state dtype, relative to
# the segment's magnitude) outside the segment is rounding; more is a bug.
_ROUNDING_ULPS = 16
# Distance (in float64 ulps of the segment's magnitude) under which a time counts as a node.
_NODE_HIT_ULPS = 4


def barycentric_matrix(nodes: torch.Tensor, weights: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Coefficients ``C`` with ``p(t_i) = sum_j C[i, j] * y_j`` for the barycentric interpolant.

    Args:
        nodes: ``(n,)`` float64 node times (distinct).
        weights: ``(n,)`` float64 barycentric weights matching ``nodes``.
        t: ``(k,)`` evaluation times (cast to float64).

    Returns:
        ``(k, n)`` float64 tensor; a row is the unit vector ``e_j`` where ``t_i`` equals a node.
    """
    diff = t.to(torch.float64).reshape(-1, 1) - nodes.reshape(1, -1)
    # A time within a few ulps of a node *is* that node: ``w / diff`` would overflow to inf for
    # |diff| < ~1e-308 (torchdiffeq nudges a stage at t = 0 to the smallest denormal), and the
    # value there differs from the node's by far less than float64 resolution.
    scale = nodes.abs().max() + (nodes[-1] - nodes[0]).abs()
    hit = diff.abs() <= _NODE_HIT_ULPS * torch.finfo(torch.float64).eps * scale
    with torch.no_grad():
        ratio = weights / torch.where(hit, torch.ones_like(diff), diff)
        coeff = ratio / ratio.sum(dim=1, keepdim=True)
    on_node = hit.any(dim=1, keepdim=True)
    first_hit = hit & (hit.cumsum(dim=1) == 1)  # one node even if two are within reach
    return torch.where(on_node, first_hit.to(torch.float64), coeff)


class LobattoInterpolant:
    """The polynomial through a trajectory's values at the Lobatto nodes of one segment.

    Args:
        nodes: ``(n,)`` float64 node times from :func:`ode.nodes.segment_nodes`, first and last
            being the segment's ends (either order).
        values: ``(n, *state_shape)`` state at the nodes, any floating dtype.

    Calling it with a scalar time tensor returns the state there, in ``values``' dtype. It raises
    (as an internal error) for a time outside the segment: see NOTE [ Never extrapolate ].
    """

    def __init__(self, nodes: torch.Tensor, values: torch.Tensor):
        internal_assert(nodes.dtype == torch.float64, f"nodes must be float64, got {nodes.dtype}")
        internal_assert(values.shape[0] == nodes.shape[0],
                        f"{values.shape[0]} values for {nodes.shape[0]} nodes")
        self.start = float(nodes[0])
        self.end = float(nodes[-1])
        self.lo, self.hi = min(self.start, self.end), max(self.start, self.end)
        self.nodes = nodes.to(values.device)
        self.weights = lobatto_weights(nodes.shape[0]).to(values.device)
        self.values = values
        eps = torch.finfo(values.dtype).eps
        self._slack = _ROUNDING_ULPS * eps * max(abs(self.start), abs(self.end), self.hi - self.lo)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        tf = float(t)
        internal_assert(
            self.lo - self._slack <= tf <= self.hi + self._slack,
            f"interpolant of segment [{self.start!r}, {self.end!r}] evaluated at t={tf!r}, outside "
            "it (the backward solve should land on every segment end)",
        )
        t64 = torch.as_tensor(min(max(tf, self.lo), self.hi), dtype=torch.float64,
                              device=self.nodes.device)
        coeff = barycentric_matrix(self.nodes, self.weights, t64.reshape(1))[0]
        return torch.tensordot(coeff.to(self.values.dtype), self.values, dims=1)


def nested_error(nodes: torch.Tensor, values: torch.Tensor, *, atol: float) -> float:
    """Estimate the interpolation error of a segment from its nested node grid.

    With ``n = 2m - 1`` stored nodes (see NOTE [ Nested nodes ] in :mod:`ode.nodes`), the
    ``m``-node interpolant through the even-indexed nodes is evaluated at the ``m - 1``
    odd-indexed ones and compared with the stored values there.

    Args:
        nodes: ``(2m-1,)`` float64 node times.
        values: ``(2m-1, *state_shape)`` stored state.
        atol: Absolute tolerance of the solve, the floor of the state's scale.

    Returns:
        ``max_j |p_m(t_j) - y_j| / (max |y| + atol)``: the ``m``-node sub-grid interpolant's
        largest error at the odd nodes, relative to the largest state entry on the segment
        (max over state elements). It estimates the *sub-grid* interpolant's error; the
        ``2m-1``-node interpolant used in the backward pass is far more accurate (see
        NOTE [ Default interp_tol ] in :mod:`ode.config`). The nodes come from the solver, so
        the estimate cannot see the solver's own error.
    """
    n = nodes.shape[0]
    internal_assert(n % 2 == 1 and n >= 3, f"nested estimate needs an odd node count >= 3, got {n}")
    m = (n + 1) // 2
    nodes = nodes.to(values.device)
    coeff = barycentric_matrix(nodes[0::2], lobatto_weights(m).to(values.device), nodes[1::2])
    pred = torch.tensordot(coeff.to(values.dtype), values[0::2], dims=1)
    error = (pred - values[1::2]).abs().max()
    return float(error / (values.abs().max() + atol))
