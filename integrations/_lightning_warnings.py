"""A deprecation warning Lightning raises on torch's behalf, filtered exactly where we call it.

NOTE [ Lightning's LeafSpec warning ]
    Lightning 2.6's ``CombinedLoader`` flattens the loaders with its own copy of torch's pytree
    flattening (``lightning/pytorch/utilities/_pytree.py``), which builds ``LeafSpec()``; torch
    2.13 deprecated that class, so each ``CombinedLoader`` may warn ``FutureWarning:
    `isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and
    treespec.is_leaf()` instead``, pointing at Lightning's file. The user can do nothing about it
    (the fix is Lightning's), and a recipe run printed it twice: once from ``HiRemateCallback``
    reading its example batch, once from the fit loop's own loaders. :func:`quiet_leafspec`
    ignores exactly that message, category and module, only around our own calls into Lightning
    (the callback's ``CombinedLoader``, the recipe runner's ``fit`` and ``validate``): every other
    warning, and this one raised from anywhere else, still shows.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

__all__ = ["quiet_leafspec"]

_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_MODULE = r"lightning\.pytorch\.utilities\._pytree"


@contextlib.contextmanager
def quiet_leafspec() -> Iterator[None]:
    """Ignore Lightning's ``LeafSpec`` deprecation warning inside the block (and nothing else);
    see NOTE [ Lightning's LeafSpec warning ]."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MESSAGE, category=FutureWarning,
                                module=_MODULE)
        yield
