"""What :func:`~quant.cp.compress_model` did, layer by layer, as plain frozen data."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["LayerReport", "SkippedLayer", "CompressionReport", "conv_macs", "linear_macs"]


def conv_macs(
    *,
    c_in: int,
    c_out: int,
    kernel: tuple[int, int],
    rank: int | None,
    in_hw: tuple[int, int],
    out_hw: tuple[int, int],
) -> int:
    """Multiply-adds of one sample through a conv (``rank=None``) or its CP sequence.

    Dense: ``C_out C_in kh kw H_out W_out``. CP with a k x k kernel: ``C_in R H_in W_in`` (first
    1x1 at the input resolution) ``+ R kh kw H_out W_out + R C_out H_out W_out``; a 1x1 kernel:
    ``(C_in + C_out) R H_out W_out``.
    """
    out_px = out_hw[0] * out_hw[1]
    kh, kw = kernel
    if rank is None:
        return c_out * c_in * kh * kw * out_px
    if kh * kw == 1:
        return (c_in + c_out) * rank * out_px
    return c_in * rank * in_hw[0] * in_hw[1] + rank * kh * kw * out_px + rank * c_out * out_px


def linear_macs(*, in_features: int, out_features: int, rank: int | None, tokens: int) -> int:
    """Multiply-adds of ``tokens`` rows through a linear (``rank=None``) or its two factors."""
    if rank is None:
        return tokens * in_features * out_features
    return tokens * rank * (in_features + out_features)


@dataclass(frozen=True)
class LayerReport:
    """One replaced layer.

    Attributes:
        name: qualified module name.
        kind: ``"conv2d"`` or ``"linear"``.
        weight_shape: the dense weight's shape.
        rank: CP rank.
        bits: bit width of the factors.
        params_before: weight + bias values of the dense layer.
        params_after: factor values + bias values of the CP layer.
        bytes_before: dense weight + bias bytes (in the layer's dtype).
        bytes_after: factors at ``bits`` per value (packed), one scale per factor and the bias.
            In memory the frozen codes take one byte each (int8).
        flops_before: FLOPs (2 per multiply-add) per sample of the dense layer, when measured
            with ``example_inputs``; else ``None``.
        flops_after: the same for the CP layer.
        error: relative error ``||W - W_hat|| / ||W||`` of the quantized CP model (ADMM).
        baseline_error: the error of float CP then rounding (CP-then-quantize), same init.
        float_error: the error of the float CP model (no quantization).
        status: the solver's stopping reason.
        seconds: wall time of the solve.
    """

    name: str
    kind: str
    weight_shape: tuple[int, ...]
    rank: int
    bits: int
    params_before: int
    params_after: int
    bytes_before: int
    bytes_after: int
    error: float
    baseline_error: float
    float_error: float
    status: str
    seconds: float
    flops_before: int | None = None
    flops_after: int | None = None


@dataclass(frozen=True)
class SkippedLayer:
    """A conv/linear layer left as it was, and why."""

    name: str
    kind: str
    reason: str


def _fmt_int(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{int(n)}"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after > 0 else "n/a"


@dataclass(frozen=True)
class CompressionReport:
    """Result of :func:`~quant.cp.compress_model` / :func:`~quant.cp.solve_compressed`.

    Attributes:
        layers: one :class:`LayerReport` per replaced layer, in module order.
        skipped: conv/linear layers left dense, with the reason.
        model_params_before: values in the model's parameters before compression.
        model_params_after: values after (parameters plus int8 code buffers).
        model_bytes_before: bytes of those values before.
        model_bytes_after: bytes after, codes counted at their bit width.
    """

    layers: tuple[LayerReport, ...]
    skipped: tuple[SkippedLayer, ...] = field(default_factory=tuple)
    model_params_before: int = 0
    model_params_after: int = 0
    model_bytes_before: int = 0
    model_bytes_after: int = 0

    @property
    def flops_before(self) -> int | None:
        """FLOPs per sample of the replaced layers before (``None`` if not measured)."""
        vals = [r.flops_before for r in self.layers]
        return None if not vals or any(v is None for v in vals) else int(sum(vals))

    @property
    def flops_after(self) -> int | None:
        """FLOPs per sample of the replaced layers after (``None`` if not measured)."""
        vals = [r.flops_after for r in self.layers]
        return None if not vals or any(v is None for v in vals) else int(sum(vals))

    @property
    def ranks(self) -> dict[str, int]:
        """``{layer name: rank}``."""
        return {r.name: r.rank for r in self.layers}

    def summary(self) -> str:
        """A table for people: per layer rank, params, FLOPs and errors, then model totals."""
        if not self.layers:
            lines = ["CP compression: no layer was compressed"]
        else:
            bits = sorted({r.bits for r in self.layers})
            head = (f"CP compression (quantized CP by ADMM, Cherniuk et al. 2023): "
                    f"{len(self.layers)} layer(s), {'/'.join(map(str, bits))}-bit factors")
            cols = ["layer", "shape", "rank", "params before -> after",
                    "FLOPs/sample before -> after", "error ADMM", "CP->quant", "float CP"]
            rows = []
            for r in self.layers:
                flops = ("n/a" if r.flops_before is None else
                         f"{_fmt_int(r.flops_before)} -> {_fmt_int(r.flops_after)} "
                         f"({_ratio(r.flops_before, r.flops_after)})")
                rows.append([
                    r.name, "x".join(map(str, r.weight_shape)), str(r.rank),
                    f"{_fmt_int(r.params_before)} -> {_fmt_int(r.params_after)} "
                    f"({_ratio(r.params_before, r.params_after)})",
                    flops, f"{r.error:.4f}", f"{r.baseline_error:.4f}", f"{r.float_error:.4f}",
                ])
            widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
            fmt = "  ".join(f"{{:<{w}}}" for w in widths)
            lines = [head, fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
            lines += [fmt.format(*row) for row in rows]
            p0, p1 = self.model_params_before, self.model_params_after
            b0, b1 = self.model_bytes_before, self.model_bytes_after
            lines.append(f"model params: {p0:,} -> {p1:,} ({_ratio(p0, p1)}); "
                         f"size: {_fmt_bytes(b0)} -> {_fmt_bytes(b1)} ({_ratio(b0, b1)}, "
                         "codes counted at their bit width)")
            f0, f1 = self.flops_before, self.flops_after
            if f0 is not None and f1 is not None:
                lines.append(f"FLOPs/sample of the replaced layers: {_fmt_int(f0)} -> "
                             f"{_fmt_int(f1)} ({_ratio(f0, f1)})")
            else:
                lines.append("FLOPs: not measured (needs one forward pass: example_inputs=... in "
                             "compress_model, example_input_array on a LightningModule)")
        for s in self.skipped:
            lines.append(f"skipped {s.name} ({s.kind}): {s.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` codes at ``bits`` each, packed."""
    return math.ceil(numel * bits / 8)
