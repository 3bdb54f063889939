"""Plugin section fewbit (FewBitCallback) and the recipe gpt_fewbit.yaml."""
from __future__ import annotations

import logging

import pytest

from recipes import RecipeError, load_recipe, run_recipe
from recipes.registry import get_plugin

from .conftest import RECIPES_DIR

FEWBIT = RECIPES_DIR / "gpt_fewbit.yaml"


@pytest.mark.parametrize("override, message", [
    ("fewbit.bits=5", "fewbit.bits=5 (from override 'fewbit.bits=5'): expected one of 1, 2, 3, 4"),
    ("fewbit.bits=0", "fewbit.bits=0"),
    ("fewbit.include=[1]", "fewbit.include=[1] (from override 'fewbit.include=[1]'): expected "
                           "null, a glob"),
    ("fewbit.exclude=[]", "fewbit.exclude=[]"),
], ids=["bits5", "bits0", "include", "exclude-empty"])
def test_bad_values_fail_at_load(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(FEWBIT, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_make_callback_passes_every_field():
    recipe = load_recipe(FEWBIT, ["fewbit.bits=3", "fewbit.include=net.*", "fewbit.exclude=[GELU]",
                                  "fewbit.strict=true", "fewbit.measure=false"])
    cb = get_plugin("fewbit").make_callback(recipe.fewbit)
    assert (cb.bits, cb.include, cb.exclude, cb.strict, cb.measure) == (
        3, ("net.*",), ("GELU",), True, False)


def test_short_run_replaces_gelu_and_learns(caplog):
    lines = []
    recipe = load_recipe(FEWBIT, ["trainer.max_steps=12", "trainer.print_every_n_steps=0",
                                  "trainer.limit_val_batches=2", "model.n_layer=2",
                                  "model.block_size=64", "data.batch_size=8"])
    with caplog.at_level(logging.INFO):
        summary = run_recipe(recipe, printer=lines.append)
    assert "2 x GELU         -> 2-bit codes" in caplog.text  # one MLP GELU per block
    assert "with few-bit activations vs" in caplog.text  # the first step's measurement
    assert summary.steps == 12
    assert summary.final_train_loss < summary.first_train_loss - 0.5
