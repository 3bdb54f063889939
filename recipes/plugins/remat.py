"""Plugin section ``remat:``: hierarchical rematerialization with ``HiRemateCallback``.

Example (YAML)::

    remat:
      enabled: true
      budget: 50%        # or 0.5, or 6GiB / 512MB (bytes always carry a unit)
      module: net        # default: every top-level child holding parameters

Paper: Gusak, Zhao, Le Hellard, Li, Eyraud-Dubois, Beaumont, "HiRemate: Hierarchical Approach for
Efficient Re-materialization of Neural Networks", ICML 2025.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from recipes.errors import InvalidValue
from recipes.registry import Plugin, import_callback


@dataclass
class RematConfig:
    """The ``remat:`` section; the fields after ``enabled`` are ``HiRemateCallback``'s arguments.

    Attributes:
        enabled: Add the callback to the run.
        budget: Activation-memory budget: ``"70%"`` / ``0.7`` (fraction of the unmodified
            network's activation peak) or ``"6GiB"`` / ``"512MB"`` (bytes, always with a unit:
            ``budget: 50`` is refused, as it could be 50% or 50 bytes). Checked with
            ``remat.parse_budget`` when the recipe is loaded. YAML keeps the type:
            ``budget: 0.7`` is a float, ``budget: 70%`` a string; both mean the same.
        module: Which LightningModule attribute(s) to rematerialize: ``null`` (every top-level
            child holding parameters, i.e. ``net`` in the recipe tasks), a name, or a list of names.
        solver: The solver name, passed through (``HiRemateCallback`` checks it).
        time_limit: Seconds the solver may take (a finite number > 0).
        cache_dir: Directory of the plan cache; ``null``: the user's cache directory
            (``HIREMATE_CACHE_DIR``), ``off``: plans kept in memory only.
        strict: Raise (instead of warning and training unmodified) when the network cannot be
            captured.
        verbose: Log the callback's summary table.
    """

    enabled: bool = False
    budget: Any = "70%"
    module: Any = None
    solver: str = "hierarchical"
    time_limit: float = 60.0
    cache_dir: Optional[str] = None
    strict: bool = False
    verbose: bool = True

    def __post_init__(self) -> None:
        # remat's own checkers (NOTE [ One check per setting ] in remat/settings.py), imported
        # lazily to keep the plugin module cheap to import.
        from remat import check_time_limit, parse_budget

        try:
            parse_budget(self.budget)
        except ValueError as e:
            raise _invalid("budget", self.budget, e) from e
        module = self.module
        names = [module] if isinstance(module, str) else module
        names_ok = isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)
        if module is not None and not names_ok:
            raise InvalidValue(
                "module", module,
                "expected null (auto), an attribute name such as net, or a list of names",
            )
        try:
            check_time_limit(self.time_limit, name="remat.time_limit")
        except (ValueError, TypeError) as e:
            raise _invalid("time_limit", self.time_limit, e, name="remat.time_limit") from e


def _invalid(key: str, value: Any, error: Exception, name: str | None = None) -> InvalidValue:
    """remat's ``<name>=<value>: reason`` message as an :class:`InvalidValue` (the loader adds
    the section and where the value came from)."""
    reason = str(error)
    prefix = f"{name or key}={value!r}: "
    return InvalidValue(key, value, reason[len(prefix):] if reason.startswith(prefix) else reason)


def make_callback(cfg: RematConfig) -> Any:
    """Build ``HiRemateCallback`` from the section (called only when ``cfg.enabled``)."""
    callback_cls = import_callback("remat", "HiRemateCallback")
    return callback_cls(
        cfg.budget,
        module=cfg.module,
        solver=cfg.solver,
        time_limit=cfg.time_limit,
        cache_dir=cfg.cache_dir,
        strict=cfg.strict,
        verbose=cfg.verbose,
    )


def check(cfg: RematConfig, recipe: Any) -> None:
    """``HiRemateCallback``'s own argument checks (solver names, ...), run when the recipe is
    loaded, so ``--check`` rejects what a run would (NOTE [ One validation phase ])."""
    from integrations._remat_shared import check_settings  # no Lightning import

    check_settings(budget=cfg.budget, solver=cfg.solver, time_limit=cfg.time_limit,
                   module=cfg.module, cache_dir=cfg.cache_dir, strict=cfg.strict,
                   verbose=cfg.verbose)


PLUGIN = Plugin(
    config=RematConfig,
    make_callback=make_callback,
    check=check,
    order=100,  # last: captures the network after plugins that replace layers or activations
    description="HiRemate rematerialization under an activation-memory budget (HiRemateCallback)",
)
