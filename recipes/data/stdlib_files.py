"""Which CPython stdlib files the GPT recipes read, and their sizes (no Lightning, no reading).

Used when a recipe is validated (``recipes.tasks.gpt_lm``) and by
:mod:`recipes.data.stdlib_text`, which reads the files.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Sequence

__all__ = ["DEFAULT_STDLIB_FILES", "stdlib_dir", "missing_stdlib_files", "stdlib_bytes"]

# ~560 kB of Python 3.11 source: pure-Python modules present in every CPython build.
DEFAULT_STDLIB_FILES = (
    "argparse.py", "textwrap.py", "difflib.py", "fractions.py", "statistics.py", "heapq.py",
    "bisect.py", "functools.py", "dataclasses.py", "enum.py", "random.py", "string.py",
    "shlex.py", "calendar.py",
)


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def missing_stdlib_files(files: Sequence[str]) -> list[str]:
    """The names in ``files`` that are not files under :func:`stdlib_dir`."""
    root = stdlib_dir()
    return [name for name in files if not (root / name).is_file()]


def stdlib_bytes(files: Sequence[str]) -> int:
    """Total size in bytes of ``files`` (all present) under :func:`stdlib_dir`: the length of the
    text :func:`recipes.data.stdlib_text.load_stdlib_bytes` returns."""
    root = stdlib_dir()
    return sum((root / name).stat().st_size for name in files)
