"""Datasets the recipes train on; all of them ship with Python or an installed package.

The DataModules need Lightning, so this package loads its names on first use: a task module can
import the cheap helpers (``recipes.data.stdlib_files``) while a recipe is validated without
importing Lightning.
"""
from recipes._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "DEFAULT_STDLIB_FILES": "recipes.data.stdlib_files",
    "ByteWindows": "recipes.data.stdlib_text",
    "DigitsDataModule": "recipes.data.digits",
    "StdlibTextDataModule": "recipes.data.stdlib_text",
    "load_digits_split": "recipes.data.digits",
    "load_stdlib_bytes": "recipes.data.stdlib_text",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
