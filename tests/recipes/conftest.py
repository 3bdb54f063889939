"""Paths shared by the recipe tests."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO / "recipes"


@pytest.fixture
def recipe_path():
    """Absolute path of a recipe YAML by file name."""
    return lambda name: RECIPES_DIR / name
