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
        (1, 1.0, None),  # NOTE [ A bare number is a fraction ]: the int 1 is 100%, as 1.0
        ("1", 1.0, None),
        ("1.0", 1.0, None),
        ("0.5", 0.5, None),
        ("6GiB", None, 6 * 2**30),
        ("512MB", None, 512 * 10**6),
        ("1.5KiB", None, 1536),
        ("2e9B", None, 2 * 10**9),
        ("1500000000B", None, 1_500_000_000),
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
        (0, "a budget must be positive"),
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


@pytest.mark.parametrize(
    "value, readings",
    [
        (50, '"50%" (50% of the measured step) or a byte count such as "50MiB" ("50B" is 50 bytes)'),
        ("50", '"50%" (50% of the measured step) or a byte count such as "50MiB" ("50B" is 50 bytes)'),
        (2, '"2%" (2% of the measured step) or a byte count such as "2MiB" ("2B" is 2 bytes)'),
        (50.0, '"50%" (50% of the measured step) or a byte count such as "50MiB"'),
        (1_500_000_000, '"1500000000B" for 1500000000 bytes (1.40 GiB), or a percentage such as "70%"'),
        ("2e9", '"2000000000B" for 2000000000 bytes (1.86 GiB), or a percentage such as "70%"'),
    ],
    ids=lambda v: repr(v),
)
def test_a_bare_number_other_than_a_fraction_needs_a_unit(value, readings):
    """NOTE [ A bare number is a fraction ]: ``2`` used to be 2 bytes while ``1`` was 100%."""
    with pytest.raises(ValueError) as info:
        remat.parse_budget(value)
    message = str(info.value)
    assert message.startswith(f"budget={value!r}: a bare number is a budget only as a fraction "
                              "in (0, 1]; for "), message
    assert readings in message


def test_messages_name_the_setting_as_the_user_spelled_it():
    with pytest.raises(ValueError, match=r"^HIREMATE_BUDGET='50': a bare number"):
        remat.parse_budget("50", name="HIREMATE_BUDGET")
    with pytest.raises(ValueError, match=r"^HIREMATE_BUDGET='150%': a percentage budget"):
        remat.parse_budget("150%", name="HIREMATE_BUDGET")


def test_budgets_built_inside_remat_are_not_parsed():
    # Budget(bytes=...) is how remat states bytes itself (estimate's "no limit", a size bucket's
    # target); only what users write goes through parse_budget.
    budget = remat.Budget(bytes=2**62, text="no limit")
    assert remat.parse_budget(budget) is budget and budget.resolve(10) == 2**62
