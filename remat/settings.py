"""Checks of the settings every front door of remat takes, in one place.

NOTE [ One check per setting ]
A setting reaches remat through several doors: ``remat.rematerialize`` / ``remat.backend`` /
``remat.RematBackend``, ``HiRemateCallback`` and ``HiRematePlugin`` (both through
``integrations._remat_shared.check_settings``), the ``HIREMATE_*`` variables and a recipe's
``remat:`` section. Each door calls the same checker here (the budget's is
:func:`remat.parse_budget`), passing the setting's name as the user spelled it
(``HIREMATE_TIME_LIMIT``, ``remat.time_limit``), so a value is accepted or refused the same way
everywhere and the message names what the user wrote. Before this, ``time_limit=nan`` passed
``RematBackend``'s ``time_limit <= 0`` test (every comparison with NaN is false) and ``inf``
passed everywhere but the callbacks.
"""
from __future__ import annotations

import math
from numbers import Real

__all__ = ["check_time_limit"]


def check_time_limit(value: object, *, name: str = "time_limit", shown: str | None = None) -> float:
    """Check a solver time limit: a finite number of seconds > 0 (NOTE [ One check per setting ]).

    Args:
        value: The time limit as given (an ``int`` or ``float``; a ``bool`` is refused).
        name: The setting as the user spelled it, for messages (``"HIREMATE_TIME_LIMIT"``).
        shown: How the value was written, when it was parsed from text (an environment
            variable's ``'-5'``); default ``repr(value)``.

    Returns:
        The time limit in seconds, as a ``float``.

    Raises:
        TypeError: not a number (``"60"``, ``True``, ``None``).
        ValueError: NaN, infinite, zero or negative.

    Example:
        >>> check_time_limit(60)
        60.0
        >>> check_time_limit(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: time_limit=nan: expected a finite number of seconds > 0; pass e.g. time_limit=60
    """
    shown = repr(value) if shown is None else shown
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}={shown}: expected a number of seconds > 0, got a "
                        f"{type(value).__name__}; pass e.g. {name}=60")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}={shown}: expected a finite number of seconds > 0; pass e.g. "
                         f"{name}=60")
    return seconds
