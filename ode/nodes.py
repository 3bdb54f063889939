"""Chebyshev–Lobatto nodes and their barycentric weights, in float64.

The interpolated adjoint (Daulbaev et al., "Interpolation Technique to Speed Up Gradients
Propagation in Neural ODEs", NeurIPS 2020) stores the forward state at Chebyshev–Lobatto nodes of
each time segment and rebuilds it in the backward pass by barycentric Lagrange interpolation.

NOTE [ Lobatto nodes need second-kind weights ]
    The nodes are the Chebyshev points of the second kind (Chebyshev–Lobatto / extrema points)
    ``x_j = cos(pi j / (n-1))``, ``j = 0..n-1``, which include both ends of the segment. The
    barycentric weights of the polynomial interpolant through *these* nodes are
    ``w_j = (-1)^j delta_j`` with ``delta_j = 1/2`` at both ends and 1 elsewhere (Berrut &
    Trefethen, SIAM Review 2004, eq. 5.4). Using the first-kind weights ``(-1)^j sin(...)`` with
    Lobatto nodes, as the paper's reference code does, gives a rational function that is not the
    interpolating polynomial and is 8–50x less accurate on fast transients. The weights are
    invariant (up to a common factor, which cancels) under the affine map onto any segment,
    including a reversed one, so one weight vector serves every segment.

NOTE [ Nested nodes ]
    With ``n = 2m - 1`` nodes, the even-indexed ones are exactly the ``m``-node Lobatto set
    (``cos(pi 2k / (2m-2)) = cos(pi k / (m-1))``). Comparing the ``m``-node interpolant with the
    stored values at the odd-indexed nodes estimates the interpolation error at no extra function
    evaluations (see :func:`ode.interp.nested_error_ratio`).

Everything here is float64 whatever the state dtype: node positions in float32 carry relative
errors of ~6e-8, and the barycentric weights alternate in sign, so cancellation would eat the
accuracy the nodes are chosen for.
"""
from __future__ import annotations

import math

import torch

__all__ = ["lobatto_nodes", "lobatto_weights", "segment_nodes", "MIN_NODES", "MAX_NODES"]

# Three nodes is the smallest odd count whose nested sub-grid (the two ends) still interpolates.
MIN_NODES = 3
# Far more than any trajectory segment needs; beyond this the barycentric sums of a long segment
# lose accuracy to cancellation and the memory saving is gone anyway. Refine splits segments
# instead of raising the degree.
MAX_NODES = 129


def lobatto_nodes(n: int) -> torch.Tensor:
    """Chebyshev–Lobatto nodes on ``[0, 1]``, increasing, with both ends exact.

    Args:
        n: Number of nodes, ``>= 2``.

    Returns:
        float64 tensor of shape ``(n,)``: ``s_j = (1 - cos(pi j / (n-1))) / 2``, ``s_0 = 0``,
        ``s_{n-1} = 1``.
    """
    j = torch.arange(n, dtype=torch.float64)
    # sin form, (1 - cos x)/2 = sin^2(x/2), avoids cancellation near s = 0
    s = torch.sin(j * (math.pi / (2 * (n - 1)))) ** 2
    s[0] = 0.0
    s[-1] = 1.0
    return s


def lobatto_weights(n: int) -> torch.Tensor:
    """Barycentric weights of polynomial interpolation at ``n`` Chebyshev–Lobatto nodes.

    Returns:
        float64 tensor of shape ``(n,)``: ``(-1)^j`` with the two end weights halved.
        See NOTE [ Lobatto nodes need second-kind weights ].
    """
    w = torch.ones(n, dtype=torch.float64)
    w[1::2] = -1.0
    w[0] *= 0.5
    w[-1] *= 0.5
    return w


def segment_nodes(start: float, end: float, n: int) -> torch.Tensor:
    """The ``n`` Lobatto nodes of the segment from ``start`` to ``end``, in flow order.

    ``end < start`` is allowed (a solve backwards in time). Both ends are reproduced exactly.

    Returns:
        float64 tensor of shape ``(n,)`` going from ``start`` to ``end``.
    """
    tau = start + (end - start) * lobatto_nodes(n)
    tau[0] = start
    tau[-1] = end
    return tau
