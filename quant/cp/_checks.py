"""Argument validation shared by the ``quant.cp`` entry points, and the internal-assert helper."""
from __future__ import annotations

import math

MIN_BITS = 2
MAX_BITS = 8


class InternalError(AssertionError):
    """An invariant of ``quant.cp`` was broken: a bug in hiremate, please report it."""


def internal_assert(condition: bool, message: str) -> None:
    """Raise :class:`InternalError` (a bug in this project, not in the caller's input)."""
    if not condition:
        raise InternalError(f"bug in hiremate quant.cp: {message}; please report it")


def check_bits(bits: object, *, name: str = "bits") -> int:
    """Validate a bit width: an int in ``[MIN_BITS, MAX_BITS]``."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(
            f"{name}={bits!r}: expected an int number of bits in [{MIN_BITS}, {MAX_BITS}]; "
            f"pass e.g. {name}=8 or {name}=4"
        )
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(
            f"{name}={bits}: the quantization grid supports {MIN_BITS} to {MAX_BITS} bits "
            f"(codes are stored as int8); pass e.g. {name}=8 or {name}=4"
        )
    return bits


def check_rank(rank: object, *, name: str = "rank") -> int:
    """Validate a CP rank: a positive int."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{name}={rank!r}: expected a positive int CP rank; pass e.g. {name}=16")
    if rank <= 0:
        raise ValueError(
            f"{name}={rank}: the CP rank must be a positive int; pass e.g. {name}=16, or "
            f"{name}=None with a compression rate"
        )
    return rank


def check_positive_int(value: object, *, name: str, allow_zero: bool = False) -> int:
    """Validate an iteration count or similar."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r}: expected an int >= {low}; pass e.g. {name}=50")
    return value


def check_positive_float(value: object, *, name: str) -> float:
    """Validate a finite positive float (tolerances, rates)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a finite number > 0; pass e.g. {name}=1e-4")
    return float(value)
