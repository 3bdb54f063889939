"""The example call's keyword arguments beside remat's own options (NOTE [ Options that share a
name with the model's ]).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import nn

__all__ = ["OWN_OPTION_WARNING", "example_call_kwargs"]


# NOTE [ Options that share a name with the model's ]
# ``rematerialize(module, *args, budget=..., cache=..., **kwargs)`` takes the example call's
# keyword arguments beside its own options, so a forward with a parameter of the same name
# loses it silently: Hugging Face decoder layers take ``cache=``, which went to the plan cache
# (``cache=None``: no plan cache, and the layer ran with its default; a ``DynamicCache``: a
# TypeError about plan cache directories). Such arguments go in ``example_kwargs={...}``;
# giving one of these options while the module's forward also takes that name warns, saying
# where it went and how to send it to the module instead.
OWN_OPTION_WARNING = r".*sets remat's own option"  # the warning's words, for estimate's own call


def example_call_kwargs(module: nn.Module, owner: str, given: dict[str, Any],
                        defaults: dict[str, Any], example_kwargs: dict[str, Any] | None,
                        call_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The example call's keyword arguments: ``call_kwargs`` and ``example_kwargs`` (a dict, no
    name in both), after warning about options in ``given`` that the module's forward also
    takes (NOTE [ Options that share a name with the model's ])."""
    if example_kwargs is None:
        example_kwargs = {}
    elif not isinstance(example_kwargs, dict):
        raise TypeError(f"{owner}(example_kwargs={example_kwargs!r}): expected a dict of the "
                        "example call's keyword arguments, e.g. example_kwargs={'cache': None}")
    both = sorted(set(example_kwargs) & set(call_kwargs))
    if both:
        raise TypeError(f"{owner}(): {', '.join(map(repr, both))} given both as a keyword "
                        "argument and in example_kwargs; pass it once, in example_kwargs")
    try:
        takes = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: nothing to compare
        takes = {}
    for name, value in given.items():
        param = takes.get(name)
        if param is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) \
                or name in example_kwargs or _same(value, defaults[name]):
            continue
        warnings.warn(
            f"{owner}({name}={value!r}): {name}= sets remat's own option, and "
            f"{type(module).__name__}.forward also takes {name!r}, which the example call does "
            f"not get. To pass it to the module, use example_kwargs={{{name!r}: ...}}",
            stacklevel=3)
    return {**call_kwargs, **example_kwargs}


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value is default or value == default)
    except Exception:  # noqa: BLE001 - a tensor or an odd __eq__: not the default
        return False
