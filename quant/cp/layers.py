"""Conv2d and Linear layers replaced by the equivalent sequence of small CP layers.

A ``Conv2d`` kernel ``W`` of shape ``(C_out, C_in, kh, kw)`` is decomposed as a 3-way tensor
``(C_out, C_in, kh*kw)``: ``W[o, i, p] = sum_r A_out[o, r] A_in[i, r] A_sp[p, r]``. The
convolution with ``W`` then equals (Lebedev et al., "Speeding-up Convolutional Neural Networks
Using Fine-tuned CP-Decomposition", ICLR 2015):

    1x1 conv  C_in -> R     (weight A_in^T)
    depthwise kh x kw conv on R channels (weight A_sp^T; stride, padding, dilation of the original)
    1x1 conv  R -> C_out    (weight A_out, the original bias)

A 1x1 conv or a ``Linear`` is a matrix and gets two factors (a low-rank product). The factors are
quantized (:class:`~quant.cp.factor.QuantizedFactor`), found by :func:`~quant.cp.quantized_cp`
(Cherniuk et al., 2023). See NOTE [ Why the sequence is exact ].
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from ._checks import check_bits, check_positive_float, check_rank, internal_assert
from ._tensor import reconstruct
from .admm import CPResult, quantized_cp
from .factor import QuantizedFactor

__all__ = ["CPConv2d", "CPLinear", "rank_for_rate", "cp_modes", "check_compresses"]

# NOTE [ Why the sequence is exact ]
# Both 1x1 convolutions act on each pixel independently and linearly (the first has no bias), so
# they commute with zero padding, reflect/replicate/circular padding, striding and dilation. The
# whole sequence is therefore the same linear map as conv2d with the reconstructed kernel, up to
# floating-point summation order (tests check max relative difference < 1e-5 in float32 and
# < 1e-12 in float64). Non-"zeros" padding modes are applied with F.pad between the first 1x1 and
# the depthwise conv, exactly as nn.Conv2d applies them before its convolution.

_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def cp_modes(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The CP tensor shape used for a layer weight.

    ``(C_out, C_in, kh, kw)`` -> ``(C_out, C_in, kh*kw)``, or ``(C_out, C_in)`` for a 1x1 kernel;
    a ``Linear`` weight ``(out, in)`` is kept.
    """
    if len(weight_shape) == 4:
        c_out, c_in, kh, kw = weight_shape
        return (c_out, c_in) if kh * kw == 1 else (c_out, c_in, kh * kw)
    internal_assert(len(weight_shape) == 2, f"unexpected weight shape {weight_shape}")
    return tuple(weight_shape)


def rank_for_rate(weight_shape: tuple[int, ...], rate: float) -> int:
    """CP rank dividing the weight's parameter count by ``rate``.

    ``floor(numel / sum(CP mode sizes) / rate)``.

    May return 0 when the layer is too small for the rate.

    Example:
        >>> rank_for_rate((64, 64, 3, 3), 2.0)
        134
    """
    check_positive_float(rate, name="rate")
    modes = cp_modes(weight_shape)
    return int(math.prod(modes) / sum(modes) / rate)


def check_compresses(weight_shape: tuple[int, ...], rank: int, *, layer: str = "layer") -> None:
    """Raise ``ValueError`` if a rank-``rank`` CP model has no fewer values than the weight."""
    modes = cp_modes(weight_shape)
    dense, cp = math.prod(modes), rank * sum(modes)
    if cp >= dense:
        raise ValueError(
            f"rank={rank}: a rank-{rank} CP model of the {layer} weight {tuple(weight_shape)} has "
            f"{cp} values, not fewer than the {dense} of the dense weight, so it gives no "
            f"compression; use rank <= {max((dense - 1) // sum(modes), 0)} or a rate > 1"
        )


def _resolve_rank(shape: tuple[int, ...], rank: int | None, rate: float, layer: str) -> int:
    if rank is None:
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 1:
            raise ValueError(
                f"rate={rate!r}: the compression rate must be > 1 (parameters before / after); "
                "pass e.g. rate=2.0"
            )
        rank = rank_for_rate(shape, rate)
        if rank < 1:
            modes = cp_modes(shape)
            raise ValueError(
                f"rate={rate}: the {layer} weight {tuple(shape)} is too small to be compressed "
                f"{rate}x by CP (it would need rank {math.prod(modes) / sum(modes) / rate:.2f} "
                "< 1); use a smaller rate or leave this layer uncompressed"
            )
    check_rank(rank)
    check_compresses(shape, rank, layer=layer)
    return rank


def _check_conv(conv: Any) -> nn.Conv2d:
    if not isinstance(conv, nn.Conv2d):
        kind = type(conv).__name__
        hint = {
            "ConvTranspose2d": "transposed convolutions are not supported",
            "Conv1d": "only 2-D convolutions are supported",
            "Conv3d": "only 2-D convolutions are supported",
        }.get(kind, "pass an nn.Conv2d")
        raise TypeError(f"conv={kind}: CPConv2d.from_conv needs an nn.Conv2d; {hint}")
    if isinstance(conv.weight, nn.parameter.UninitializedParameter):
        raise ValueError("conv: a lazy Conv2d has no weight yet; run one forward pass first")
    if conv.groups != 1:
        raise ValueError(
            f"conv.groups={conv.groups}: grouped and depthwise convolutions are not supported "
            "(each group would need its own CP model); leave this layer uncompressed"
        )
    return conv


class _FactorizedLayer(nn.Module):
    """What the CP layers share: their quantized factors live in ``self.factors``."""

    factors: nn.ModuleList

    @property
    def bits(self) -> int:
        """Bit width of the factors."""
        return self.factors[0].bits

    @property
    def trainable(self) -> bool:
        """Whether the factors hold trainable latents."""
        return self.factors[0].trainable


class CPConv2d(_FactorizedLayer):
    """``Conv2d`` as 1x1 conv -> depthwise conv -> 1x1 conv with quantized CP factors.

    Lebedev et al. (ICLR 2015) for the layer sequence; Cherniuk et al. (2023) for the quantized
    factors. The module equals ``F.conv2d`` with the reconstructed kernel :meth:`dense_weight`
    (NOTE [ Why the sequence is exact ]). A 1x1 kernel gets two factors (1x1 conv with the
    original stride/padding, then 1x1 conv).

    Build one from a trained layer with :meth:`from_conv`; the constructor makes an empty layer
    of the right structure (zero codes) to load a ``state_dict`` into.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, bias, padding_mode:
            as in ``nn.Conv2d`` (``groups`` must be 1).
        rank: CP rank ``R``.
        bits: bit width of the factors, in ``[2, 8]``.
        trainable: factors hold trainable latents (for fine-tuning) instead of int8 codes.
        device, dtype: of the float tensors (scales, latents, bias).

    Example:
        >>> conv = nn.Conv2d(16, 32, 3, padding=1)
        >>> cp = CPConv2d.from_conv(conv, rate=2.0, bits=8)
        >>> cp(torch.randn(2, 16, 8, 8)).shape
        torch.Size([2, 32, 8, 8])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        *,
        rank: int,
        bits: int = 8,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        trainable: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_rank(rank)
        check_bits(bits)
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode={padding_mode!r}: expected one of {_PADDING_MODES}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride, self.dilation = _pair(stride), _pair(dilation)
        self.padding = padding if isinstance(padding, str) else _pair(padding)
        self.padding_mode = padding_mode
        self.rank = rank
        # a reference conv gives nn.Conv2d's own padding arithmetic (incl. "same") for F.pad
        ref = nn.Conv2d(1, 1, self.kernel_size, stride=self.stride, padding=self.padding,
                        dilation=self.dilation, padding_mode=padding_mode, device="meta")
        self._reversed_padding = tuple(ref._reversed_padding_repeated_twice)
        kw = dict(bits=bits, trainable=trainable, device=device, dtype=dtype)
        rows = (out_channels, in_channels) + (
            () if self.is_pointwise else (self.kernel_size[0] * self.kernel_size[1],))
        self.factors = nn.ModuleList(QuantizedFactor(r, rank, **kw) for r in rows)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.bias = nn.Parameter(torch.zeros(out_channels, device=device, dtype=dtype)) if bias \
            else None

    @property
    def is_pointwise(self) -> bool:
        """True for a 1x1 kernel (two factors)."""
        return self.kernel_size == (1, 1)

    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        *,
        rank: int | None = None,
        rate: float = 2.0,
        bits: int = 8,
        trainable: bool = False,
        **solver_options: Any,
    ) -> CPConv2d:
        """Decompose a trained ``Conv2d`` with :func:`~quant.cp.quantized_cp`.

        Args:
            conv: the layer (``groups=1``); it is not modified.
            rank: CP rank; ``None`` derives it from ``rate`` (:func:`rank_for_rate`).
            rate: parameter reduction wanted when ``rank`` is ``None`` (must be > 1).
            bits: bit width in ``[2, 8]``.
            trainable: build the layer in the trainable form (for fine-tuning).
            **solver_options: passed to :func:`~quant.cp.quantized_cp` (``max_iter``, ``seed`` ...).

        Returns:
            The factorized layer, on the conv's device and dtype; its solve's relative error is
            ``layer.result.error``.

        Raises:
            TypeError: ``conv`` is not an ``nn.Conv2d`` (transposed, 1-D and 3-D convs included).
            ValueError: grouped conv, bad ``bits``/``rank``/``rate``, or a rank that gives no
                compression.
        """
        conv = _check_conv(conv)
        rank = _resolve_rank(tuple(conv.weight.shape), rank, rate, "conv")
        check_bits(bits)
        w = conv.weight.detach()
        result = quantized_cp(w.reshape(cp_modes(tuple(w.shape))), rank, bits, **solver_options)
        layer = cls.like(conv, rank=rank, bits=bits, trainable=trainable)
        layer.load_result(result)
        layer.result = result
        return layer

    @classmethod
    def like(cls, conv: nn.Conv2d, *, rank: int, bits: int, trainable: bool = False) -> CPConv2d:
        """An empty (zero codes) layer with the structure of ``conv``, the given rank and bits."""
        conv = _check_conv(conv)
        check_compresses(tuple(conv.weight.shape), rank, layer="conv")
        layer = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, rank=rank, bits=bits,
            stride=conv.stride, padding=conv.padding, dilation=conv.dilation,
            bias=conv.bias is not None, padding_mode=conv.padding_mode, trainable=trainable,
            device=conv.weight.device, dtype=conv.weight.dtype,
        )
        if conv.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(conv.bias)
        return layer

    def load_result(self, result: CPResult) -> None:
        """Write a :class:`~quant.cp.CPResult`'s codes and scales into the factors in place."""
        _load_result(self, result)

    def dense_weight(self) -> Tensor:
        """The reconstructed kernel ``(C_out, C_in, kh, kw)`` in the layer's dtype."""
        factors = [f() for f in self.factors]
        w = reconstruct([a.to(torch.float64) for a in factors]).to(factors[0].dtype)
        return w.reshape(self.out_channels, self.in_channels, *self.kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        a_out, a_in = self.factors[0](), self.factors[1]()
        conv_padding: Any = self.padding
        if self.padding_mode != "zeros":
            conv_padding = 0
        if self.is_pointwise:
            if self.padding_mode != "zeros":
                x = F.pad(x, self._reversed_padding, mode=self.padding_mode)
            y = F.conv2d(x, a_in.T[:, :, None, None], stride=self.stride, padding=conv_padding,
                         dilation=self.dilation)
        else:
            y = F.conv2d(x, a_in.T[:, :, None, None])
            if self.padding_mode != "zeros":
                y = F.pad(y, self._reversed_padding, mode=self.padding_mode)
            a_sp = self.factors[2]()
            y = F.conv2d(y, a_sp.T.reshape(self.rank, 1, *self.kernel_size), stride=self.stride,
                         padding=conv_padding, dilation=self.dilation, groups=self.rank)
        return F.conv2d(y, a_out[:, :, None, None], self.bias)

    def freeze(self) -> CPConv2d:
        """Factors to the frozen int8 form; returns ``self``."""
        for f in self.factors:
            f.freeze()
        return self

    def unfreeze(self) -> CPConv2d:
        """Factors to the trainable form; returns ``self``."""
        for f in self.factors:
            f.unfreeze()
        return self

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"rank={self.rank}, bits={self.bits}, stride={self.stride}")
        if self.padding not in ((0, 0), "valid"):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode!r}"
        return s + f", bias={self.bias is not None}, trainable={self.trainable}"


class CPLinear(_FactorizedLayer):
    """``Linear`` as two quantized factors: ``y = A_out (A_in^T x) + b``.

    The weight ``(out, in)`` is approximated by ``A_out A_in^T`` with ``A_out`` of shape
    ``(out, R)`` and ``A_in`` of shape ``(in, R)`` on a ``bits``-bit grid each (Cherniuk et al.,
    2023, applied to a 2-way tensor: a quantized low-rank factorization).

    Args:
        in_features, out_features, bias: as in ``nn.Linear``.
        rank: rank ``R``.
        bits: bit width in ``[2, 8]``.
        trainable: factors hold trainable latents instead of int8 codes.
        device, dtype: of the float tensors.

    Example:
        >>> cp = CPLinear.from_linear(nn.Linear(64, 32), rate=2.0, bits=8)
        >>> cp(torch.randn(5, 64)).shape
        torch.Size([5, 32])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        bits: int = 8,
        bias: bool = True,
        trainable: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_rank(rank)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        kw = dict(bits=bits, trainable=trainable, device=device, dtype=dtype)
        self.factors = nn.ModuleList(
            [QuantizedFactor(out_features, rank, **kw), QuantizedFactor(in_features, rank, **kw)])
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias \
            else None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rank: int | None = None,
        rate: float = 2.0,
        bits: int = 8,
        trainable: bool = False,
        **solver_options: Any,
    ) -> CPLinear:
        """Factorize a trained ``Linear`` with :func:`~quant.cp.quantized_cp`.

        Args:
            linear: the layer; it is not modified.
            rank: rank; ``None`` derives it from ``rate``.
            rate: parameter reduction wanted when ``rank`` is ``None`` (must be > 1).
            bits: bit width in ``[2, 8]``.
            trainable: build the layer in the trainable form.
            **solver_options: passed to :func:`~quant.cp.quantized_cp`.

        Returns:
            The factorized layer on the linear's device and dtype (``layer.result.error`` is the
            solve's relative error).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``.
            ValueError: bad ``bits``/``rank``/``rate`` or a rank that gives no compression.
        """
        linear = _check_linear(linear)
        rank = _resolve_rank(tuple(linear.weight.shape), rank, rate, "linear")
        check_bits(bits)
        result = quantized_cp(linear.weight.detach(), rank, bits, **solver_options)
        layer = cls.like(linear, rank=rank, bits=bits, trainable=trainable)
        layer.load_result(result)
        layer.result = result
        return layer

    @classmethod
    def like(cls, linear: nn.Linear, *, rank: int, bits: int, trainable: bool = False) -> CPLinear:
        """An empty (zero codes) layer with the structure of ``linear``."""
        linear = _check_linear(linear)
        check_compresses(tuple(linear.weight.shape), rank, layer="linear")
        layer = cls(linear.in_features, linear.out_features, rank=rank, bits=bits,
                    bias=linear.bias is not None, trainable=trainable,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    def load_result(self, result: CPResult) -> None:
        """Write a :class:`~quant.cp.CPResult`'s codes and scales into the factors in place."""
        _load_result(self, result)

    def dense_weight(self) -> Tensor:
        """The reconstructed weight ``(out, in)`` in the layer's dtype."""
        a_out, a_in = self.factors[0](), self.factors[1]()
        return (a_out.to(torch.float64) @ a_in.to(torch.float64).T).to(a_out.dtype)

    def forward(self, x: Tensor) -> Tensor:
        a_out, a_in = self.factors[0](), self.factors[1]()
        return F.linear(F.linear(x, a_in.T), a_out, self.bias)

    def freeze(self) -> CPLinear:
        """Factors to the frozen int8 form; returns ``self``."""
        for f in self.factors:
            f.freeze()
        return self

    def unfreeze(self) -> CPLinear:
        """Factors to the trainable form; returns ``self``."""
        for f in self.factors:
            f.unfreeze()
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bits={self.bits}, bias={self.bias is not None}, "
                f"trainable={self.trainable}")


def _check_linear(linear: Any) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear={type(linear).__name__}: CPLinear.from_linear needs an nn.Linear")
    if isinstance(linear.weight, nn.parameter.UninitializedParameter):
        raise ValueError("linear: a LazyLinear has no weight yet; run one forward pass first")
    return linear


def _load_result(layer: CPConv2d | CPLinear, result: CPResult) -> None:
    expected = tuple(f.shape for f in layer.factors)
    got = tuple(tuple(c.shape) for c in result.codes)
    if got != tuple(tuple(s) for s in expected):
        raise ValueError(
            f"result: factor shapes {got} do not fit this layer's factors {expected}; decompose "
            "the layer's own weight (reshaped as quant.cp.cp_modes says) at its rank"
        )
    if result.bits != layer.bits:
        raise ValueError(f"result.bits={result.bits} but the layer has bits={layer.bits}")
    for f, codes, scale in zip(layer.factors, result.codes, result.scales):
        f.set_(codes.to(f.scale.device), scale)
