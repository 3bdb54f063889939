"""Checks of a loaded recipe that involve more than one field: the task's cross-section check, the
enabled plugins' own argument checks, and the directories a run would write to.

NOTE [ One validation phase ]
    Everything a run would reject before its first training step is checked here or in the
    section dataclasses, while the recipe is loaded (:func:`recipes.config.load_recipe` calls
    :func:`check_recipe`), without importing Lightning: ``python -m recipes.run --check``, a run
    and ``python -m recipes.accelerate_run`` all load the recipe the same way, so they accept and
    reject the same recipes, and a bad one fails in the time it takes to import torch. What only
    Lightning can judge (a strategy name, an accelerator that is not there) and the callbacks'
    ``__init__`` checks are then run by :func:`recipes.train.prepare_run`, which ``--check``
    calls too. Checks that need the built model (``remat.module`` names) run at the start of
    ``fit``, before the first step, and are reported the same way (``error: ...``, status 2).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from recipes.errors import InvalidValue, RecipeError
from recipes.registry import Plugin, Task

__all__ = ["check_recipe", "directory_problem", "DIRECTORY_SUFFIX"]

# A plugin field whose name ends with this is a directory the callback writes (``cache_dir``).
DIRECTORY_SUFFIX = "_dir"


def directory_problem(path: str | os.PathLike) -> str | None:
    """Why a run could not create or write the directory ``path``, or ``None`` when it can.

    A missing directory is fine when its closest existing ancestor is a writable directory (the
    callbacks create it, parents included).

    Example:
        >>> directory_problem("/etc/passwd")
        "'/etc/passwd' is a file, not a directory"
    """
    target = Path(path).expanduser()
    if target.is_symlink() and not target.exists():
        return f"{str(target)!r} is a broken symbolic link"
    if target.exists():
        if not target.is_dir():
            return f"{str(target)!r} is a file, not a directory"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"the directory {str(target)!r} is not writable"
        return None
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{str(target)!r} cannot be created: {str(ancestor)!r} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{str(target)!r} cannot be created: {str(ancestor)!r} is not writable"
    return None


def _check_directory(key: str, value: Any, *, nullable: bool, what: str) -> None:
    problem = directory_problem(value)
    if problem:
        fix = "pass a directory that exists or can be created" + (", or null" if nullable else "")
        raise InvalidValue(key, value, f"{what}, but {problem}; {fix}")


def _check_plugin(name: str, plugin: Plugin, cfg: Any, recipe: Any) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name.endswith(DIRECTORY_SUFFIX) and value is not None:
            _check_directory(f"{name}.{f.name}", value, nullable=f.default is None,
                             what=f"{name}.enabled=true writes there")
    if plugin.check is None:
        return
    try:
        plugin.check(cfg, recipe)
    except InvalidValue as e:
        raise InvalidValue(f"{name}.{e.key}", e.value, e.reason) from e
    except (ValueError, TypeError) as e:
        raise _as_invalid(name, cfg, e) from e


def _as_invalid(section: str, cfg: Any, e: Exception) -> InvalidValue | RecipeError:
    """``solver='x': unknown solver ...`` from a callback's check -> ``remat.solver``'s error."""
    message = str(e)
    key = message.partition("=")[0]
    names = {f.name for f in dataclasses.fields(cfg)}
    prefix = f"{key}={getattr(cfg, key, None)!r}: "
    if key in names and message.startswith(prefix):
        return InvalidValue(f"{section}.{key}", getattr(cfg, key), message[len(prefix):])
    return RecipeError(f"{section}: {message}")


def check_recipe(recipe: Any, *, task: Task, plugins: dict[str, Plugin]) -> None:
    """Run the checks of NOTE [ One validation phase ] on a recipe whose sections are valid.

    Args:
        recipe: The recipe dataclass built by :func:`recipes.config.load_recipe`.
        task: Its task (``TASK.check`` runs on the model and data sections).
        plugins: Every plugin by section name; the enabled ones are checked.

    Raises:
        InvalidValue: with the dotted key from the recipe's top (``remat.cache_dir``); the loader
            adds where the value came from.
        RecipeError: a plugin check's message that names no field of its section.
    """
    if task.check is not None:
        task.check(recipe.model, recipe.data)
    trainer = recipe.trainer
    if trainer.logger or trainer.enable_checkpointing:
        writes = "trainer.logger" if trainer.logger else "trainer.enable_checkpointing"
        _check_directory("trainer.default_root_dir", trainer.default_root_dir, nullable=False,
                         what=f"{writes}=true writes there")
    for name, plugin in plugins.items():
        section = getattr(recipe, name)
        if section.enabled:
            _check_plugin(name, plugin, section, recipe)

