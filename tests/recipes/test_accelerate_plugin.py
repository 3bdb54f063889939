"""Plugin section accelerate and recipes/accelerate_run.py: the Accelerate-launched recipe."""
from __future__ import annotations

import pytest

from recipes import RecipeError, load_recipe, run_recipe
from recipes.registry import get_plugin

from .conftest import RECIPES_DIR

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from integrations.accelerate import HiRematePlugin  # noqa: E402
from recipes.accelerate_run import _accelerator, run_recipe_accelerate  # noqa: E402

ACCELERATE = RECIPES_DIR / "gpt_accelerate.yaml"
REMAT = RECIPES_DIR / "gpt_remat.yaml"
# A small GPT keeps both runs to a few seconds; dropout stays on (its masks must match too).
SMALL = ["trainer.max_steps=4", "trainer.print_every_n_steps=0", "trainer.limit_val_batches=2",
         "model.n_layer=2", "model.n_embd=64", "model.block_size=64", "data.batch_size=8",
         "remat.solver=dp"]
LOOP_BOOKKEEPING_BYTES = 1024


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_loop_matches_the_lightning_run_bitwise(monkeypatch, tmp_path):
    """Same recipe, same seed: Lightning + HiRemateCallback and Accelerate + the launcher flag."""
    # Op times are measured, so two solves on a busy machine can pick different schedules: the
    # Accelerate run reads the Lightning run's plan from a shared cache (as a re-run would).
    lightning = run_recipe(load_recipe(REMAT, [*SMALL, "remat.solver=dp",
                                               f"remat.cache_dir={tmp_path}"]),
                           printer=lambda _: None)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setenv("HIREMATE_BUDGET", "50%")
    monkeypatch.setenv("HIREMATE_SOLVER", "dp")
    monkeypatch.setenv("HIREMATE_CACHE_DIR", str(tmp_path))
    lines: list[str] = []
    accelerate = run_recipe_accelerate(load_recipe(ACCELERATE, [*SMALL, "remat.enabled=false"]),
                                       printer=lines.append)
    assert accelerate.train_losses == lightning.train_losses and len(lightning.train_losses) == 4
    assert accelerate.val_metrics == lightning.val_metrics
    # Both measured the last step with remat.track_memory: the same schedule, the same peak up to
    # the loops' own bookkeeping (Lightning keeps a few scalar tensors for logging: 4 bytes here).
    assert abs(accelerate.step_peak_bytes - lightning.step_peak_bytes) <= LOOP_BOOKKEEPING_BYTES
    assert accelerate.extra["launcher"].startswith("accelerate, 1 process(es), no mixed precision; "
                                                   "remat: budget 50%, solver dp")
    assert lines[-1].startswith("== summary ==")


def test_remat_section_becomes_the_plugin():
    recipe = load_recipe(ACCELERATE, ["remat.budget=0.4", "remat.module=net.blocks",
                                      "remat.solver=dp", "remat.time_limit=9", "remat.strict=true"])
    assert _accelerator(recipe).hiremate_plugin == HiRematePlugin(
        budget=0.4, module=["blocks"], solver="dp", time_limit=9.0, strict=True)


@pytest.mark.parametrize("override, message", [
    ("remat.module=blocks", "remat.module='blocks': the Accelerate runner rematerializes the "
                            "task's network, module.net"),
    ("trainer.precision=64-true", "trainer.precision='64-true': the Accelerate runner supports "
                                  "32-true, 16-mixed, bf16-mixed"),
    ("trainer.strategy=fsdp", "trainer.strategy='fsdp': the Accelerate runner supports auto, ddp"),
], ids=["module", "precision", "strategy"])
def test_settings_the_runner_cannot_honour_fail_before_building(override, message):
    with pytest.raises(RecipeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        run_recipe_accelerate(load_recipe(ACCELERATE, [override]))


def test_lightning_runner_points_to_the_accelerate_runner():
    recipe = load_recipe(ACCELERATE)
    with pytest.raises(RecipeError, match=r"python -m recipes.accelerate_run"):
        get_plugin("accelerate").make_callback(recipe.accelerate)


def test_recipes_run_hands_accelerate_recipes_to_the_accelerate_runner(monkeypatch):
    import recipes.accelerate_run
    from recipes.train import run_recipe

    seen = []
    monkeypatch.setattr(recipes.accelerate_run, "run_recipe_accelerate",
                        lambda recipe, printer=print: seen.append(recipe.task) or "summary")
    assert run_recipe(load_recipe(ACCELERATE)) == "summary"
    assert seen == ["gpt_lm"]
