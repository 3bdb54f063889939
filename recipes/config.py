"""Load a recipe: YAML file + ``key=value`` overrides -> a validated, typed config object.

Strictness (see ``recipes/README.md`` for the messages):

* every key, in the YAML or an override, must exist in the schema; a misspelt key is an error
  naming the full dotted key, the closest valid key and all keys valid at that level;
* every value must have the field's type (omegaconf converts ``"5"`` to ``5`` but not ``"abc"``),
  and enumerated fields take one of their listed values;
* section dataclasses check the rest in ``__post_init__`` (raising
  :class:`~recipes.errors.InvalidValue`), e.g. ``remat.budget`` with ``remat.budget.parse_budget``.

NOTE [ Task first, then the schema ]
    The ``model:`` and ``data:`` sections depend on the task, so the task name is read first (the
    last ``task=...`` override, else the YAML's ``task:``), the task's dataclasses are looked up in
    the registry and only then is the full schema built and the YAML merged into it.

NOTE [ Merging one piece at a time ]
    The YAML is merged one top-level section at a time and each override on its own, so an error
    can say which part of the input caused it ("in recipes/x.yaml" or "from override 'k=v'").
    Values keep their YAML types: ``budget: 0.7`` is a float and ``budget: 70%`` a string, which
    ``parse_budget`` reads as the same fraction.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from recipes.checks import check_recipe
from recipes.errors import InvalidValue, RecipeError
from recipes.registry import all_plugins, available_tasks, closest, get_task
from recipes.schema import build_schema

try:
    import yaml
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        MissingMandatoryValue,
        OmegaConfBaseException,
    )
except ModuleNotFoundError as e:  # pragma: no cover - exercised only without the extra
    raise ModuleNotFoundError(
        f'recipes need omegaconf ({e}); install it with: pip install "hiremate[recipes]"'
    ) from e

__all__ = ["load_recipe", "recipe_to_yaml", "recipe_line", "parse_override", "Override"]

# Sections whose keys come from the selected task's dataclasses.
_TASK_SECTIONS = ("model", "data")
# The recipes that ship with hiremate (recipes/*.yaml).
RECIPES_DIR = Path(__file__).resolve().parent
_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class Override:
    """One ``key=value`` command-line override.

    Attributes:
        text: As the user typed it.
        key: The dotted key.
        value: The value parsed as YAML (``5`` -> int, ``50%`` -> str, ``null`` -> None).
    """

    text: str
    key: str
    value: Any


def parse_override(text: str) -> Override:
    """Parse ``"trainer.max_steps=5"`` into an :class:`Override`.

    Raises:
        RecipeError: when the text is not ``dotted.key=value``.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise RecipeError(
            f"override {text!r}: expected dotted.key=value, e.g. trainer.max_steps=5 or "
            "remat.budget=50%"
        )
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise RecipeError(f"override {text!r}: cannot parse the value {raw!r}: {e}") from e
    return Override(text=text, key=key, value=value)


def _shown(folder: Path) -> str:
    """``folder`` relative to the working directory when it is below it (``recipes``)."""
    try:
        return str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(folder)


def _missing_file(path: Path) -> RecipeError:
    """The error for a recipe path that is not a file: the closest recipe and the list."""
    folder = path.parent if path.parent.is_dir() else RECIPES_DIR
    names = sorted(p.name for p in folder.glob("*.yaml")) if folder.is_dir() else []
    if not names:
        folder = RECIPES_DIR
        names = sorted(p.name for p in folder.glob("*.yaml"))
    where = str(path.parent) if folder == path.parent else _shown(folder)
    stems = {Path(n).stem: n for n in names}  # ".yaml" alone must not make names look alike
    best = stems.get(closest(Path(path.name).stem, list(stems)) or "")
    hint = f"; did you mean '{Path(where) / best}'?" if best else "."
    what = "is a directory, not a recipe file" if path.is_dir() else "not found"
    return RecipeError(
        f"recipe file {str(path)!r} {what}{hint} Recipes in {where}/: {', '.join(names)} "
        "(python -m recipes.run --list says what each one trains)"
    )


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise _missing_file(path)
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"{path}: expected a mapping of sections at the top level, got a list")
    return OmegaConf.to_container(raw, resolve=False)


def _select(tree: Any, dotted: str) -> Any:
    """Value at ``a.b.c`` in nested dicts, or ``None``."""
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _task_name(raw: dict, overrides: Sequence[Override], where: str) -> str:
    tasks = available_tasks()
    name = next((o.value for o in reversed(overrides) if o.key == "task"), raw.get("task"))
    if name is None:
        raise RecipeError(
            f"missing key 'task' ({where}): set it to one of {', '.join(tasks)}, "
            f"e.g. task: {tasks[0]}"
        )
    if not isinstance(name, str):
        raise RecipeError(f"task={name!r}: expected a task name, one of {', '.join(tasks)}")
    return name


class _Origin:
    """Says where a key's value came from: the YAML file or an override."""

    def __init__(self, path: Path, overrides: Sequence[Override]) -> None:
        self.path = path
        self.overrides = overrides

    def of(self, full_key: str) -> str:
        for o in reversed(self.overrides):
            inside = full_key.startswith(o.key + ".") or o.key.startswith(full_key + ".")
            if o.key == full_key or inside:
                return f"from override {o.text!r}"
        return f"in {self.path}"


def _keys_at(cfg: DictConfig, parent: str) -> list[str]:
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _translate(
    e: OmegaConfBaseException, cfg: DictConfig, value: Any, where: str, top: str
) -> RecipeError:
    """Turn an omegaconf error into a RecipeError naming the full dotted key."""
    full_key = str(getattr(e, "full_key", "") or "")
    first_line = str(getattr(e, "msg", None) or e).splitlines()[0]
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and full_key:
        parent, _, leaf = full_key.rpartition(".")
        keys = _keys_at(cfg, parent)
        best = closest(leaf, keys)
        hint = f"; did you mean '{parent + '.' if parent else ''}{best}'?" if best else "."
        level = f"under '{parent}'" if parent else "at the top level"
        section = full_key.split(".")[0]
        depends = (
            f" (the keys of '{section}' depend on the task; task={cfg.task!r})"
            if section in _TASK_SECTIONS and parent
            else ""
        )
        return RecipeError(
            f"unknown key '{full_key}' ({where}){hint} Keys allowed {level}: "
            f"{', '.join(keys)}{depends}"
        )
    if isinstance(e, MissingMandatoryValue) and full_key:
        return RecipeError(
            f"missing value for '{full_key}': set it in the YAML or with {full_key}=..."
        )
    if full_key:
        return RecipeError(f"{full_key}={value!r} ({where}): {first_line}")
    # No key recorded: the value replaced a whole section (e.g. `trainer: 5`).
    if top in _keys_at(cfg, "") and isinstance(cfg[top], DictConfig):
        return RecipeError(
            f"{top}={value!r} ({where}): '{top}' is a section; expected a mapping of its keys "
            f"({', '.join(_keys_at(cfg, top))})"
        )
    return RecipeError(f"{top}={value!r} ({where}): {first_line}")


def _build_sections(cfg: DictConfig, schema: type, origin: _Origin) -> Any:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        try:
            if OmegaConf.is_missing(cfg, f.name):
                raise RecipeError(
                    f"missing value for '{f.name}': set it in the YAML or with {f.name}=..."
                )
            node = cfg[f.name]
            values[f.name] = OmegaConf.to_object(node) if isinstance(node, DictConfig) else node
        except InvalidValue as e:
            key = f"{f.name}.{e.key}"
            raise RecipeError(f"{key}={e.value!r} ({origin.of(key)}): {e.reason}") from e
        except OmegaConfBaseException as e:
            full_key = str(getattr(e, "full_key", "") or f.name)
            raw = _select(OmegaConf.to_container(cfg, resolve=False), full_key)
            raise _translate(e, cfg, raw, origin.of(full_key), f.name) from e
    return schema(**values)


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Any:
    """Load, merge and validate a recipe.

    Args:
        path: The YAML file (``recipes/gpt_plain.yaml``).
        overrides: ``key=value`` strings applied in order after the YAML
            (``["trainer.max_steps=5", "remat.budget=50%"]``).

    Returns:
        An instance of the ``Recipe`` dataclass built by :func:`recipes.schema.build_schema`:
        ``recipe.task`` (str), ``recipe.seed``, ``recipe.model`` / ``recipe.data`` (the task's
        dataclasses), ``recipe.optim``, ``recipe.trainer`` and one attribute per plugin section.

    Raises:
        RecipeError: for a missing file, bad YAML, an unknown key, a value of the wrong type or a
            value that is not allowed; the message names the full dotted key, the value, what is
            allowed and where the value came from.

    Example:
        >>> recipe = load_recipe("recipes/cnn_plain.yaml", ["trainer.max_steps=5"])
        >>> recipe.trainer.max_steps
        5
    """
    path = Path(path)
    raw = _read_yaml(path)
    parsed = [parse_override(o) for o in overrides]
    task = get_task(_task_name(raw, parsed, f"in {path}"))
    plugins = all_plugins()
    schema = build_schema(task, plugins)
    cfg = OmegaConf.structured(schema)
    cfg.task = task.name
    for key, value in raw.items():
        if key == "task":  # already chosen, see NOTE [ Task first, then the schema ]
            continue
        try:
            cfg.merge_with({key: value})
        except OmegaConfBaseException as e:
            full_key = str(getattr(e, "full_key", "") or key)
            shown = _select(raw, full_key) if full_key != key else value
            raise _translate(e, cfg, shown, f"in {path}", str(key)) from e
    for o in parsed:
        if o.key == "task":
            continue
        try:
            cfg.merge_with(_nest(o.key, o.value))
        except OmegaConfBaseException as e:
            where = f"from override {o.text!r}"
            raise _translate(e, cfg, o.value, where, o.key.split(".")[0]) from e
    origin = _Origin(path, parsed)
    recipe = _build_sections(cfg, schema, origin)
    try:  # see NOTE [ One validation phase ] in recipes/checks.py
        check_recipe(recipe, task=task, plugins=plugins)
    except InvalidValue as e:
        raise RecipeError(f"{e.key}={e.value!r} ({origin.of(e.key)}): {e.reason}") from e
    return recipe


def _nest(dotted: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def recipe_to_yaml(recipe: Any) -> str:
    """The resolved recipe as YAML, sections in schema order (what ``recipes.run --print-config``
    and ``--check`` print)."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


def recipe_line(path: str | Path, overrides: Sequence[str]) -> str:
    """The one line a run prints for its config, instead of the whole resolved YAML::

        config: recipes/gpt_remat.yaml + 1 override (trainer.max_steps=30); full config: --print-config
    """
    count = len(overrides)
    shown = (f" + {count} override{'s' if count > 1 else ''} ({', '.join(overrides)})"
             if count else "")
    return f"config: {path}{shown}; full config: --print-config"

