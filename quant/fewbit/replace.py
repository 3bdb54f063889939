"""Swap a model's ``nn.*`` activation modules for their few-bit versions, and say what was done.

``replace_activations(model, bits=2)`` replaces every module whose class is exactly a supported torch
activation (``nn.GELU``, ``nn.SiLU``, ``nn.ReLU``, ...) by its ``FewBit*`` equivalent with the same
arguments, in place, keeping parameters and ``state_dict`` keys. It reports what it swapped and what
it could not: unsupported activation modules (``nn.PReLU``, ``nn.Softmax``, ...), subclasses of
supported ones (their forward may differ), and -- when ``example_inputs`` are given -- activations
called as functions (``F.gelu(x)``, ``x.tanh()``) inside ``forward``, which no module swap can
reach.
"""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quant.fewbit._checks import check_bits
from quant.fewbit.activations import ACTIVATIONS, UNSUPPORTED_ACTIVATIONS, spec_for_module
from quant.fewbit.modules import _FewBitActivation, convert_activation
from quant.fewbit.packing import packed_bytes

__all__ = [
    "FunctionalCall",
    "ReplacedActivation",
    "ReplacementReport",
    "SkippedActivation",
    "replace_activations",
]

Selector = Union[str, type]

#: Function names counted as activation calls when ``example_inputs`` are given.
_FUNCTIONAL_NAMES = frozenset(
    {
        "gelu", "silu", "mish", "tanh", "tanh_", "sigmoid", "sigmoid_", "elu", "elu_", "celu",
        "celu_", "selu", "selu_", "softplus", "softsign", "logsigmoid", "log_sigmoid",
        "hardswish", "hardswish_", "tanhshrink", "relu", "relu_", "leaky_relu", "leaky_relu_",
        "relu6", "hardtanh", "hardtanh_", "hardsigmoid", "hardsigmoid_", "threshold",
        "threshold_", "softshrink", "hardshrink", "prelu", "rrelu", "rrelu_", "glu",
    }
)


@dataclasses.dataclass(frozen=True)
class ReplacedActivation:
    """One swapped module: qualified name, original class, replacement class, bits."""

    name: str
    original: str
    replacement: str
    bits: int

    @property
    def exact(self) -> bool:
        """Whether the replacement's gradient is exact (two-valued derivative, 1 bit)."""
        return ACTIVATIONS[_activation_of(self.replacement)].exact is not None


@dataclasses.dataclass(frozen=True)
class SkippedActivation:
    """An activation module left as it was, with the reason."""

    name: str
    kind: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FunctionalCall:
    """Activation calls made as functions inside ``module`` (seen in an example forward)."""

    module: str
    function: str
    count: int


@dataclasses.dataclass(frozen=True)
class ReplacementReport:
    """What :func:`replace_activations` did.

    Attributes:
        bits: Requested bits for fitted derivatives.
        replaced: Swapped modules.
        skipped: Activation modules not swapped, with reasons.
        functional: Activation function calls found in an example forward (empty when no
            ``example_inputs`` were given; see ``functional_checked``).
        functional_checked: Whether an example forward looked for functional calls.
        unmatched: ``include`` patterns that selected nothing.
    """

    bits: int
    replaced: tuple[ReplacedActivation, ...]
    skipped: tuple[SkippedActivation, ...]
    functional: tuple[FunctionalCall, ...]
    functional_checked: bool
    unmatched: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """True when nothing was skipped, no functional calls were seen, every pattern matched."""
        return not (self.skipped or self.functional or self.unmatched)

    def bytes_per_element(self) -> dict[str, float]:
        """Bytes each replaced module keeps per input element (``bits / 8``), by name."""
        return {r.name: r.bits / 8 for r in self.replaced}

    def __str__(self) -> str:
        counts = collections.Counter((r.original, r.bits) for r in self.replaced)
        lines = [f"few-bit activations: replaced {len(self.replaced)} module(s)"]
        for (original, bits), n in sorted(counts.items()):
            per = packed_bytes(8, bits) / 8
            lines.append(f"  {n:4d} x {original:<12s} -> {bits}-bit codes ({per:g} B/element)")
        for s in self.skipped:
            lines.append(f"  skipped {s.name} ({s.kind}): {s.reason}")
        for f in self.functional:
            lines.append(
                f"  not replaced: {f.function}() called {f.count} time(s) as a function in "
                f"{f.module or '<root>'}; use an nn module there to make it few-bit"
            )
        for p in self.unmatched:
            lines.append(f"  include pattern {p!r} matched no activation module")
        if not self.functional_checked:
            lines.append("  (activations called as functions were not looked for)")
        return "\n".join(lines)


def _activation_of(class_name: str) -> str:
    from quant.fewbit.modules import FEWBIT_MODULES

    for name, cls in FEWBIT_MODULES.items():
        if cls.__name__ == class_name:
            return name
    raise KeyError(class_name)


def _check_selectors(value: Optional[Iterable[Selector]], arg: str) -> tuple[Selector, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        value = [value]
    out = tuple(value)
    for item in out:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(
                f"{arg}={value!r}: each item must be a name pattern (str, e.g. 'blocks.*.act' or "
                f"'GELU') or an nn.Module class (nn.GELU); got {item!r}"
            )
    return out


def _matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, type):
        return isinstance(module, selector)
    return fnmatch.fnmatchcase(name, selector) or fnmatch.fnmatchcase(type(module).__name__, selector)


def _selected(name: str, module: nn.Module, include: Sequence[Selector],
              exclude: Sequence[Selector]) -> bool:
    """Whether :func:`replace_activations` with these (checked) selectors replaces ``module``,
    registered as ``name``."""
    if isinstance(module, _FewBitActivation) or spec_for_module(module) is None:
        return False
    if include and not any(_matches(s, name, module) for s in include):
        return False
    return not any(_matches(s, name, module) for s in exclude)


def _table_device(model: nn.Module, parent: nn.Module) -> Optional[torch.device]:
    for source in (parent, model):
        for t in (*source.parameters(), *source.buffers()):
            return t.device
    return None


class _FunctionalSpy(TorchFunctionMode):
    """Counts activation functions called outside the activation modules."""

    def __init__(self, names: dict[nn.Module, str], activation_modules: set[nn.Module]):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.stack: list[nn.Module] = []
        self._names = names
        self._activation_modules = activation_modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        inside_activation = any(m in self._activation_modules for m in self.stack)
        if name in _FUNCTIONAL_NAMES and not inside_activation:
            where = self._names.get(self.stack[-1], "") if self.stack else ""
            self.counts[(where, name.rstrip("_"))] += 1
        return func(*args, **(kwargs or {}))


def _find_functional_calls(model: nn.Module, example_inputs: Any) -> tuple[FunctionalCall, ...]:
    names = {m: n for n, m in model.named_modules()}
    supported = tuple(spec.module for spec in ACTIVATIONS.values())
    activation_modules = {
        m for m in model.modules()
        if isinstance(m, supported) or type(m) in UNSUPPORTED_ACTIVATIONS
    }
    spy = _FunctionalSpy(names, activation_modules)
    def enter(mod, args):
        spy.stack.append(mod)

    def leave(mod, args, out):
        spy.stack.pop()

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    modes = {m: m.training for m in model.modules()}
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    try:
        model.eval()  # no running-stat updates, no dropout
        with torch.no_grad(), spy:
            model(*args)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return tuple(
        FunctionalCall(module=where, function=fn, count=n)
        for (where, fn), n in sorted(spy.counts.items())
    )


def replace_activations(
    model: nn.Module,
    bits: int = 2,
    *,
    include: Optional[Sequence[Selector]] = None,
    exclude: Optional[Sequence[Selector]] = None,
    strict: bool = False,
    example_inputs: Any = None,
) -> ReplacementReport:
    """Replace ``model``'s torch activation modules by few-bit ones, in place.

    Few-bit backward (Novikov et al., ICML 2022): each replaced activation keeps ``bits`` bits per
    input element for backward instead of the full tensor; forward is unchanged bit for bit.
    Two-valued derivatives (ReLU, LeakyReLU, ReLU6, Hardtanh, ...) use 1 exact bit whatever
    ``bits`` is. Parameters, buffers and ``state_dict`` keys are kept; the new tables go to the
    device of the parent module's parameters.

    Args:
        model: The model to modify in place (a bare activation module cannot be replaced in place:
            use :func:`~quant.fewbit.modules.convert_activation`).
        bits: 1-4 bits for fitted derivatives (GELU, SiLU, Tanh, ...).
        include: Only replace modules matching one of these: ``nn.Module`` classes, or shell-style
            patterns matched against the qualified name (``"blocks.*.mlp.act"``) or the class name
            (``"GELU"``). Default: every supported activation.
        exclude: Never replace modules matching one of these (same forms).
        strict: Raise instead of reporting when something could not be replaced.
        example_inputs: Optional input (or tuple of inputs) for one ``no_grad`` eval-mode forward
            that looks for activations called as functions.

    Returns:
        A :class:`ReplacementReport`; ``print(report)`` gives a summary.

    Raises:
        ValueError: bits outside 1-4, ``model`` is itself an activation, or ``strict=True`` and an
            activation was skipped, called functionally, or an ``include`` pattern matched nothing.
        TypeError: ``model`` is not an ``nn.Module`` or a selector has the wrong type.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())
        >>> report = replace_activations(model, bits=2)
        >>> type(model[1]).__name__, report.replaced[0].bits
        ('FewBitGELU', 2)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: expected an nn.Module")
    bits = check_bits(bits)
    include_ = _check_selectors(include, "include")
    exclude_ = _check_selectors(exclude, "exclude")
    if spec_for_module(model) is not None:
        raise ValueError(
            f"model={type(model).__name__}: the model is itself an activation and cannot be "
            f"replaced in place; use quant.fewbit.convert_activation(model, bits={bits})"
        )
    order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    replaced, skipped = [], []
    used_patterns: set[int] = set()
    done: dict[int, nn.Module] = {}  # a module registered under several names is converted once
    for parent_name, parent in list(model.named_modules()):
        # _modules, not named_children(): a module registered under two names must be swapped
        # under both
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            spec = spec_for_module(child)
            if isinstance(child, _FewBitActivation):
                continue
            if spec is None:
                base = next((s for s in ACTIVATIONS.values() if isinstance(child, s.module)), None)
                if base is not None:
                    skipped.append(SkippedActivation(
                        name, type(child).__name__,
                        f"subclass of nn.{base.module.__name__}; its forward may differ, so it "
                        f"was left alone (convert it explicitly if it computes the same)",
                    ))
                elif type(child) in UNSUPPORTED_ACTIVATIONS:
                    skipped.append(SkippedActivation(
                        name, type(child).__name__, UNSUPPORTED_ACTIVATIONS[type(child)]
                    ))
                continue
            used_patterns.update(i for i, s in enumerate(include_) if _matches(s, name, child))
            if not _selected(name, child, include_, exclude_):
                continue
            new = done.get(id(child))
            if new is None:
                new = convert_activation(child, bits=bits, device=_table_device(model, parent))
                done[id(child)] = new
            setattr(parent, child_name, new)
            replaced.append(
                ReplacedActivation(name, type(child).__name__, type(new).__name__, new.bits)
            )
    unmatched = tuple(
        str(s) for i, s in enumerate(include_) if i not in used_patterns
    )
    replaced.sort(key=lambda r: order.get(r.name, len(order)))
    skipped.sort(key=lambda r: order.get(r.name, len(order)))
    functional = _find_functional_calls(model, example_inputs) if example_inputs is not None else ()
    report = ReplacementReport(
        bits=bits,
        replaced=tuple(replaced),
        skipped=tuple(skipped),
        functional=functional,
        functional_checked=example_inputs is not None,
        unmatched=unmatched,
    )
    if strict and not report.complete:
        raise ValueError(
            f"replace_activations(strict=True): not every activation could be replaced:\n"
            f"{report}\nfix these, or pass strict=False to accept a partial replacement"
        )
    return report
