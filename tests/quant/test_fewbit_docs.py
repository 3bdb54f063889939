"""The examples in quant.fewbit's docstrings run and print what they say."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["fit", "memory", "modules", "replace", "tables"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"quant.fewbit.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
