"""Errors raised while loading, validating and running a recipe."""
from __future__ import annotations

from typing import Any

__all__ = ["RecipeError", "InvalidValue"]


class RecipeError(ValueError):
    """A recipe (YAML file plus ``key=value`` overrides) cannot be used as written.

    The message names the full dotted key (``trainer.max_steps``), the value received, what is
    allowed and where the value came from (the YAML file or the override), so the fix is obvious.
    ``python -m recipes.run`` prints it as ``error: ...`` and exits with status 2, before anything
    is built or trained.
    """


class InvalidValue(ValueError):
    """A config field holds a value of the right type that is still not allowed.

    Raise it from a config dataclass's ``__post_init__`` (task model/data sections, plugin
    sections): the recipe loader catches it, prefixes the section path (``remat.`` + ``budget``)
    and says whether the value came from the YAML or an override.

    Args:
        key: The field name relative to the dataclass (``"budget"``), or a dotted path below it.
        value: The offending value.
        reason: What is wrong and what is allowed, e.g. ``"expected one of adamw, sgd"`` or
            ``"expected a float > 0"``.

    Example:
        >>> raise InvalidValue("lr", -1.0, "expected a float > 0")
        Traceback (most recent call last):
        ...
        recipes.errors.InvalidValue: lr=-1.0: expected a float > 0
    """

    def __init__(self, key: str, value: Any, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}={value!r}: {reason}")
