"""Argument checks and the internal-assert helper shared by the few-bit modules."""
from __future__ import annotations

#: Bit widths the few-bit codes support. 1, 2 and 4 bits pack whole codes into a byte; 3 bits packs
#: eight codes into three bytes (see :mod:`quant.fewbit.packing`).
SUPPORTED_BITS = (1, 2, 3, 4)


def check_bits(bits: object, *, name: str = "bits") -> int:
    """Return ``bits`` as an int after checking it is one of :data:`SUPPORTED_BITS`.

    Raises:
        TypeError: ``bits`` is not an integer (``bool`` is rejected too).
        ValueError: ``bits`` is an integer outside 1–4.
    """
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(
            f"{name}={bits!r}: expected an int in {list(SUPPORTED_BITS)}; pass e.g. {name}=2"
        )
    if bits not in SUPPORTED_BITS:
        raise ValueError(
            f"{name}={bits}: few-bit codes support {list(SUPPORTED_BITS)} bits per element; "
            f"pass e.g. {name}=2 (4 intervals, 0.25 bytes per element)"
        )
    return bits


def internal_assert(condition: bool, message: str) -> None:
    """Check one of our own invariants; a failure is a bug in hiremate, not a user error."""
    if not condition:
        raise AssertionError(
            f"internal error in quant.fewbit (a bug in hiremate, please report it): {message}"
        )
