"""Task and plugin registries, discovered from the files in ``recipes/tasks/`` and ``recipes/plugins/``.

A *task* is a model + data + training step (``gpt_lm``, ``digits_cnn``); a recipe picks one with
``task: <name>``. A *plugin* is an optional callback section of every recipe (``remat:``,
``fewbit:``, ...) that is off unless ``enabled: true``. Both are found by module name, so adding
one is adding one file; nothing shared is edited (see ``recipes/README.md``).

NOTE [ Discovery by module name ]
    ``available_tasks()`` lists the modules of ``recipes.tasks`` without importing them (names
    starting with ``_`` are private helpers and skipped); ``get_task(name)`` imports only the one
    asked for, so a task whose optional dependency is missing cannot break the others. Plugins are
    all imported when the schema is built (each one is a section of every recipe), which is why a
    plugin module must stay cheap: dataclasses only, with the callback imported inside
    ``make_callback``.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from recipes.errors import RecipeError

__all__ = [
    "Task",
    "Plugin",
    "available_tasks",
    "get_task",
    "available_plugins",
    "get_plugin",
    "all_plugins",
    "import_callback",
    "closest",
    "suggest",
]

_TASKS_PACKAGE = "recipes.tasks"
_PLUGINS_PACKAGE = "recipes.plugins"
# Third-party modules whose absence means the recipes extra is not installed.
_RECIPES_EXTRA_MODULES = frozenset({"lightning", "omegaconf", "sklearn", "tqdm"})
_INSTALL_HINT = 'pip install "hiremate[recipes]"'


@dataclass(frozen=True)
class Task:
    """What ``recipes/tasks/<name>.py`` exports as ``TASK``.

    Attributes:
        model: Dataclass type of the recipe's ``model:`` section.
        data: Dataclass type of the recipe's ``data:`` section.
        build: ``build(model_cfg, data_cfg, optim_cfg) -> (LightningModule, LightningDataModule)``.
            The LightningModule holds the network (a plain ``nn.Module``) as ``self.net``. Import
            Lightning (and the modules that need it) inside ``build``: the task module is imported
            to validate a recipe, which must not pay for Lightning.
        description: One line for ``python -m recipes.run --list``.
        check: ``check(model_cfg, data_cfg) -> None``, or ``None``: the checks that involve both
            sections (or the data on disk), which ``build`` would otherwise be the first to find.
            It raises :class:`~recipes.errors.InvalidValue` with the key from the recipe's top
            (``"data.min_length"``); the loader runs it, so ``--check`` and a run reject the same
            recipes before anything is built.
        metrics: What each metric the task logs means (``{"val_bpb": "validation bits per byte,
            val_loss / ln 2"}``): the summary prints a ``legend:`` line with those it printed.
        name: Filled in by the registry from the module name; leave it empty.
    """

    model: type
    data: type
    build: Callable[[Any, Any, Any], tuple[Any, Any]]
    description: str
    check: Optional[Callable[[Any, Any], None]] = None
    metrics: Mapping[str, str] = field(default_factory=dict)
    name: str = ""


@dataclass(frozen=True)
class Plugin:
    """What ``recipes/plugins/<section>.py`` exports as ``PLUGIN``.

    Attributes:
        config: Dataclass type of the section; its first field is ``enabled: bool = False``.
        make_callback: ``make_callback(cfg) -> lightning.Callback``; called only when
            ``cfg.enabled``, before the model is built (so the callback's own argument checks
            fail before any training).
        order: Callbacks are passed to the Trainer sorted by ``(order, name)``; Lightning runs their
            hooks in that order. Plugins that replace layers or activations use an order < 100 so
            that ``remat`` (order 100) captures the network they produced.
        description: One line for ``python -m recipes.run --list``.
        check: ``check(cfg, recipe) -> None``, or ``None``: the callback's own argument checks
            (and checks against other sections of ``recipe``, the whole loaded recipe), run
            without importing Lightning when a recipe with the section enabled is loaded
            (``--check`` and a run alike), e.g. the settings check the callback's ``__init__``
            calls. It raises :class:`~recipes.errors.InvalidValue` (key relative to the section),
            or ``ValueError``/``TypeError`` whose message starts with ``<field>=<value>: `` as the
            callbacks' do; the loader adds the section and where the value came from.
        name: Filled in by the registry from the module name; leave it empty.
    """

    config: type
    make_callback: Callable[[Any], Any]
    order: int = 50
    description: str = ""
    check: Optional[Callable[[Any, Any], None]] = None
    name: str = ""


def closest(word: str, choices: list[str]) -> str | None:
    """The choice closest to ``word`` (difflib ratio >= 0.6), or ``None``."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: list[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    best = closest(word, choices)
    return f"; did you mean {best!r}?" if best else ""


def _module_names(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _import(package: str, name: str) -> Any:
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in _RECIPES_EXTRA_MODULES:
            raise RecipeError(
                f"{package}.{name} needs the optional dependency {e.name!r}: {_INSTALL_HINT}"
            ) from e
        raise


def available_tasks() -> list[str]:
    """Names of the tasks a recipe may select with ``task: <name>``, sorted."""
    return _module_names(_TASKS_PACKAGE)


def _registered(package: str, folder: str, name: str, names: list[str], kind: str,
                attribute: str, cls: type, unknown: str) -> Any:
    """Import ``recipes/<folder>/<name>.py`` and return its ``attribute``, checked to be a
    ``cls``; an unknown name is a :class:`RecipeError` listing ``names`` (``unknown`` starts it)."""
    if name not in names:
        placeholder = "name" if kind == "task" else "section"
        raise RecipeError(
            f"{unknown}{suggest(str(name), names) or '.'} Available {kind}s: {', '.join(names)}. "
            f"To add one, create recipes/{folder}/<{placeholder}>.py defining "
            f"{attribute} = {cls.__name__}(...) (see recipes/README.md)."
        )
    value = getattr(_import(package, name), attribute, None)
    if not isinstance(value, cls):
        raise TypeError(
            f"recipes/{folder}/{name}.py must define {attribute} = recipes.registry."
            f"{cls.__name__}(...); found {type(value).__name__}"
        )
    return value


def get_task(name: str) -> Task:
    """Return the task registered as ``recipes/tasks/<name>.py``.

    Raises:
        RecipeError: if there is no such task; the message lists the available ones.
    """
    task = _registered(_TASKS_PACKAGE, "tasks", name, available_tasks(), "task", "TASK", Task,
                       f"task={name!r}: unknown task")
    for section in ("model", "data"):
        if not dataclasses.is_dataclass(getattr(task, section)):
            raise TypeError(f"recipes/tasks/{name}.py: TASK.{section} must be a dataclass type")
    return dataclasses.replace(task, name=name)


def available_plugins() -> list[str]:
    """Names of the plugin sections every recipe has (``remat``, ...), sorted."""
    return _module_names(_PLUGINS_PACKAGE)


def get_plugin(name: str) -> Plugin:
    """Return the plugin registered as ``recipes/plugins/<name>.py``.

    Raises:
        RecipeError: if there is no such plugin; the message lists the available ones.
    """
    plugin = _registered(_PLUGINS_PACKAGE, "plugins", name, available_plugins(), "plugin",
                         "PLUGIN", Plugin, f"plugin {name!r}: unknown plugin section")
    fields = dataclasses.fields(plugin.config) if dataclasses.is_dataclass(plugin.config) else ()
    enabled = next((f for f in fields if f.name == "enabled"), None)
    if enabled is None or enabled.default is not False:
        raise TypeError(
            f"recipes/plugins/{name}.py: PLUGIN.config must be a dataclass with a field "
            "`enabled: bool = False` (plugins are off unless a recipe enables them)"
        )
    return dataclasses.replace(plugin, name=name)


def all_plugins() -> dict[str, Plugin]:
    """Every registered plugin, by section name (sorted)."""
    return {name: get_plugin(name) for name in available_plugins()}


def import_callback(section: str, class_name: str) -> type:
    """Import ``class_name`` from :mod:`integrations.lightning` for the plugin ``section``.

    Args:
        section: The recipe section asking for it (``"remat"``), for the message.
        class_name: The callback's public name (``"HiRemateCallback"``).

    Returns:
        The callback class.

    Raises:
        RecipeError: when the callback (or Lightning) cannot be imported, with the reason and the
            way out (install the extra, or disable the section).
    """
    try:
        lightning_api = importlib.import_module("integrations.lightning")
        return getattr(lightning_api, class_name)
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        hint = (
            _INSTALL_HINT
            if root in _RECIPES_EXTRA_MODULES
            else "this hiremate checkout does not provide it yet"
        )
        raise RecipeError(
            f"{section}.enabled=true needs integrations.lightning.{class_name}, which cannot be "
            f"imported ({e}); {hint}, or set {section}.enabled=false"
        ) from e
    except (ImportError, AttributeError) as e:
        raise RecipeError(
            f"{section}.enabled=true needs integrations.lightning.{class_name}, which cannot be "
            f"imported ({e}); set {section}.enabled=false or fix the import"
        ) from e
