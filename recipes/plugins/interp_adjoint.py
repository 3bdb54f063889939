"""Plugin section ``interp_adjoint:``: train the model's ``ode.ODEBlock`` modules with the
interpolated adjoint (``InterpolatedAdjointCallback``).

Example (YAML)::

    interp_adjoint:
      enabled: true
      n_nodes: 17              # null keeps each block's own
      check_every_n_steps: 50  # gradient check against a tight backprop reference (0: off)

remat cannot capture an ``ODEBlock`` (its adaptive solver takes a data-dependent number of
steps): with ``remat.enabled: true`` a remat target holding the block trains unmodified with a
warning (an error with ``remat.strict: true``); name the modules around it in ``remat.module``.

Paper: Daulbaev, Katrutsa, Markeeva, Gusak, Cichocki, Oseledets, "Interpolation Technique to
Speed Up Gradients Propagation in Neural ODEs", NeurIPS 2020.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from recipes.errors import InvalidValue
from recipes.registry import Plugin, import_callback


@dataclass
class InterpAdjointConfig:
    """The ``interp_adjoint:`` section; the fields after ``enabled`` are
    ``InterpolatedAdjointCallback``'s arguments (``null`` keeps each block's own setting).

    Attributes:
        enabled: Add the callback to the run.
        n_nodes: Chebyshev–Lobatto nodes stored per output interval (odd, 3..129).
        rtol: Solver relative tolerance (> 0).
        atol: Solver absolute tolerance (> 0).
        on_interp_error: ``warn``, ``raise``, ``refine`` or ``fallback``.
        interp_tol: Threshold of the interpolation error estimate (> 0).
        check_every_n_steps: Gradient check against a backprop reference every this many steps
            (0: off); logged as ``ode/grad_rel_error``.
        check_rtol: Relative tolerance of the reference solve.
        check_warn_above: Warn when the checked relative gradient error exceeds this.
        log_stats: Log ``ode/forward_nfe``, ``ode/backward_nfe`` and ``ode/interp_error`` per step.
    """

    enabled: bool = False
    n_nodes: Optional[int] = None
    rtol: Optional[float] = None
    atol: Optional[float] = None
    on_interp_error: Optional[str] = None
    interp_tol: Optional[float] = None
    check_every_n_steps: int = 0
    check_rtol: float = 1e-7
    check_warn_above: float = 1e-2
    log_stats: bool = True

    def __post_init__(self) -> None:
        # cheap checks only (this runs for every recipe); the callback validates the rest
        from ode.interpolated import INTERP_ERROR_POLICIES
        from ode.nodes import MAX_NODES, MIN_NODES

        if self.n_nodes is not None and not (
                MIN_NODES <= self.n_nodes <= MAX_NODES and self.n_nodes % 2 == 1):
            raise InvalidValue("n_nodes", self.n_nodes,
                               f"expected null or an odd int in [{MIN_NODES}, {MAX_NODES}]")
        if self.on_interp_error is not None and self.on_interp_error not in INTERP_ERROR_POLICIES:
            raise InvalidValue("on_interp_error", self.on_interp_error,
                               f"expected null or one of {', '.join(INTERP_ERROR_POLICIES)}")
        for name in ("rtol", "atol", "interp_tol"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidValue(name, value, "expected null or a float > 0")
        for name in ("check_rtol", "check_warn_above"):
            if not getattr(self, name) > 0:
                raise InvalidValue(name, getattr(self, name), "expected a float > 0")
        if self.check_every_n_steps < 0:
            raise InvalidValue("check_every_n_steps", self.check_every_n_steps,
                               "expected an int >= 0 (0 disables the check)")


def make_callback(cfg: InterpAdjointConfig) -> Any:
    """Build ``InterpolatedAdjointCallback`` from the section (called only when ``cfg.enabled``)."""
    callback_cls = import_callback("interp_adjoint", "InterpolatedAdjointCallback")
    return callback_cls(
        n_nodes=cfg.n_nodes,
        rtol=cfg.rtol,
        atol=cfg.atol,
        on_interp_error=cfg.on_interp_error,
        interp_tol=cfg.interp_tol,
        check_every_n_steps=cfg.check_every_n_steps,
        check_rtol=cfg.check_rtol,
        check_warn_above=cfg.check_warn_above,
        log_stats=cfg.log_stats,
    )


PLUGIN = Plugin(
    config=InterpAdjointConfig,
    make_callback=make_callback,
    order=50,  # changes solver settings only; no layer is replaced
    description="interpolated adjoint for ode.ODEBlock modules (InterpolatedAdjointCallback)",
)
