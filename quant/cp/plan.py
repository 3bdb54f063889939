"""Which layers of a model to factorize, at which rank: plain data, decided without solving.

A plan is a pure function of the model's layer types and shapes and the options, so every rank of
a distributed job (and a resumed run) computes the same plan.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from ._checks import check_bits, check_rank
from .layers import _resolve_rank
from .report import SkippedLayer

__all__ = ["PlannedLayer", "CompressionPlan", "plan_compression", "KINDS"]

#: Layer kinds that can be factorized: ``kind name -> module type``.
KINDS: dict[str, type[nn.Module]] = {"conv2d": nn.Conv2d, "linear": nn.Linear}

# Module types a user may expect to be compressed but that are not supported: skipped with a
# warning (never silently replaced by a wrong layer).
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d)


def _reason_transposed(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return "transposed convolutions are not supported"
    return None


def _reason_dims(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if isinstance(m, (nn.Conv1d, nn.Conv3d)):
        return f"only 2-D convolutions are supported ({type(m).__name__})"
    return None


def _reason_lazy(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if isinstance(getattr(m, "weight", None), nn.parameter.UninitializedParameter):
        return "lazy layer without a weight yet (run one forward pass first)"
    return None


def _reason_groups(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if isinstance(m, nn.Conv2d) and m.groups != 1:
        return f"grouped/depthwise convolution (groups={m.groups}) is not supported"
    return None


def _reason_mha(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if type(m) is not nn.Linear and type(m).__name__ == "NonDynamicallyQuantizableLinear":
        return "out_proj of nn.MultiheadAttention, which reads its .weight directly"
    return None


def _reason_dtype(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    w = getattr(m, "weight", None)
    if w is None or not w.is_floating_point():
        return "weight is not a floating-point tensor"
    return None


def _reason_parametrized(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    if parametrize.is_parametrized(m, "weight"):
        return "weight is parametrized (weight_norm, spectral_norm, ...), not a plain tensor"
    return None


def _reason_tied(m: nn.Module, shared: Mapping[int, str]) -> str | None:
    other = shared.get(id(m.weight))
    if other is not None:
        return f"weight is shared by {other} (factorizing it would untie them)"
    return None


# Checked in order; the first reason found is reported.
_SKIP_RULES: tuple[Callable[[nn.Module, Mapping[int, str]], str | None], ...] = (
    _reason_transposed, _reason_dims, _reason_lazy, _reason_groups, _reason_mha,
    _reason_parametrized, _reason_dtype, _reason_tied,
)


@dataclass(frozen=True)
class PlannedLayer:
    """One layer to factorize: its name, kind (a key of :data:`KINDS`), weight shape, rank, bits."""

    name: str
    kind: str
    weight_shape: tuple[int, ...]
    rank: int
    bits: int


@dataclass(frozen=True)
class CompressionPlan:
    """The layers to factorize and those skipped, with reasons.

    Convert with :meth:`to_dict` / :meth:`from_dict` to store it (e.g. in a checkpoint).
    """

    layers: tuple[PlannedLayer, ...]
    skipped: tuple[SkippedLayer, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict``/``list``/``int``/``str`` data."""
        return {
            "layers": [
                {"name": p.name, "kind": p.kind, "weight_shape": list(p.weight_shape),
                 "rank": p.rank, "bits": p.bits} for p in self.layers
            ],
            "skipped": [{"name": s.name, "kind": s.kind, "reason": s.reason} for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressionPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            layers=tuple(
                PlannedLayer(name=d["name"], kind=d["kind"], weight_shape=tuple(d["weight_shape"]),
                             rank=int(d["rank"]), bits=int(d["bits"])) for d in data["layers"]),
            skipped=tuple(SkippedLayer(**d) for d in data.get("skipped", ())),
        )


def _patterns(value: str | Sequence[str] | None, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name}={value!r}: expected a glob pattern or a list of them, "
                        f"e.g. {name}=['features.*']")
    return tuple(value)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _kind_of(module: nn.Module) -> str | None:
    for kind, cls in KINDS.items():
        if isinstance(module, cls):
            return kind
    return None


def _shared_weights(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> "a.weight and b.weight"`` for parameters reachable under several names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {pid: " and ".join(ns) for pid, ns in names.items() if len(ns) > 1}


def plan_compression(
    model: nn.Module,
    *,
    rate: float = 2.0,
    bits: int = 8,
    rank: int | Mapping[str, int] | None = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> CompressionPlan:
    """Choose the layers to factorize and their ranks (no decomposition is run).

    Args:
        model: the model; not modified.
        rate: parameter reduction per layer when its rank is not given (> 1):
            ``rank = floor(numel / sum(CP mode sizes) / rate)``.
        bits: bit width of the factors, in ``[2, 8]``.
        rank: one rank for every layer, or ``{layer name: rank}`` for some layers (the others
            use ``rate``), or ``None``.
        include: glob pattern(s) on qualified module names (``"features.*"``); only matching
            layers are considered. ``None`` considers every ``Conv2d`` and ``Linear``.
        exclude: glob pattern(s) of layers to leave dense (applied after ``include``).

    Returns:
        A :class:`CompressionPlan`. Conv/linear layers that cannot be factorized (grouped,
        transposed, 1-D/3-D, tied, too small for the rate...) are listed in ``skipped``.

    Raises:
        TypeError: ``model`` is itself a ``Conv2d``/``Linear`` (use ``from_conv``/``from_linear``).
        ValueError: bad ``bits``/``rate``, a rank that is not positive, a per-layer rank (a
            ``rank`` mapping entry) that gives no compression, an ``include`` pattern or ``rank``
            key that matches no layer. A global ``rank``/``rate`` that gives no compression for
            some layer skips that layer instead.
    """
    check_bits(bits)
    if isinstance(model, (nn.Conv2d, nn.Linear)):
        raise TypeError(
            f"model={type(model).__name__}: compress_model replaces layers inside a model; for a "
            "single layer use CPConv2d.from_conv / CPLinear.from_linear"
        )
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 1:
        raise ValueError(
            f"rate={rate!r}: the compression rate must be > 1 (parameters before / after); "
            "pass e.g. rate=2.0"
        )
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    ranks: Mapping[str, int] = rank if isinstance(rank, Mapping) else {}
    for key, value in ranks.items():
        check_rank(value, name=f"rank[{key!r}]")
    if rank is not None and not isinstance(rank, Mapping):
        check_rank(rank)
    shared = _shared_weights(model)
    candidates = [(n, m) for n, m in model.named_modules()
                  if n and (isinstance(m, _CONV_TYPES) or isinstance(m, nn.Linear))]
    names = [n for n, _ in candidates]
    for pattern in inc or ():
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(
                f"include={pattern!r} matches no conv/linear layer; layer names look like "
                f"{names[:5]}"
            )
    unknown = sorted(set(ranks) - set(names))
    if unknown:
        raise ValueError(f"rank: {unknown} are not conv/linear layers of the model; "
                         f"layer names look like {names[:5]}")
    layers, skipped = [], []
    for name, module in candidates:
        if (inc is not None and not _matches(name, inc)) or (exc and _matches(name, exc)):
            continue
        kind_label = type(module).__name__
        reason = next((r for r in (rule(module, shared) for rule in _SKIP_RULES) if r), None)
        kind = _kind_of(module)
        if reason is None and kind is None:
            reason = "not a supported layer type"
        if reason is not None:
            skipped.append(SkippedLayer(name, kind_label, reason))
            continue
        shape = tuple(module.weight.shape)
        if name in ranks:
            # an explicit per-layer rank that gives no compression is the caller's error
            r = _resolve_rank(shape, ranks[name], rate, f"{kind} {name!r}")
        else:
            try:
                r = _resolve_rank(shape, None if isinstance(rank, Mapping) else rank, rate, kind)
            except ValueError as e:  # too small for this rate / global rank: leave it dense
                skipped.append(SkippedLayer(name, kind_label, str(e)))
                continue
        layers.append(PlannedLayer(name=name, kind=kind, weight_shape=shape, rank=r, bits=bits))
    return CompressionPlan(layers=tuple(layers), skipped=tuple(skipped))
