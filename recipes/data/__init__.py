"""Datasets the recipes train on; all of them ship with Python or an installed package."""
from recipes.data.digits import DigitsDataModule, load_digits_split
from recipes.data.stdlib_text import (
    DEFAULT_STDLIB_FILES,
    ByteWindows,
    StdlibTextDataModule,
    load_stdlib_bytes,
)

__all__ = [
    "DEFAULT_STDLIB_FILES",
    "ByteWindows",
    "DigitsDataModule",
    "StdlibTextDataModule",
    "load_digits_split",
    "load_stdlib_bytes",
]
