"""Find the ``remat.RematModule`` s in a model without importing ``remat`` (seconds), for the
callbacks that replace modules and must not do it inside a captured graph."""
from __future__ import annotations

import sys
from typing import Any

from torch import nn


def remat_modules(root: nn.Module) -> list[tuple[str, Any]]:
    """``(name, module)`` of every ``remat.RematModule`` in ``root``; none when ``remat`` was
    never imported, as then none can exist."""
    remat = sys.modules.get("remat")
    if remat is None:
        return []
    return [(n, m) for n, m in root.named_modules() if isinstance(m, remat.RematModule)]
