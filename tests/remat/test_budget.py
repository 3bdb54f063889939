"""remat.parse_budget: every accepted spelling, and clear errors for everything else."""
import pytest

import remat


@pytest.mark.parametrize(
    "value, fraction, nbytes",
    [
        ("70%", 0.7, None),
        ("100%", 1.0, None),
        (" 12.5 % ", 0.125, None),
        (0.7, 0.7, None),
        (1.0, 1.0, None),
        ("0.5", 0.5, None),
        ("6GiB", None, 6 * 2**30),
        ("512MB", None, 512 * 10**6),
        ("1.5KiB", None, 1536),
        ("2e9B", None, 2 * 10**9),
        (1_500_000_000, None, 1_500_000_000),
    ],
    ids=lambda v: repr(v),
)
def test_accepted(value, fraction, nbytes):
    budget = remat.parse_budget(value)
    assert budget.fraction == (pytest.approx(fraction) if fraction is not None else None)
    assert budget.bytes == nbytes
    assert remat.parse_budget(budget) is budget


@pytest.mark.parametrize(
    "value, why",
    [
        ("150%", "percentage budget must be in (0%, 100%]"),
        ("0%", "percentage budget must be in (0%, 100%]"),
        ("-1GB", "at least 1 byte"),
        ("abc", "cannot read"),
        ("5XB", "unknown unit 'XB'"),
        (0, "must be positive"),
        (-3, "must be positive"),
        (True, "a bool is not a budget"),
        (1.5, "fraction budget must be in (0, 1]"),
        (float("nan"), "fraction budget must be in (0, 1]"),
        (None, "NoneType is not a budget"),
    ],
    ids=lambda v: repr(v),
)
def test_rejected_names_value_and_forms(value, why):
    with pytest.raises(ValueError) as info:
        remat.parse_budget(value)
    message = str(info.value)
    assert f"budget={value!r}" in message
    assert why in message
    assert '"70%"' in message and '"6GiB"' in message  # the accepted forms are listed


def test_resolve():
    assert remat.parse_budget("50%").resolve(1000) == 500
    assert remat.parse_budget("1KiB").resolve(10**9) == 1024
