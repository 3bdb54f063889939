"""Plugin section cp (CPCompressionCallback) and the recipe cnn_cp.yaml."""
from __future__ import annotations

import pytest

from recipes import RecipeError, load_recipe, run_recipe
from recipes.registry import get_plugin

from .conftest import RECIPES_DIR

CP = RECIPES_DIR / "cnn_cp.yaml"


@pytest.mark.parametrize("override, message", [
    ("cp.bits=1", "cp.bits=1 (from override 'cp.bits=1'): expected an int in [2, 8]"),
    ("cp.rate=1.0", "cp.rate=1.0 (from override 'cp.rate=1.0'): expected a float > 1"),
    ("cp.rank=0", "cp.rank=0 (from override 'cp.rank=0'): expected null or an int >= 1"),
    ("cp.when=start", "cp.when='start' (from override 'cp.when=start'): expected fit_start, "
                      "fit_end or a step count"),
    ("cp.when=-5", "cp.when=-5"),
    ("cp.include=[1]", "cp.include=[1] (from override 'cp.include=[1]'): expected null, a glob"),
    ("cp.max_iter=-1", "cp.max_iter=-1"),
], ids=["bits", "rate", "rank", "when", "when-neg", "include", "max-iter"])
def test_bad_values_fail_at_load(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(CP, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_make_callback_passes_every_field():
    recipe = load_recipe(CP, ["cp.rate=3.0", "cp.bits=5", "cp.rank=7", "cp.include=net.*",
                              "cp.exclude=[a, b]", "cp.when=fit_end", "cp.freeze_at_end=false",
                              "cp.max_iter=9", "cp.seed=3"])
    cb = get_plugin("cp").make_callback(recipe.cp)
    assert (cb.rate, cb.bits, cb.rank, cb.include, cb.exclude, cb.when, cb.freeze_at_end,
            cb.max_iter, cb.seed) == (3.0, 5, 7, "net.*", ["a", "b"], "fit_end", False, 9, 3)


def test_short_run_compresses_and_keeps_learning():
    lines = []
    recipe = load_recipe(CP, ["trainer.max_steps=40", "cp.when=30", "trainer.val_every_n_steps=30",
                              "trainer.print_every_n_steps=0", "cp.max_iter=10"])
    summary = run_recipe(recipe, printer=lines.append)
    assert summary.steps == 40
    assert summary.final_train_loss < 0.3 * summary.first_train_loss
    assert summary.val_metrics["val_acc"] > 0.9
    # the two inner convs are now frozen CP factors: only 1018 trainable values remain
    assert summary.num_params == 1018
