"""YAML training recipes: ``python -m recipes.run recipes/<name>.yaml key=value ...``.

The only package that imports omegaconf. A recipe is a YAML file validated against a schema
assembled from dataclasses: fixed sections (``optim``, ``trainer``), the selected task's ``model``
and ``data`` sections (``recipes/tasks/<name>.py``) and one optional section per plugin
(``recipes/plugins/<section>.py``: ``remat``, ...). See ``recipes/README.md``.

Example:
    >>> from recipes import load_recipe, run_recipe
    >>> recipe = load_recipe("recipes/cnn_plain.yaml", ["trainer.max_steps=5"])
    >>> summary = run_recipe(recipe)  # doctest: +SKIP
"""
from recipes._lazy import lazy_exports

from recipes.config import load_recipe, parse_override, recipe_to_yaml
from recipes.errors import InvalidValue, RecipeError
from recipes.registry import (
    Plugin,
    Task,
    all_plugins,
    available_plugins,
    available_tasks,
    get_plugin,
    get_task,
)

# Training needs Lightning: imported on first use, so loading and validating a recipe (and
# ``python -m recipes.run --check`` of a bad one) never pays for it.
_LAZY = {"Summary": "recipes.stats", "run_recipe": "recipes.train"}

__all__ = [
    "InvalidValue",
    "Plugin",
    "RecipeError",
    "Summary",
    "Task",
    "all_plugins",
    "available_plugins",
    "available_tasks",
    "get_plugin",
    "get_task",
    "load_recipe",
    "parse_override",
    "recipe_to_yaml",
    "run_recipe",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
