"""Plugin section ``accelerate:``: train the recipe with an Accelerate loop instead of Lightning's.

Example (YAML)::

    accelerate:
      enabled: true      # train with HiRemateAccelerator (recipes/accelerate_run.py)
    remat:
      enabled: true      # its budget/solver/... become the HiRematePlugin; with
      budget: 50%        # enabled: false, the HIREMATE_* launcher variables are used instead

Run it with ``python -m recipes.accelerate_run recipes/gpt_accelerate.yaml`` or, for several
processes, ``accelerate launch -m recipes.accelerate_run recipes/gpt_accelerate.yaml`` (see
``recipes/accelerate_run.py``). This section is not a Lightning callback: ``make_callback`` only
says how to run such a recipe when it reaches the Lightning runner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recipes.errors import InvalidValue, RecipeError
from recipes.registry import Plugin


@dataclass
class AccelerateConfig:
    """The ``accelerate:`` section.

    Attributes:
        enabled: Train with ``integrations.accelerate.HiRemateAccelerator`` in a plain loop
            (``recipes.accelerate_run``) rather than with the Lightning ``Trainer``. Processes,
            devices and mixed precision then come from ``accelerate launch`` and ``trainer:``
            (``accelerator``, ``precision``); the ``remat:`` section (or the ``HIREMATE_*``
            variables) sets the rematerialization.
        split_batches: Accelerate's ``split_batches``: ``data.batch_size`` is the global batch,
            split between the processes (default: per process).
    """

    enabled: bool = False
    split_batches: bool = False


def make_callback(cfg: AccelerateConfig) -> Any:
    """Reached only when the Lightning runner gets a recipe with ``accelerate.enabled=true``."""
    raise RecipeError(
        "accelerate.enabled=true: this recipe trains with Accelerate, not with the Lightning "
        "Trainer; run it with python -m recipes.accelerate_run <recipe.yaml> [key=value ...] "
        "(or accelerate launch -m recipes.accelerate_run ...), or set accelerate.enabled=false"
    )


# Sections the Accelerate loop applies; every other enabled plugin is a Lightning callback.
_APPLIED = ("accelerate", "remat")


def check(cfg: AccelerateConfig, recipe: Any) -> None:
    """The Accelerate loop runs no Lightning callback: a plugin section enabled beside it would
    be silently ignored, so the recipe is refused when it loads."""
    from recipes.registry import available_plugins

    ignored = [name for name in available_plugins() if name not in _APPLIED
               and getattr(getattr(recipe, name, None), "enabled", False)]
    if ignored:
        raise InvalidValue(
            "enabled", cfg.enabled,
            f"the plain Accelerate loop applies only the remat: section, so "
            f"{', '.join(f'{n}.enabled=true' for n in ignored)} would be ignored; disable "
            f"{'it' if len(ignored) == 1 else 'them'}, or train with Lightning "
            "(accelerate.enabled=false)")


PLUGIN = Plugin(
    config=AccelerateConfig,
    make_callback=make_callback,
    check=check,
    order=1000,
    description="train with an Accelerate loop and HiRemateAccelerator (recipes.accelerate_run)",
)
