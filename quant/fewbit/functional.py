"""Functional few-bit activations, with ``torch.nn.functional``'s signatures plus keyword ``bits``.

``from quant.fewbit import functional as FB; y = FB.gelu(x, bits=2)``. Forward is bit-identical to
the torch function; with a gradient required only ``bits`` bits per element are kept for backward
(Novikov et al., ICML 2022). Without a gradient (``torch.no_grad()``, inputs that do not require
grad) these are the torch functions, at no extra cost.

The derivative tables are cached on the CPU and copied to the input's device at each call (at most
64 KiB); on an accelerator prefer the modules, which keep them on the device as buffers.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from quant.fewbit.activations import ACTIVATIONS
from quant.fewbit.function import FewBitPlan, fewbit_activation, make_plan, plan_tensors
from quant.fewbit.tables import normalize_params

__all__ = [
    "celu", "elu", "gelu", "hardshrink", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu",
    "logsigmoid", "mish", "relu", "relu6", "selu", "sigmoid", "silu", "softplus", "softshrink",
    "softsign", "tanh", "tanhshrink", "threshold",
]


@functools.lru_cache(maxsize=256)
def _plan(activation: str, params: tuple, inplace: bool, bits: int) -> tuple[FewBitPlan, Any, Any]:
    plan = make_plan(
        activation, normalize_params(activation, dict(params)), inplace=inplace, bits=bits,
        label=f"quant.fewbit.functional.{activation}",
    )
    return (plan, *plan_tensors(plan, dtype=torch.float64))


def _apply(activation: str, x: torch.Tensor, bits: int, inplace: bool = False, **params: Any):
    if not (torch.is_grad_enabled() and x.requires_grad):
        return ACTIVATIONS[activation].call(x, params, inplace)
    plan, table, levels = _plan(activation, tuple(params.items()), inplace, bits)
    if table is not None:
        table = table.to(x.device)
    if levels is not None:
        levels = levels.to(device=x.device, dtype=x.dtype)
    return fewbit_activation(x, plan, table, levels)


def gelu(input: torch.Tensor, approximate: str = "none", *, bits: int = 2) -> torch.Tensor:
    """``F.gelu`` with a ``bits``-bit backward."""
    return _apply("gelu", input, bits, approximate=approximate)


def silu(input: torch.Tensor, inplace: bool = False, *, bits: int = 2) -> torch.Tensor:
    """``F.silu`` with a ``bits``-bit backward."""
    return _apply("silu", input, bits, inplace)


def mish(input: torch.Tensor, inplace: bool = False, *, bits: int = 2) -> torch.Tensor:
    """``F.mish`` with a ``bits``-bit backward."""
    return _apply("mish", input, bits, inplace)


def tanh(input: torch.Tensor, *, bits: int = 2) -> torch.Tensor:
    """``torch.tanh`` with a ``bits``-bit backward."""
    return _apply("tanh", input, bits)


def sigmoid(input: torch.Tensor, *, bits: int = 2) -> torch.Tensor:
    """``torch.sigmoid`` with a ``bits``-bit backward."""
    return _apply("sigmoid", input, bits)


def elu(
    input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 2
) -> torch.Tensor:
    """``F.elu`` with a ``bits``-bit backward (a table fitted for this ``alpha``)."""
    return _apply("elu", input, bits, inplace, alpha=alpha)


def celu(
    input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = 2
) -> torch.Tensor:
    """``F.celu`` with a ``bits``-bit backward (a table fitted for this ``alpha``)."""
    return _apply("celu", input, bits, inplace, alpha=alpha)


def selu(input: torch.Tensor, inplace: bool = False, *, bits: int = 2) -> torch.Tensor:
    """``F.selu`` with a ``bits``-bit backward."""
    return _apply("selu", input, bits, inplace)


def softplus(
    input: torch.Tensor, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 2
) -> torch.Tensor:
    """``F.softplus`` with a ``bits``-bit backward (a table fitted for ``beta``, ``threshold``)."""
    return _apply("softplus", input, bits, beta=beta, threshold=threshold)


def softsign(input: torch.Tensor, *, bits: int = 2) -> torch.Tensor:
    """``F.softsign`` with a ``bits``-bit backward."""
    return _apply("softsign", input, bits)


def logsigmoid(input: torch.Tensor, *, bits: int = 2) -> torch.Tensor:
    """``F.logsigmoid`` with a ``bits``-bit backward."""
    return _apply("logsigmoid", input, bits)


def hardswish(input: torch.Tensor, inplace: bool = False, *, bits: int = 2) -> torch.Tensor:
    """``F.hardswish`` with a ``bits``-bit backward."""
    return _apply("hardswish", input, bits, inplace)


def tanhshrink(input: torch.Tensor, *, bits: int = 2) -> torch.Tensor:
    """``F.tanhshrink`` with a ``bits``-bit backward."""
    return _apply("tanhshrink", input, bits)


def relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu`` with an exact 1-bit backward."""
    return _apply("relu", input, 1, inplace)


def leaky_relu(
    input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False
) -> torch.Tensor:
    """``F.leaky_relu`` with an exact 1-bit backward."""
    return _apply("leaky_relu", input, 1, inplace, negative_slope=negative_slope)


def relu6(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu6`` (as ``nn.ReLU6`` computes it) with an exact 1-bit backward."""
    return _apply("relu6", input, 1, inplace)


def hardtanh(
    input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> torch.Tensor:
    """``F.hardtanh`` with an exact 1-bit backward."""
    return _apply("hardtanh", input, 1, inplace, min_val=min_val, max_val=max_val)


def hardsigmoid(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.hardsigmoid`` with an exact 1-bit backward."""
    return _apply("hardsigmoid", input, 1, inplace)


def threshold(
    input: torch.Tensor, threshold: float, value: float, inplace: bool = False
) -> torch.Tensor:
    """``F.threshold`` with an exact 1-bit backward."""
    return _apply("threshold", input, 1, inplace, threshold=threshold, value=value)


def softshrink(input: torch.Tensor, lambd: float = 0.5) -> torch.Tensor:
    """``F.softshrink`` with an exact 1-bit backward."""
    return _apply("softshrink", input, 1, lambd=lambd)


def hardshrink(input: torch.Tensor, lambd: float = 0.5) -> torch.Tensor:
    """``F.hardshrink`` with an exact 1-bit backward."""
    return _apply("hardshrink", input, 1, lambd=lambd)
