"""Plugin section remat (HiRemateCallback): every field reaches the callback."""
from __future__ import annotations

import pytest

from recipes import RecipeError, load_recipe
from recipes.registry import get_plugin

from .conftest import RECIPES_DIR

pytest.importorskip("lightning")

REMAT = RECIPES_DIR / "gpt_remat.yaml"


def test_make_callback_passes_every_field(tmp_path):
    recipe = load_recipe(REMAT, ["remat.budget=0.4", "remat.module=[net]", "remat.solver=dp",
                                 "remat.time_limit=7", f"remat.cache_dir={tmp_path}",
                                 "remat.strict=true", "remat.verbose=false"])
    settings = get_plugin("remat").make_callback(recipe.remat).settings
    assert (settings.budget.fraction, settings.module, settings.solver, settings.time_limit,
            settings.cache_dir, settings.strict, settings.verbose) == (
        0.4, ("net",), "dp", 7.0, str(tmp_path), True, False)


def test_an_unknown_solver_is_rejected_when_the_recipe_loads():
    with pytest.raises(RecipeError, match=r"^remat\.solver='hirarchical' \(from override "
                                          r"'remat\.solver=hirarchical'\): unknown solver; did "
                                          r"you mean 'hierarchical'"):
        load_recipe(REMAT, ["remat.solver=hirarchical"])
