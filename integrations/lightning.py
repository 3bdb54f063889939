"""Lightning callbacks for hiremate.

Each callback lives in a module of its own (one concern per file); this module is the public
entry point and loads them lazily, so ``import integrations.lightning`` stays cheap and a missing
optional dependency only fails for the callback that needs it::

    from integrations.lightning import HiRemateCallback
    Trainer(callbacks=[HiRemateCallback(budget="70%")])
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_CALLBACKS = {
    "HiRemateCallback": "integrations.remat_callback",
    "FewBitCallback": "integrations.fewbit_callback",
    "CPCompressionCallback": "integrations.cp_callback",
    "InterpolatedAdjointCallback": "integrations.ode_callback",
}

__all__ = sorted(_CALLBACKS)


def __getattr__(name: str) -> Any:
    module = _CALLBACKS.get(name)
    if module is None:
        raise AttributeError(
            f"module 'integrations.lightning' has no attribute {name!r}; "
            f"available callbacks: {', '.join(__all__)}"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
