"""Drop-in few-bit activation modules, one per supported torch activation.

Each ``FewBit<Name>`` subclasses the torch module ``nn.<Name>`` (so ``isinstance`` checks and
``extra_repr`` keep working), takes the same constructor arguments plus keyword-only ``bits``, and
has the same ``state_dict`` (its tables are non-persistent buffers, so checkpoints load either way).

In training mode with a gradient required, forward runs :class:`~quant.fewbit.function.FewBitFunction`
(Novikov et al., ICML 2022): the output is bit-identical to the torch module, and only ``bits``
bits per input element are kept for backward. In eval mode or without a gradient it *is* the torch
module's forward: no codes, no extra cost, exact gradients.

Two-valued derivatives (ReLU, LeakyReLU, ReLU6, Hardtanh, Hardsigmoid, Threshold, Softshrink,
Hardshrink) are coded exactly in 1 bit and their gradients equal torch's bit for bit.

# NOTE [ When few-bit saves memory ]
The saving is the activation's own saved tensor: GELU, SiLU, ELU, Softplus, LeakyReLU, Hardtanh ...
save their *input*, which nothing else keeps when a Linear/conv produced it, so 4 bytes per element
become ``bits/8``. Torch's ReLU, Tanh and Sigmoid save their *output*; when the next layer saves that
output anyway (a Linear does), the exact version costs nothing extra and the few-bit one adds its
codes. Measure with :class:`~quant.fewbit.memory.SavedTensorsMeter`.

Example:
    >>> import torch
    >>> act = FewBitGELU(bits=2)
    >>> x = torch.randn(8, requires_grad=True)
    >>> torch.equal(act(x), torch.nn.functional.gelu(x))
    True
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
from torch import nn

from quant.fewbit.activations import ACTIVATIONS, spec_for_module
from quant.fewbit.function import FewBitPlan, fewbit_activation, make_plan, plan_tensors
from quant.fewbit.tables import normalize_params

__all__ = [
    "FEWBIT_MODULES",
    "FewBitCELU",
    "FewBitELU",
    "FewBitGELU",
    "FewBitHardshrink",
    "FewBitHardsigmoid",
    "FewBitHardswish",
    "FewBitHardtanh",
    "FewBitLeakyReLU",
    "FewBitLogSigmoid",
    "FewBitMish",
    "FewBitReLU",
    "FewBitReLU6",
    "FewBitSELU",
    "FewBitSiLU",
    "FewBitSigmoid",
    "FewBitSoftplus",
    "FewBitSoftshrink",
    "FewBitSoftsign",
    "FewBitTanh",
    "FewBitTanhshrink",
    "FewBitThreshold",
    "convert_activation",
]


class _FewBitActivation(nn.Module):
    """Shared machinery; concrete classes set ``_activation`` and call ``_init_fewbit``."""

    _activation: ClassVar[str]
    _fewbit_plan: FewBitPlan

    def _init_fewbit(self, bits: int) -> None:
        spec = ACTIVATIONS[self._activation]
        raw = spec.params_of(self)
        params = normalize_params(self._activation, dict(raw))
        inplace = bool(getattr(self, "inplace", False))
        self._fewbit_state = (raw, inplace)
        self._fewbit_plan = make_plan(
            self._activation, params, inplace=inplace, bits=bits, label=type(self).__name__
        )
        table, levels = plan_tensors(self._fewbit_plan)
        self.register_buffer("fewbit_table", table, persistent=False)
        self.register_buffer("fewbit_levels", levels, persistent=False)

    @property
    def bits(self) -> int:
        """Bits per element kept for backward."""
        return self._fewbit_plan.bits

    def _check_unchanged(self) -> None:
        spec = ACTIVATIONS[self._activation]
        now = (spec.params_of(self), bool(getattr(self, "inplace", False)))
        if now != self._fewbit_state:
            raise RuntimeError(
                f"{type(self).__name__}: parameters changed from {self._fewbit_state} to {now} "
                f"after construction, but the derivative table was built for the old ones; "
                f"construct a new {type(self).__name__}(...) instead of editing attributes"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        if not (self.training and torch.is_grad_enabled() and input.requires_grad):
            return super().forward(input)  # the torch module itself
        self._check_unchanged()
        levels = self.fewbit_levels
        if levels is not None and levels.device != input.device:
            raise RuntimeError(
                f"{type(self).__name__}: input is on {input.device} but the derivative tables are "
                f"on {levels.device}; move the model after replacing its activations "
                f"(model.to({str(input.device)!r}))"
            )
        return fewbit_activation(input, self._fewbit_plan, self.fewbit_table, levels)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return f"{base}, bits={self.bits}" if base else f"bits={self.bits}"


# ---- fitted tables ---------------------------------------------------------------------------------


class FewBitGELU(_FewBitActivation, nn.GELU):
    """``nn.GELU`` with a ``bits``-bit backward (``approximate`` "none" or "tanh")."""

    _activation = "gelu"

    def __init__(self, approximate: str = "none", *, bits: int = 2) -> None:
        nn.GELU.__init__(self, approximate)
        self._init_fewbit(bits)


class FewBitSiLU(_FewBitActivation, nn.SiLU):
    """``nn.SiLU`` (Swish) with a ``bits``-bit backward."""

    _activation = "silu"

    def __init__(self, inplace: bool = False, *, bits: int = 2) -> None:
        nn.SiLU.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitMish(_FewBitActivation, nn.Mish):
    """``nn.Mish`` with a ``bits``-bit backward."""

    _activation = "mish"

    def __init__(self, inplace: bool = False, *, bits: int = 2) -> None:
        nn.Mish.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitTanh(_FewBitActivation, nn.Tanh):
    """``nn.Tanh`` with a ``bits``-bit backward."""

    _activation = "tanh"

    def __init__(self, *, bits: int = 2) -> None:
        nn.Tanh.__init__(self)
        self._init_fewbit(bits)


class FewBitSigmoid(_FewBitActivation, nn.Sigmoid):
    """``nn.Sigmoid`` with a ``bits``-bit backward."""

    _activation = "sigmoid"

    def __init__(self, *, bits: int = 2) -> None:
        nn.Sigmoid.__init__(self)
        self._init_fewbit(bits)


class FewBitELU(_FewBitActivation, nn.ELU):
    """``nn.ELU`` with a ``bits``-bit backward; any ``alpha`` gets its own table."""

    _activation = "elu"

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, bits: int = 2) -> None:
        nn.ELU.__init__(self, alpha, inplace)
        self._init_fewbit(bits)


class FewBitCELU(_FewBitActivation, nn.CELU):
    """``nn.CELU`` with a ``bits``-bit backward; any ``alpha`` gets its own table."""

    _activation = "celu"

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, bits: int = 2) -> None:
        nn.CELU.__init__(self, alpha, inplace)
        self._init_fewbit(bits)


class FewBitSELU(_FewBitActivation, nn.SELU):
    """``nn.SELU`` with a ``bits``-bit backward."""

    _activation = "selu"

    def __init__(self, inplace: bool = False, *, bits: int = 2) -> None:
        nn.SELU.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitSoftplus(_FewBitActivation, nn.Softplus):
    """``nn.Softplus`` with a ``bits``-bit backward; any ``beta``/``threshold`` gets its table."""

    _activation = "softplus"

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 2) -> None:
        nn.Softplus.__init__(self, beta, threshold)
        self._init_fewbit(bits)


class FewBitSoftsign(_FewBitActivation, nn.Softsign):
    """``nn.Softsign`` with a ``bits``-bit backward."""

    _activation = "softsign"

    def __init__(self, *, bits: int = 2) -> None:
        nn.Softsign.__init__(self)
        self._init_fewbit(bits)


class FewBitLogSigmoid(_FewBitActivation, nn.LogSigmoid):
    """``nn.LogSigmoid`` with a ``bits``-bit backward."""

    _activation = "logsigmoid"

    def __init__(self, *, bits: int = 2) -> None:
        nn.LogSigmoid.__init__(self)
        self._init_fewbit(bits)


class FewBitHardswish(_FewBitActivation, nn.Hardswish):
    """``nn.Hardswish`` with a ``bits``-bit backward."""

    _activation = "hardswish"

    def __init__(self, inplace: bool = False, *, bits: int = 2) -> None:
        nn.Hardswish.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitTanhshrink(_FewBitActivation, nn.Tanhshrink):
    """``nn.Tanhshrink`` with a ``bits``-bit backward."""

    _activation = "tanhshrink"

    def __init__(self, *, bits: int = 2) -> None:
        nn.Tanhshrink.__init__(self)
        self._init_fewbit(bits)


# ---- exact 1-bit derivatives ---------------------------------------------------------------------


class FewBitReLU(_FewBitActivation, nn.ReLU):
    """``nn.ReLU`` with an exact 1-bit backward (see NOTE [ When few-bit saves memory ])."""

    _activation = "relu"

    def __init__(self, inplace: bool = False, *, bits: int = 1) -> None:
        nn.ReLU.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitLeakyReLU(_FewBitActivation, nn.LeakyReLU):
    """``nn.LeakyReLU`` with an exact 1-bit backward for any ``negative_slope``."""

    _activation = "leaky_relu"

    def __init__(
        self, negative_slope: float = 0.01, inplace: bool = False, *, bits: int = 1
    ) -> None:
        nn.LeakyReLU.__init__(self, negative_slope, inplace)
        self._init_fewbit(bits)


class FewBitReLU6(_FewBitActivation, nn.ReLU6):
    """``nn.ReLU6`` with an exact 1-bit backward."""

    _activation = "relu6"

    def __init__(self, inplace: bool = False, *, bits: int = 1) -> None:
        nn.ReLU6.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitHardtanh(_FewBitActivation, nn.Hardtanh):
    """``nn.Hardtanh`` with an exact 1-bit backward for any ``min_val``/``max_val``."""

    _activation = "hardtanh"

    def __init__(
        self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *, bits: int = 1
    ) -> None:
        nn.Hardtanh.__init__(self, min_val, max_val, inplace)
        self._init_fewbit(bits)


class FewBitHardsigmoid(_FewBitActivation, nn.Hardsigmoid):
    """``nn.Hardsigmoid`` with an exact 1-bit backward."""

    _activation = "hardsigmoid"

    def __init__(self, inplace: bool = False, *, bits: int = 1) -> None:
        nn.Hardsigmoid.__init__(self, inplace)
        self._init_fewbit(bits)


class FewBitThreshold(_FewBitActivation, nn.Threshold):
    """``nn.Threshold`` with an exact 1-bit backward."""

    _activation = "threshold"

    def __init__(
        self, threshold: float, value: float, inplace: bool = False, *, bits: int = 1
    ) -> None:
        nn.Threshold.__init__(self, threshold, value, inplace)
        self._init_fewbit(bits)


class FewBitSoftshrink(_FewBitActivation, nn.Softshrink):
    """``nn.Softshrink`` with an exact 1-bit backward."""

    _activation = "softshrink"

    def __init__(self, lambd: float = 0.5, *, bits: int = 1) -> None:
        nn.Softshrink.__init__(self, lambd)
        self._init_fewbit(bits)


class FewBitHardshrink(_FewBitActivation, nn.Hardshrink):
    """``nn.Hardshrink`` with an exact 1-bit backward."""

    _activation = "hardshrink"

    def __init__(self, lambd: float = 0.5, *, bits: int = 1) -> None:
        nn.Hardshrink.__init__(self, lambd)
        self._init_fewbit(bits)


#: Few-bit module class of each supported activation name.
FEWBIT_MODULES: dict[str, type[_FewBitActivation]] = {
    cls._activation: cls
    for cls in (
        FewBitGELU, FewBitSiLU, FewBitMish, FewBitTanh, FewBitSigmoid, FewBitELU, FewBitCELU,
        FewBitSELU, FewBitSoftplus, FewBitSoftsign, FewBitLogSigmoid, FewBitHardswish,
        FewBitTanhshrink, FewBitReLU, FewBitLeakyReLU, FewBitReLU6, FewBitHardtanh,
        FewBitHardsigmoid, FewBitThreshold, FewBitSoftshrink, FewBitHardshrink,
    )
}


def convert_activation(
    module: nn.Module, *, bits: int = 2, device: Optional[torch.device] = None
) -> _FewBitActivation:
    """The few-bit equivalent of a torch activation module, with the same arguments.

    Exact (two-valued) derivatives always use 1 bit whatever ``bits`` says. The new module follows
    ``module``'s training flag; it has no parameters, and its table buffers are put on ``device``
    (``model.to(...)`` moves them later like any buffer).

    Args:
        module: An instance of a supported torch activation class (exact class, not a subclass).
        bits: 1-4 for fitted derivatives.
        device: Device of the table buffers (default CPU).

    Returns:
        The ``FewBit<Name>`` module.

    Raises:
        ValueError: ``module``'s class is not supported, or bits outside 1-4.

    Example:
        >>> convert_activation(torch.nn.ELU(alpha=0.5), bits=2)
        FewBitELU(alpha=0.5, bits=2)
    """
    spec = spec_for_module(module)
    if spec is None:
        raise ValueError(
            f"module={type(module).__name__}: not a supported activation; supported classes: "
            f"{sorted(s.module.__name__ for s in ACTIVATIONS.values())}"
        )
    cls = FEWBIT_MODULES[spec.name]
    kwargs = dict(spec.params_of(module))
    if spec.inplace:
        kwargs["inplace"] = module.inplace
    new = cls(**kwargs, bits=1 if spec.exact is not None else bits)
    new.train(module.training)
    return new.to(device) if device is not None else new
