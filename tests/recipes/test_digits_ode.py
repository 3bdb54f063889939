"""Task digits_ode and plugin section interp_adjoint (InterpolatedAdjointCallback)."""
from __future__ import annotations

import math

import pytest

from recipes import RecipeError, load_recipe, run_recipe
from recipes.registry import get_plugin

from .conftest import RECIPES_DIR

INTERP = RECIPES_DIR / "digits_ode_interp.yaml"
ADJOINT = RECIPES_DIR / "digits_ode_adjoint.yaml"


@pytest.mark.parametrize("override, message", [
    ("model.n_nodes=8", "model.n_nodes=8 (from override 'model.n_nodes=8'): expected an odd int in [3, 129]"),
    ("model.grad=magic", "model.grad='magic' (from override 'model.grad=magic'): expected one of backprop, adjoint, interpolated"),
    ("model.rtol=0", "model.rtol=0.0 (from override 'model.rtol=0'): expected a float > 0"),
    ("interp_adjoint.n_nodes=4", "interp_adjoint.n_nodes=4 (from override 'interp_adjoint.n_nodes=4'): expected null or an odd int"),
    ("interp_adjoint.on_interp_error=skip", "interp_adjoint.on_interp_error='skip' (from override 'interp_adjoint.on_interp_error=skip'): expected null or one of warn, raise, refine, fallback"),
    ("interp_adjoint.check_every_n_steps=-1", "interp_adjoint.check_every_n_steps=-1"),
], ids=["model-n_nodes", "model-grad", "model-rtol", "plugin-n_nodes", "plugin-policy", "plugin-check"])
def test_bad_values_fail_at_load(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(INTERP, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_make_callback_passes_every_field():
    recipe = load_recipe(INTERP, [
        "interp_adjoint.n_nodes=9", "interp_adjoint.rtol=1e-5", "interp_adjoint.atol=1e-7",
        "interp_adjoint.on_interp_error=refine", "interp_adjoint.interp_tol=0.05",
        "interp_adjoint.check_every_n_steps=7", "interp_adjoint.check_rtol=1e-8",
        "interp_adjoint.check_warn_above=0.1", "interp_adjoint.log_stats=false"])
    callback = get_plugin("interp_adjoint").make_callback(recipe.interp_adjoint)
    assert callback.overrides == {"grad": "interpolated", "n_nodes": 9, "rtol": 1e-5,
                                  "atol": 1e-7, "on_interp_error": "refine", "interp_tol": 0.05}
    assert (callback.check_every_n_steps, callback.check_rtol, callback.check_warn_above,
            callback.log_stats) == (7, 1e-8, 0.1, False)


def test_interpolated_trains_like_adjoint():
    """Same seed, batches and initialisation: the two gradient methods give the same training
    curve (their gradients differ by ~solver tolerance)."""
    lines = []
    steps = ["trainer.max_steps=20", "trainer.print_every_n_steps=20"]
    interp = run_recipe(load_recipe(INTERP, steps + ["interp_adjoint.check_every_n_steps=10"]),
                        printer=lines.append)
    adjoint = run_recipe(load_recipe(ADJOINT, steps), printer=lines.append)
    assert abs(interp.first_train_loss - math.log(10)) < 0.3
    assert interp.final_train_loss < 0.6 * interp.first_train_loss
    assert abs(interp.final_train_loss - adjoint.final_train_loss) < 1e-3
    assert abs(interp.val_metrics["val_acc"] - adjoint.val_metrics["val_acc"]) <= 1 / 360
