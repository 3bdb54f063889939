"""Memory budgets: what a user may write, and what it means in bytes.

A budget is either a *fraction* of the memory the user's training step peaks at today
(``"70%"``, ``0.7``) or an absolute number of *bytes* for that peak, always with its unit
(``"6GiB"``, ``"512MB"``, ``"1500000000B"``). :func:`parse_budget` turns any accepted spelling
into a frozen :class:`Budget`; :meth:`Budget.resolve` turns it into the bytes a schedule may use
once the baseline (and the :class:`Reference`, what the user measures) is known.

NOTE [ A bare number is a fraction ]
A number without a unit is a budget only as a fraction in (0, 1]: ``0.7``, ``"0.7"``, ``1.0``,
and ``1`` / ``"1"`` (the whole step, 100%). Every other bare number is refused with both of its
readings (``50``: ``"50%"`` or ``"50MiB"``?). Bare integers used to be bytes, so ``1`` meant
100% while ``2`` meant 2 bytes and ``remat.budget=50`` in a recipe passed ``--check`` as a
50-byte budget that no model can meet; the unit makes the intent visible where it is written.
Budgets built inside remat (``Budget(bytes=...)``) are not parsed and are unaffected.

NOTE [ A budget is what the user measures ]
What a user sees is the peak of their eager training step: forward, loss and backward, measured
by the allocator. The peak of our captured, unmodified step can differ from it (AOTAutograd
materializes zero gradients for outputs nobody differentiates, the capture saves what eager
keeps, a model that already checkpoints is captured without its recomputation), and memory
outside the rematerialized module (a loss head, the other half of the step) is in no plan.
So the example batch's eager step is measured: ``eager_bytes`` for the module's own step,
``outside_bytes`` for what the rest of the step adds to it. A percentage is a percentage of
``eager + outside`` (the whole step), a byte count bytes of that same quantity, and the bytes a
schedule of the module may use are what is left after the outside memory. At other batch sizes
both scale with the compiled baseline (``compiled_bytes`` is its value at the example).
Without a reference (``torch.compile(backend=remat.backend(...))``, graphs dynamo cut) a
fraction applies to the captured graph's own unmodified peak.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Integral, Real

__all__ = ["Budget", "NO_LIMIT", "Reference", "parse_budget", "format_bytes"]

# Decimal and binary units, case-insensitive; "B" alone means bytes.
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_NUMBER_UNIT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+))\s*%\s*$")

_ACCEPTED = (
    'a percentage in (0%, 100%] such as "70%", a fraction in (0, 1] such as 0.7, or a byte count '
    'with its unit such as "6GiB", "512MB" or "1500000B"'
)


@dataclass(frozen=True)
class Budget:
    """An activation-memory budget.

    Exactly one of ``fraction`` and ``bytes`` is set.

    Attributes:
        fraction: Share of the measured eager step's peak, in (0, 1] (NOTE [ A budget is what
            the user measures ]).
        bytes: That peak in bytes (> 0).
        text: The value as the user wrote it, for messages.
    """

    fraction: float | None = None
    bytes: int | None = None
    text: str = ""

    def resolve(self, baseline_bytes: int, reference: "Reference | None" = None, *,
                of_bytes: int | None = None) -> int:
        """The bytes a schedule may peak at, given the unmodified step's simulated peak.

        Without a reference a fraction is a share of ``of_bytes`` (default ``baseline_bytes``);
        with one, of the whole eager step's peak where the unmodified step peaks at
        ``of_bytes`` (the run's largest batch: NOTE [ Budgets over many sizes ]), less the
        memory outside the module at *these* sizes, ``baseline_bytes`` (NOTE [ A budget is
        what the user measures ]). May be <= 0 when the outside memory alone is over the
        budget.
        """
        of_bytes = baseline_bytes if of_bytes is None else of_bytes
        if reference is None:
            if self.bytes is not None:
                return self.bytes
            return int(math.floor(self.fraction * of_bytes))
        outside = reference.at(baseline_bytes)[1]
        if self.bytes is not None:
            return int(self.bytes - outside)
        return int(math.floor(self.fraction * reference.at(of_bytes)[0] - outside))

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{100 * self.fraction:g}%"


@dataclass(frozen=True)
class Reference:
    """What the user measures, at the example batch (NOTE [ A budget is what the user measures ]).

    Attributes:
        eager_bytes: Measured peak of the module's eager step (forward + backward).
        outside_bytes: Measured memory the rest of the training step adds to it (a loss head
            outside the module); ``0`` when the module is the whole step.
        compiled_bytes: Simulated peak of the captured, unmodified step at the same sizes.
    """

    eager_bytes: int
    outside_bytes: int
    compiled_bytes: int

    @property
    def step_bytes(self) -> int:
        """Peak of the whole eager training step at the example batch."""
        return self.eager_bytes + self.outside_bytes

    def at(self, baseline_bytes: int) -> tuple[float, float]:
        """``(whole step, outside)`` in bytes for a graph whose unmodified peak is
        ``baseline_bytes``: both scale with it from the example batch, except a credit.

        NOTE [ A credit never grows ]
        What the rest of the step adds (a loss head) is charged in proportion at larger batches.
        What it takes away (outputs the step drops, which the module's own step held) is a
        credit the module's schedule may spend, and one extrapolated to larger batches is a
        promise nobody measured: from a 2 x 32 example that ran eagerly, a credit scaled to
        8 x 256 batches was 10-20% of the step too large, and Lightning steps that dropped a
        module output measured up to 1.12x a "10MiB" budget. A credit shrinks with smaller
        batches and never grows beyond what was measured.
        """
        scale = baseline_bytes / max(self.compiled_bytes, 1)
        outside = self.outside_bytes * scale
        if self.outside_bytes < 0:
            outside = max(outside, self.outside_bytes)
        return self.eager_bytes * scale + outside, outside


def _reject(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {why}; pass {_ACCEPTED}")


# A budget nothing exceeds: the unmodified step is captured and measured (remat.estimate, the
# FSDP2 probes), with ``solver="none"`` nothing is solved.
NO_LIMIT = Budget(bytes=2**62, text="no limit")


def parse_budget(value: str | float | int | Budget, *, name: str = "budget") -> Budget:
    """Parse a memory budget.

    A number without a unit is a fraction, and only in (0, 1]; bytes always carry their unit
    (NOTE [ A bare number is a fraction ]).

    Args:
        value: ``"70%"`` / ``0.7`` / ``"0.7"`` (fraction of the eager training step's measured
            peak; ``1`` and ``"1"`` are 100%), or ``"6GiB"`` / ``"512MB"`` / ``"1.5e9B"``
            (bytes; SI and binary units). A :class:`Budget` is returned unchanged.
        name: The setting as the user spelled it, for messages (``"HIREMATE_BUDGET"``).

    Returns:
        A frozen :class:`Budget`.

    Raises:
        ValueError: for anything else (``"150%"``, ``"-1GB"``, ``"abc"``, ``0``, ``True``, NaN,
            and bare numbers other than fractions: ``50``, ``"50"``, ``1_500_000_000``), naming
            the value and the accepted forms.

    Example:
        >>> parse_budget("70%").fraction
        0.7
        >>> parse_budget("512MB").bytes
        512000000
        >>> parse_budget(50)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: budget=50: a bare number is a budget only as a fraction in (0, 1]; ...
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):  # bool is an Integral: refuse it explicitly
        raise _reject(name, value, "a bool is not a budget")
    if isinstance(value, Real):
        return _number(value, value, name)
    if not isinstance(value, str):
        raise _reject(name, value, f"a {type(value).__name__} is not a budget")
    match = _PERCENT.match(value)
    if match:
        return _fraction(float(match.group(1)) / 100.0, value, name, percent=True)
    match = _NUMBER_UNIT.match(value)
    if not match:
        raise _reject(name, value, "cannot read this as a percentage, a fraction or a byte count")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        return _number(number, value, name)  # "0.7" and "1" as unquoted; "50" is refused
    if unit not in _UNITS:
        raise _reject(name, value, f"unknown unit {match.group(2)!r} (known: B, KB, MB, GB, TB, "
                                   "KiB, MiB, GiB, TiB)")
    nbytes = number * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes < 1:
        raise _reject(name, value, "a byte budget must be at least 1 byte")
    return Budget(bytes=int(nbytes), text=value)


def _number(number: Real, original: object, name: str) -> Budget:
    """A number without a unit: a fraction in (0, 1] (NOTE [ A bare number is a fraction ])."""
    x = float(number)
    if math.isfinite(x) and x > 1 and x.is_integer():
        n = int(x)
        readings = (f'"{n}%" ({n}% of the measured step) or a byte count such as "{n}MiB" '
                    f'("{n}B" is {n} bytes)' if n <= 100 else
                    f'"{n}B" for {n} bytes ({format_bytes(n)}), or a percentage such as "70%"')
        raise ValueError(f"{name}={original!r}: a bare number is a budget only as a fraction in "
                         f"(0, 1]; for {n} write its unit: {readings}")
    if isinstance(number, Integral) and x <= 0:
        raise _reject(name, original, "a budget must be positive")
    return _fraction(x, original, name)


def _fraction(fraction: float, original: object, name: str, percent: bool = False) -> Budget:
    if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
        if percent:
            raise _reject(name, original, "a percentage budget must be in (0%, 100%]")
        raise _reject(name, original, "a fraction budget must be in (0, 1]")
    return Budget(fraction=fraction, text=str(original))


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
