"""Shipped tables are reproducible by fit_stepwise; other parameters get their own tables."""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from quant.fewbit import ACTIVATIONS, FewBitCELU, FewBitELU, FewBitSoftplus, fit_stepwise, get_table
from quant.fewbit.tables import FIT_SETTINGS, shipped_tables

#: A refit on another machine may differ in the last bits of exp/erf; borders are grid points and
#: must match exactly (or mirror, below), levels and objective to far below their fitting error.
REFIT_ATOL = 1e-9
#: Module levels are float32 buffers: relative rounding 6e-8.
LEVEL_RTOL = 1e-6
#: Inputs within 2**-12 relative of a border may be coded in the neighbouring interval; for
#: N(0, 1) inputs that is ~1e-4 of them per border.
BORDER_MISMATCH_FRACTION = 2e-3


def _by_activation():
    groups = collections.defaultdict(list)
    for key in shipped_tables():
        groups[key[:2]].append(key)
    return sorted(groups.items())


def _id(item):
    (name, params), _ = item
    return name + "".join(f"-{k}={v}" for k, v in params)


def _fn(name, params):
    spec = ACTIVATIONS[name]
    kwargs = dict(params)
    return lambda x: spec.call(x, kwargs, False)


def test_every_fitted_activation_ships_bits_1_to_4():
    keys = set(shipped_tables())
    for spec in ACTIVATIONS.values():
        for params in spec.shipped:
            assert {(spec.name, params, b) for b in (1, 2, 3, 4)} <= keys, spec.name
    fitted = {s.name for s in ACTIVATIONS.values() if s.exact is None}
    assert {k[0] for k in keys} == fitted
    assert len(keys) == 4 * 14  # 13 functions, GELU in two forms


@pytest.mark.parametrize("group", _by_activation(), ids=_id)
def test_shipped_tables_are_what_fit_stepwise_produces(group):
    (name, params), keys = group
    fn = _fn(name, params)
    for key in keys:
        bits = key[2]
        shipped = get_table(name, bits, **dict(params))
        refit = fit_stepwise(fn, bits, **FIT_SETTINGS)
        assert shipped.objective == pytest.approx(refit.objective, abs=REFIT_ATOL), key
        if shipped.borders == refit.borders:
            assert shipped.levels == pytest.approx(refit.levels, abs=REFIT_ATOL), key
        else:
            # An even derivative (tanh, sigmoid, ...) has two mirror-image optimal tables with the
            # same objective; a refit may pick the other one.
            mirrored = tuple(-b for b in reversed(refit.borders))
            assert shipped.borders == pytest.approx(mirrored, abs=1e-12), key
            assert shipped.levels == pytest.approx(tuple(reversed(refit.levels)), abs=REFIT_ATOL)


@pytest.mark.parametrize("group", _by_activation(), ids=_id)
def test_shipped_tables_beat_equal_width_split(group):
    (name, params), keys = group
    fn = _fn(name, params)
    for key in keys:
        bits = key[2]
        shipped = get_table(name, bits, **dict(params))
        naive = fit_stepwise(fn, bits, **{**FIT_SETTINGS, "method": "equal_width"})
        assert shipped.objective <= naive.objective * (1 + 1e-12), key
        if bits >= 2:
            assert shipped.objective < naive.objective, key


@pytest.mark.parametrize(
    "name, params, fn",
    [
        ("elu", {"alpha": 0.5}, lambda x: F.elu(x, 0.5)),
        ("celu", {"alpha": 2.0}, lambda x: F.celu(x, 2.0)),
        ("softplus", {"beta": 2.0, "threshold": 10.0}, lambda x: F.softplus(x, 2.0, 10.0)),
        ("gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    ],
    ids=["elu-alpha0.5", "celu-alpha2", "softplus-beta2", "gelu-tanh"],
)
def test_non_default_parameters_get_their_own_table(name, params, fn):
    table = get_table(name, 2, **params)
    assert table.levels != get_table(name, 2).levels
    refit = fit_stepwise(fn, 2, **FIT_SETTINGS)
    assert table.borders == refit.borders
    assert table.levels == pytest.approx(refit.levels, abs=REFIT_ATOL)


def test_on_demand_tables_are_cached():
    assert get_table("elu", 3, alpha=0.25) is get_table("elu", 3, alpha=0.25)


def test_integer_and_float_parameters_share_the_shipped_table():
    assert get_table("elu", 2, alpha=1) == get_table("elu", 2, alpha=1.0) == get_table("elu", 2)


@pytest.mark.parametrize(
    "module, name, params",
    [
        (FewBitELU(alpha=0.5, bits=2), "elu", {"alpha": 0.5}),
        (FewBitCELU(alpha=3.0, bits=3), "celu", {"alpha": 3.0}),
        (FewBitSoftplus(beta=4.0, threshold=5.0, bits=2), "softplus",
         {"beta": 4.0, "threshold": 5.0}),
    ],
    ids=["elu", "celu", "softplus"],
)
def test_modules_backward_with_their_parameters_table(module, name, params):
    x = torch.randn(10_000, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    module(x).backward(g)
    table = get_table(name, module.bits, **params)
    expected = g * table.derivative(x.detach())
    # levels are buffers in the default dtype (float32); inputs within float16 rounding of a
    # border may fall in the neighbouring interval (NOTE [ Encoding through a float16 lookup table ])
    close = torch.isclose(x.grad, expected, rtol=LEVEL_RTOL, atol=0.0)
    assert (~close).double().mean().item() < BORDER_MISMATCH_FRACTION


@pytest.mark.parametrize(
    "args, match",
    [
        (("swish", 2), "activation='swish'"),
        (("relu", 2), "exactly in 1 bit"),
        (("elu", 2, {"beta": 1.0}), "unknown parameter"),
        (("gelu", 7), "bits=7"),
        (("gelu", 2, {"approximate": "fast"}), "cannot fit"),
    ],
    ids=["unknown", "exact", "bad-param", "bits", "bad-approximate"],
)
def test_get_table_errors(args, match):
    kwargs = args[2] if len(args) == 3 else {}
    with pytest.raises(ValueError, match=match):
        get_table(args[0], args[1], **kwargs)
