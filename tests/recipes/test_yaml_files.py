"""Every recipe YAML in recipes/ loads, validates, and says how to run it (new files picked up)."""
from __future__ import annotations

import dataclasses
import enum

import pytest
from omegaconf import OmegaConf

from recipes import load_recipe, recipe_to_yaml
from recipes.registry import available_tasks

from .conftest import RECIPES_DIR

YAML_FILES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in YAML_FILES}
    assert {"gpt_plain.yaml", "gpt_remat.yaml", "cnn_plain.yaml", "cnn_remat.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.stem for p in YAML_FILES])
def test_first_line_is_the_command(path):
    first = path.read_text().splitlines()[0]
    assert first == f"# python -m recipes.run recipes/{path.name}"


# The purpose line is what `python -m recipes.run --list` prints next to the file name.
MAX_PURPOSE_CHARS = 72


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.stem for p in YAML_FILES])
def test_second_line_is_the_one_line_purpose(path):
    second = path.read_text().splitlines()[1]
    assert second.startswith("# ") and second[2:].strip(), (
        f"{path.name}: the second line must be '# <what it trains>' (shown by --list)")
    assert len(second[2:]) <= MAX_PURPOSE_CHARS, f"{path.name}: purpose longer than one short line"


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.stem for p in YAML_FILES])
def test_readme_describes_every_recipe(path):
    readme = (RECIPES_DIR / "README.md").read_text()
    assert f"| `{path.name}` |" in readme, (
        f"recipes/README.md has no row for {path.name} in its table of recipes")


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.value if isinstance(obj, enum.Enum) else obj


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.stem for p in YAML_FILES])
def test_loads_and_every_written_value_arrives(path):
    recipe = load_recipe(path)
    assert recipe.task in available_tasks()
    raw = OmegaConf.to_container(OmegaConf.load(path))  # the YAML types omegaconf reads
    for dotted, value in _leaves(raw):
        got = _get(recipe, dotted)
        assert got == value and type(got) is type(value), (dotted, got, value)


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.stem for p in YAML_FILES])
def test_printed_config_loads_back_identically(path, tmp_path):
    recipe = load_recipe(path)
    printed = tmp_path / "resolved.yaml"
    printed.write_text(recipe_to_yaml(recipe))
    assert dataclasses.asdict(load_recipe(printed)) == dataclasses.asdict(recipe)
