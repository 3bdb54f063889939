"""Neural-ODE blocks with the interpolated adjoint.

Daulbaev, Katrutsa, Markeeva, Gusak, Cichocki and Oseledets, "Interpolation Technique to Speed
Up Gradients Propagation in Neural ODEs" (NeurIPS 2020): the forward solve stores the state at
Chebyshev–Lobatto nodes, the backward solve integrates only the adjoint and the parameter
gradients with the state rebuilt by barycentric interpolation. Solvers are torchdiffeq's
(``pip install "hiremate[ode]"``).

* :func:`odeint` — ``grad="backprop" | "adjoint" | "interpolated"``.
* :class:`ODEBlock` — the same as an ``nn.Module``, with per-call :class:`ODEStats`.
* :class:`SolveConfig` — validated settings shared by both.
* :class:`ODESolveError`, :class:`InterpolationError`, :class:`InterpolationWarning`.

Example::

    from ode import ODEBlock
    block = ODEBlock(func, (0.0, 1.0), rtol=1e-4, atol=1e-6, n_nodes=17)
    block(x).sum().backward()
    print(block.last_stats.forward_nfe, block.last_stats.backward_nfe)
"""
from .block import ODEBlock
from .config import SolveConfig
from .errors import InterpolationError, ODESolveError
from .interpolated import InterpolationWarning
from .odeint import GRAD_METHODS, odeint
from .stats import ODEStats

__all__ = [
    "GRAD_METHODS",
    "InterpolationError",
    "InterpolationWarning",
    "ODEBlock",
    "ODESolveError",
    "ODEStats",
    "SolveConfig",
    "odeint",
]
