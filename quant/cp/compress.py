"""Replace a model's Conv2d/Linear layers by quantized CP layers, and report what changed.

Three steps, usable together (:func:`compress_model`) or apart (the Lightning callback builds the
structure before the optimizer exists and solves later, see NOTE [ Structure before solve ]):

1. :func:`~quant.cp.plan_compression` -- which layers, which ranks (plain data, no solving);
2. :func:`apply_plan` -- swap each layer for an empty CP layer of the planned rank;
3. :func:`solve_compressed` -- run :func:`~quant.cp.quantized_cp` on each original weight and
   write the codes into the CP layers in place.

:func:`load_compressed` rebuilds the structure from a saved ``state_dict`` and loads it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._checks import internal_assert
from .admm import quantized_cp
from .factor import QuantizedFactor
from .layers import CPConv2d, CPLinear, cp_modes
from .plan import KINDS, CompressionPlan, PlannedLayer, plan_compression
from .report import CompressionReport, LayerReport, conv_macs, linear_macs, packed_bytes

__all__ = [
    "add_flops",
    "apply_plan",
    "solve_compressed",
    "compress_model",
    "load_compressed",
    "plan_from_state_dict",
    "stored_trainable",
    "warn_high_error",
    "warn_skipped",
    "LAYERS",
    "HIGH_ERROR",
]

logger = logging.getLogger(__name__)

#: CP layer class per layer kind (keys of :data:`quant.cp.plan.KINDS`).
LAYERS: dict[str, type[CPConv2d] | type[CPLinear]] = {"conv2d": CPConv2d, "linear": CPLinear}

# A layer whose quantized CP model misses more than this share of the weight's norm usually costs
# accuracy visibly (the digits CNN's 32->10 classifier at rank 3: relative error 0.61-0.67, held-out
# accuracy 0.96 -> 0.22 without fine-tuning), so solve_compressed warns about it.
HIGH_ERROR = 0.5

# NOTE [ Structure before solve ]
# An optimizer holds references to parameter objects. Layers created after it exists are silently
# not trained. So whoever fine-tunes must create the CP layers (apply_plan) *before* building the
# optimizer. Solving later writes the codes into those same tensors in place
# (QuantizedFactor.set_), which keeps every parameter object -- and the optimizer -- valid.


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_plan(
    model: nn.Module, plan: CompressionPlan, *, trainable: bool = False
) -> dict[str, nn.Module]:
    """Swap each planned layer for an empty CP layer of the planned rank and bits (in place).

    The new layers have zero codes and the original bias: call :func:`solve_compressed` to fill
    them, or ``model.load_state_dict`` with a compressed state.

    Args:
        model: the model to modify.
        plan: from :func:`~quant.cp.plan_compression` (or ``CompressionPlan.from_dict``).
        trainable: build the factors in the trainable form (NOTE [ Two storage forms ]).

    Returns:
        ``{name: original layer}`` for the replaced layers (no longer part of ``model``).

    Raises:
        ValueError: a planned layer is missing from the model or has another kind or shape.
    """
    originals: dict[str, nn.Module] = {}
    for p in plan.layers:
        try:
            original = model.get_submodule(p.name)
        except AttributeError as e:
            raise ValueError(f"plan: layer {p.name!r} is not in the model; was the plan made "
                             "for another model?") from e
        expected = KINDS.get(p.kind)
        if expected is None or not isinstance(original, expected) or \
                tuple(original.weight.shape) != tuple(p.weight_shape):
            raise ValueError(
                f"plan: layer {p.name!r} is a {type(original).__name__} with weight "
                f"{tuple(getattr(getattr(original, 'weight', None), 'shape', ()))}, but the plan "
                f"has a {p.kind} with weight {p.weight_shape}; was the plan made for another model?"
            )
        new = LAYERS[p.kind].like(original, rank=p.rank, bits=p.bits, trainable=trainable)
        new.train(original.training)
        _set_submodule(model, p.name, new)
        originals[p.name] = original
    return originals


def _layer_values(module: nn.Module) -> tuple[int, int]:
    """(values, bytes) of a module's parameters and quantized codes, codes at their bit width.

    Uninitialized (lazy) parameters count as zero.
    """
    values = nbytes = 0
    factor_params = set()
    for m in module.modules():
        if isinstance(m, QuantizedFactor):
            n = m.shape[0] * m.shape[1]
            values += n
            nbytes += packed_bytes(n, m.bits) + m.scale.element_size()
            factor_params.update(id(p) for p in m.parameters())
    for p in module.parameters():
        if id(p) not in factor_params and not isinstance(p, nn.parameter.UninitializedParameter):
            values += p.numel()
            nbytes += p.numel() * p.element_size()
    return values, nbytes


def _call(model: nn.Module, example_inputs: Any) -> None:
    if isinstance(example_inputs, Mapping):
        model(**example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        model(*example_inputs)
    else:
        model(example_inputs)


def _record_shapes(
    model: nn.Module, example_inputs: Any, names: Sequence[str]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Input and output shapes of the named layers in one eval-mode, no-grad forward."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def hook(name: str):
        def record(_m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            shapes.setdefault(name, (tuple(args[0].shape), tuple(out.shape)))
        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    modes = {m: m.training for m in model.modules()}
    model.eval()  # no batch-norm statistics update, no dropout
    try:
        with torch.no_grad():
            _call(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return shapes


def _flops(layer: nn.Module, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, int]:
    """(dense FLOPs, CP FLOPs) per sample; 2 FLOPs per multiply-add."""
    in_shape, out_shape = shapes
    if isinstance(layer, CPConv2d):  # spatial sizes alone give the per-sample count
        kw = dict(c_in=layer.in_channels, c_out=layer.out_channels, kernel=layer.kernel_size,
                  in_hw=tuple(in_shape[-2:]), out_hw=tuple(out_shape[-2:]))
        dense, cp = conv_macs(rank=None, **kw), conv_macs(rank=layer.rank, **kw)
    else:
        internal_assert(isinstance(layer, CPLinear), f"unexpected layer {type(layer).__name__}")
        batch = in_shape[0] if len(in_shape) > 1 else 1
        tokens = 1
        for d in in_shape[:-1]:
            tokens *= d
        tokens //= batch
        kw = dict(in_features=layer.in_features, out_features=layer.out_features, tokens=tokens)
        dense, cp = linear_macs(rank=None, **kw), linear_macs(rank=layer.rank, **kw)
    return 2 * dense, 2 * cp


def solve_compressed(
    model: nn.Module,
    originals: Mapping[str, nn.Module],
    *,
    plan: CompressionPlan | None = None,
    example_inputs: Any = None,
    **solver_options: Any,
) -> CompressionReport:
    """Fill the CP layers made by :func:`apply_plan` by :func:`~quant.cp.quantized_cp`, in place.

    Args:
        model: the model holding the CP layers (under the names of ``originals``).
        originals: ``{name: original layer}`` as returned by :func:`apply_plan`.
        plan: the plan, only to carry its ``skipped`` list into the report.
        example_inputs: optional model input (a tensor, a tuple of positional args or a dict of
            keyword args) to measure each layer's FLOPs; the model runs once in eval mode under
            ``no_grad`` (training flags restored).
        **solver_options: passed to :func:`~quant.cp.quantized_cp` (``max_iter``, ``seed`` ...).

    Returns:
        A :class:`~quant.cp.CompressionReport` (:func:`warn_high_error` names the layers whose
        error exceeds :data:`HIGH_ERROR`; :func:`compress_model` calls it).
    """
    reports = []
    cp_values = cp_bytes = orig_values = orig_bytes = 0
    for name, original in originals.items():
        layer = model.get_submodule(name)
        internal_assert(isinstance(layer, (CPConv2d, CPLinear)),
                        f"{name} is a {type(layer).__name__}, not a CP layer")
        weight = original.weight.detach().to(layer.factors[0].scale.device)
        start = time.perf_counter()
        result = quantized_cp(weight.reshape(cp_modes(tuple(weight.shape))), layer.rank,
                              layer.bits, **solver_options)
        layer.load_result(result)
        seconds = time.perf_counter() - start
        values_before, bytes_before = _layer_values(original)
        values_after, bytes_after = _layer_values(layer)
        cp_values, cp_bytes = cp_values + values_after, cp_bytes + bytes_after
        orig_values, orig_bytes = orig_values + values_before, orig_bytes + bytes_before
        logger.info("quant.cp: %s rank %d, %d-bit: error %.4f (CP then quantize %.4f) in %.2fs",
                    name, layer.rank, layer.bits, result.error, result.baseline_error, seconds)
        reports.append(LayerReport(
            name=name, kind="conv2d" if isinstance(layer, CPConv2d) else "linear",
            weight_shape=tuple(weight.shape), rank=layer.rank, bits=layer.bits,
            params_before=values_before, params_after=values_after,
            bytes_before=bytes_before, bytes_after=bytes_after, error=result.error,
            baseline_error=result.baseline_error, float_error=result.float_error,
            status=result.status, seconds=seconds,
        ))
    total_values, total_bytes = _layer_values(model)
    report = CompressionReport(
        layers=tuple(reports),
        skipped=plan.skipped if plan is not None else (),
        model_params_before=total_values - cp_values + orig_values,
        model_params_after=total_values,
        model_bytes_before=total_bytes - cp_bytes + orig_bytes,
        model_bytes_after=total_bytes,
    )
    if example_inputs is not None and reports:
        report = add_flops(report, model,
                           _record_shapes(model, example_inputs, [r.name for r in reports]))
    return report


def add_flops(
    report: CompressionReport,
    model: nn.Module,
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]],
) -> CompressionReport:
    """The report with each layer's FLOPs per sample filled in from its input/output shapes.

    Args:
        report: from :func:`solve_compressed`.
        model: the compressed model (the CP layers give the layer geometry).
        shapes: ``{layer name: (input shape, output shape)}`` of one forward pass, batch first
            (e.g. recorded by forward hooks on the CP layers).

    Returns:
        A new report; layers without shapes keep ``None``.
    """
    layers = []
    for r in report.layers:
        if r.name in shapes:
            before, after = _flops(model.get_submodule(r.name), shapes[r.name])
            r = dataclasses.replace(r, flops_before=before, flops_after=after)
        layers.append(r)
    return dataclasses.replace(report, layers=tuple(layers))


def warn_high_error(report: CompressionReport, *, stacklevel: int = 2) -> None:
    """One warning naming the layers whose relative error exceeds :data:`HIGH_ERROR`."""
    high = [f"{r.name} ({r.error:.2f} at rank {r.rank}, {r.bits} bits)" for r in report.layers
            if r.error > HIGH_ERROR]
    if high:
        warnings.warn(
            f"quant.cp: relative reconstruction error above {HIGH_ERROR} for {', '.join(high)}; "
            "expect an accuracy loss there: use a smaller rate (higher rank), more bits, or leave "
            "the layer dense with exclude=[...]", stacklevel=stacklevel + 1)


def warn_skipped(plan: CompressionPlan, *, stacklevel: int = 2) -> None:
    """One warning listing the conv/linear layers a plan leaves dense, with the reasons."""
    if plan.skipped:
        lines = "; ".join(f"{s.name} ({s.kind}): {s.reason}" for s in plan.skipped)
        warnings.warn(f"quant.cp: {len(plan.skipped)} layer(s) left uncompressed: {lines}",
                      stacklevel=stacklevel + 1)


def compress_model(
    model: nn.Module,
    *,
    rate: float = 2.0,
    bits: int = 8,
    rank: int | Mapping[str, int] | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    example_inputs: Any = None,
    trainable: bool = False,
    **solver_options: Any,
) -> CompressionReport:
    """Replace ``Conv2d``/``Linear`` layers by quantized CP layers, in place.

    Cherniuk et al., "Quantization Aware Factorization for Deep Neural Network Compression"
    (2023). Each selected layer's weight is decomposed by :func:`~quant.cp.quantized_cp` and the
    layer replaced by :class:`~quant.cp.CPConv2d` / :class:`~quant.cp.CPLinear`. Layers that
    cannot be factorized (grouped, transposed, 1-D/3-D convs, tied weights, too small for the
    rate) stay dense, with one warning listing them; layers whose relative error exceeds
    :data:`HIGH_ERROR` are named in another.

    Args:
        model: the model to modify.
        rate: parameter reduction per layer when its rank is not given (> 1).
        bits: bit width of the factors, in ``[2, 8]``.
        rank: one rank for all layers, ``{layer name: rank}``, or ``None`` (use ``rate``).
        include: glob pattern(s) of layer names to consider (default: all).
        exclude: glob pattern(s) of layer names to leave dense.
        example_inputs: optional model input to measure FLOPs per sample (one eval-mode forward).
        trainable: build the factors in the trainable form, for fine-tuning afterwards.
        **solver_options: passed to :func:`~quant.cp.quantized_cp` (``max_iter``, ``seed`` ...).

    Returns:
        A :class:`~quant.cp.CompressionReport`; ``print(report.summary())`` shows per-layer rank,
        parameters and FLOPs before/after and reconstruction errors.

    Raises:
        ValueError: bad ``bits``/``rate``/``rank``, or patterns/rank keys that match no layer.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
        >>> report = compress_model(net, rate=2.0, bits=4, include="0")
        >>> type(net[0]).__name__, report.layers[0].rank
        ('CPConv2d', 9)
    """
    plan = plan_compression(model, rate=rate, bits=bits, rank=rank, include=include,
                            exclude=exclude)
    warn_skipped(plan)
    originals = apply_plan(model, plan, trainable=trainable)
    report = solve_compressed(model, originals, plan=plan, example_inputs=example_inputs,
                              **solver_options)
    warn_high_error(report)
    return report


def plan_from_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> CompressionPlan:
    """The plan that a compressed ``state_dict`` was saved with, read off its keys.

    Every dense ``Conv2d``/``Linear`` of ``model`` for which ``state_dict`` holds CP factors
    (``<name>.factors.0.codes`` or ``.latent``) is planned at the stored rank and bit width.
    Layers of ``model`` that are already CP layers are left out.

    Raises:
        ValueError: a layer's factors are stored without their bit width.
    """
    layers = []
    for name, module in model.named_modules():
        kind = next((k for k, cls in KINDS.items() if isinstance(module, cls)), None)
        if kind is None or not name:
            continue
        prefix = f"{name}.factors.0."
        stored = state_dict.get(prefix + "codes", state_dict.get(prefix + "latent"))
        if stored is None:
            continue
        extra = state_dict.get(prefix + "_extra_state")
        bits = extra.get("bits") if isinstance(extra, Mapping) else None
        if bits is None:
            raise ValueError(f"state_dict: no bit width stored for {name!r} "
                             f"({prefix}_extra_state); was it saved by quant.cp?")
        layers.append(PlannedLayer(name=name, kind=kind, weight_shape=tuple(module.weight.shape),
                                   rank=int(stored.shape[1]), bits=int(bits)))
    return CompressionPlan(layers=tuple(layers))


def stored_trainable(state_dict: Mapping[str, Any]) -> bool:
    """Whether a compressed ``state_dict`` holds trainable latents (else int8 codes)."""
    return any(k.endswith(".latent") for k in state_dict)


def load_compressed(
    model: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    trainable: bool | None = None,
    strict: bool = True,
) -> CompressionPlan:
    """Rebuild the CP layers a saved ``state_dict`` has, then load it into ``model`` (in place).

    ``model`` is a freshly built, uncompressed instance of the architecture; every layer the
    state dict holds CP factors for (``<name>.factors.0.codes`` or ``.latent``) is replaced by a
    CP layer of the stored rank and bit width, then ``model.load_state_dict`` runs.

    Args:
        model: the uncompressed model.
        state_dict: saved from a compressed model (``torch.save(model.state_dict(), ...)``).
        trainable: form of the rebuilt factors; ``None`` keeps the stored form.
        strict: passed to ``load_state_dict``.

    Returns:
        The :class:`~quant.cp.CompressionPlan` that was applied.

    Example:
        >>> load_compressed(fresh_net, torch.load("compressed.pt"))  # doctest: +SKIP
    """
    plan = plan_from_state_dict(model, state_dict)
    if trainable is None:
        trainable = stored_trainable(state_dict)
    apply_plan(model, plan, trainable=trainable)
    model.load_state_dict(state_dict, strict=strict)
    return plan
