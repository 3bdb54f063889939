"""Registry of the pointwise nonlinearities few-bit backward supports.

Each :class:`ActivationSpec` says how to call the torch function exactly as the torch module does
(so the forward output is bit-identical), which constructor arguments change the function, and how
its derivative is coded:

* ``exact`` rules: derivatives that take two values (ReLU, LeakyReLU, ReLU6, Hardtanh, Hardsigmoid,
  Threshold, Softshrink, Hardshrink). One bit per element reproduces torch's gradient exactly, using
  the same comparison as torch's backward kernel (so ties and NaN behave like torch).
* fitted tables: every other function gets a :class:`~quant.fewbit.fit.StepwiseTable` with
  ``2**bits`` levels (see :mod:`quant.fewbit.tables`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "ActivationSpec", "ExactRule", "UNSUPPORTED_ACTIVATIONS", "spec_for_module"]

Params = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class ExactRule:
    """An exact 1-bit derivative: ``f'(x) = levels[predicate(x)]``.

    Attributes:
        predicate: Key of :data:`quant.fewbit.packing.PREDICATES` (``"le"``, ``"gt"``, ...).
        lo: First threshold of the predicate.
        hi: Second threshold (two-sided predicates only).
        levels: Derivative where the predicate is false, then where it is true.
    """

    predicate: str
    lo: float
    hi: float
    levels: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """How one torch activation is called and how its derivative is coded.

    Attributes:
        name: Registry key (``"gelu"``).
        module: The torch module class it replaces (``nn.GELU``).
        params: Constructor arguments that change the function, in the torch signature's order
            (``inplace`` excluded).
        inplace: Whether the torch module takes ``inplace``.
        call: ``call(x, params, inplace)``: the exact expression the torch module's forward runs.
        exact: For two-valued derivatives, ``exact(params)`` gives the :class:`ExactRule`.
        shipped: Parameter sets whose tables ship precomputed (fitted ones only).
        torch_saves: What the torch version keeps for backward, for documentation and tests
            (``"input"``, ``"output"``, ``"buffer"`` for a full-size intermediate, or
            ``"input+buffer"`` for two full-size tensors), checked by the tests.
    """

    name: str
    module: type[nn.Module]
    params: tuple[str, ...]
    inplace: bool
    call: Callable[[torch.Tensor, Mapping[str, Any], bool], torch.Tensor]
    exact: Optional[Callable[[Mapping[str, Any]], ExactRule]] = None
    shipped: tuple[Params, ...] = ((),)
    torch_saves: str = "input"

    def params_of(self, module: nn.Module) -> Params:
        """The parameter values of a torch module of this kind, as a hashable tuple."""
        return tuple((name, getattr(module, name)) for name in self.params)


_ONE_SIXTH_F32 = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))


def _rule(predicate: str, lo: float, hi: float, levels: tuple[float, float]):
    return lambda p: ExactRule(predicate, lo, hi, levels)


_SPECS = [
    # ---- fitted tables -------------------------------------------------------------------------
    ActivationSpec(
        "gelu", nn.GELU, ("approximate",), False,
        lambda x, p, inplace: F.gelu(x, approximate=p["approximate"]),
        shipped=((("approximate", "none"),), (("approximate", "tanh"),)),
    ),
    ActivationSpec("silu", nn.SiLU, (), True, lambda x, p, inplace: F.silu(x, inplace=inplace)),
    ActivationSpec("mish", nn.Mish, (), True, lambda x, p, inplace: F.mish(x, inplace=inplace)),
    ActivationSpec(
        "tanh", nn.Tanh, (), False, lambda x, p, inplace: torch.tanh(x), torch_saves="output"
    ),
    ActivationSpec(
        "sigmoid", nn.Sigmoid, (), False, lambda x, p, inplace: torch.sigmoid(x),
        torch_saves="output",
    ),
    ActivationSpec(
        "elu", nn.ELU, ("alpha",), True, lambda x, p, inplace: F.elu(x, p["alpha"], inplace),
        shipped=((("alpha", 1.0),),),
    ),
    ActivationSpec(
        "celu", nn.CELU, ("alpha",), True, lambda x, p, inplace: F.celu(x, p["alpha"], inplace),
        shipped=((("alpha", 1.0),),),
    ),
    ActivationSpec("selu", nn.SELU, (), True, lambda x, p, inplace: F.selu(x, inplace)),
    ActivationSpec(
        "softplus", nn.Softplus, ("beta", "threshold"), False,
        lambda x, p, inplace: F.softplus(x, p["beta"], p["threshold"]),
        shipped=((("beta", 1.0), ("threshold", 20.0)),),
        torch_saves="input",
    ),
    ActivationSpec(
        "softsign", nn.Softsign, (), False, lambda x, p, inplace: F.softsign(x),
        torch_saves="input+buffer",
    ),
    ActivationSpec(
        "logsigmoid", nn.LogSigmoid, (), False, lambda x, p, inplace: F.logsigmoid(x),
        torch_saves="input+buffer",
    ),
    ActivationSpec(
        "hardswish", nn.Hardswish, (), True, lambda x, p, inplace: F.hardswish(x, inplace)
    ),
    ActivationSpec(
        "tanhshrink", nn.Tanhshrink, (), False, lambda x, p, inplace: F.tanhshrink(x),
        torch_saves="buffer",
    ),
    # ---- exact 1-bit derivatives (same comparisons as torch's backward kernels) -----------------
    ActivationSpec(
        "relu", nn.ReLU, (), True, lambda x, p, inplace: F.relu(x, inplace=inplace),
        exact=_rule("le", 0.0, 0.0, (1.0, 0.0)), shipped=(), torch_saves="output",
    ),
    ActivationSpec(
        "leaky_relu", nn.LeakyReLU, ("negative_slope",), True,
        lambda x, p, inplace: F.leaky_relu(x, p["negative_slope"], inplace),
        exact=lambda p: ExactRule("gt", 0.0, 0.0, (float(p["negative_slope"]), 1.0)), shipped=(),
    ),
    ActivationSpec(
        "relu6", nn.ReLU6, (), True, lambda x, p, inplace: F.hardtanh(x, 0.0, 6.0, inplace),
        exact=_rule("outside", 0.0, 6.0, (1.0, 0.0)), shipped=(),
    ),
    ActivationSpec(
        "hardtanh", nn.Hardtanh, ("min_val", "max_val"), True,
        lambda x, p, inplace: F.hardtanh(x, p["min_val"], p["max_val"], inplace),
        exact=lambda p: ExactRule(
            "outside", float(p["min_val"]), float(p["max_val"]), (1.0, 0.0)
        ),
        shipped=(),
    ),
    ActivationSpec(
        "hardsigmoid", nn.Hardsigmoid, (), True,
        lambda x, p, inplace: F.hardsigmoid(x, inplace),
        # torch's kernel multiplies by the float32 constant 1.0f / 6.0f, also for float64
        exact=_rule("inside_open", -3.0, 3.0, (0.0, _ONE_SIXTH_F32)), shipped=(),
    ),
    ActivationSpec(
        "threshold", nn.Threshold, ("threshold", "value"), True,
        lambda x, p, inplace: F.threshold(x, p["threshold"], p["value"], inplace),
        exact=lambda p: ExactRule("le", float(p["threshold"]), 0.0, (1.0, 0.0)), shipped=(),
    ),
    ActivationSpec(
        "softshrink", nn.Softshrink, ("lambd",), False,
        lambda x, p, inplace: F.softshrink(x, p["lambd"]),
        exact=lambda p: ExactRule(
            "inside_closed", -float(p["lambd"]), float(p["lambd"]), (1.0, 0.0)
        ),
        shipped=(),
    ),
    ActivationSpec(
        "hardshrink", nn.Hardshrink, ("lambd",), False,
        lambda x, p, inplace: F.hardshrink(x, p["lambd"]),
        exact=lambda p: ExactRule(
            "inside_closed", -float(p["lambd"]), float(p["lambd"]), (1.0, 0.0)
        ),
        shipped=(),
    ),
]

#: Supported activations by name.
ACTIVATIONS: Mapping[str, ActivationSpec] = {spec.name: spec for spec in _SPECS}

_BY_MODULE = {spec.module: spec for spec in _SPECS}

#: Activation modules that look replaceable but are not, with the reason reported to the user.
UNSUPPORTED_ACTIVATIONS: Mapping[type[nn.Module], str] = {
    nn.PReLU: "its learnable slope's gradient needs the full input",
    nn.RReLU: "its slope is random in training",
    nn.GLU: "it is not pointwise (one half of the input gates the other)",
    nn.Softmax: "it is not pointwise",
    nn.Softmin: "it is not pointwise",
    nn.LogSoftmax: "it is not pointwise",
    nn.Softmax2d: "it is not pointwise",
}


def spec_for_module(module: nn.Module) -> Optional[ActivationSpec]:
    """The spec whose torch module class is exactly ``type(module)``, else ``None``.

    Subclasses are not matched: their forward may differ from the torch function.
    """
    return _BY_MODULE.get(type(module))
