"""Plugin section ``fewbit:``: few-bit activation gradients (``FewBitCallback``).

Example (YAML)::

    fewbit:
      enabled: true
      bits: 2                    # 1..4 bits per element for GELU, SiLU, Tanh, ...
      exclude: [net.head.*]      # glob patterns on module names, or class names (GELU)

With ``remat.enabled: true`` as well, remat captures the few-bit network, and the saving is
measured on remat's eager warmup step (the compiled steps keep what remat's schedule chooses).

Paper: Novikov, Bershatsky, Gusak, Shonenkov, Dimitrov, Oseledets, "Few-Bit Backward: Quantized
Gradients of Activation Functions for Memory Footprint Reduction", ICML 2022.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recipes.errors import InvalidValue
from recipes.registry import Plugin, import_callback

# kept in sync with quant.fewbit.SUPPORTED_BITS (the callback re-checks when it is built)
_BITS = (1, 2, 3, 4)


def _check_patterns(name: str, value: Any) -> None:
    names = [value] if isinstance(value, str) else value
    if value is not None and not (isinstance(names, list) and names and
                                  all(isinstance(n, str) and n for n in names)):
        raise InvalidValue(name, value, "expected null, a glob pattern such as net.blocks.*, "
                                        "a class name such as GELU, or a list of them")


@dataclass
class FewBitConfig:
    """The ``fewbit:`` section; the fields after ``enabled`` are ``FewBitCallback``'s arguments.

    Attributes:
        enabled: Add the callback to the run.
        bits: Bits per element kept for backward by fitted activations (GELU, SiLU, ...), 1..4;
            two-valued ones (ReLU, LeakyReLU, ...) always use 1 exact bit.
        include: Glob pattern(s) on module names or class names to replace (``null``: every
            supported activation module).
        exclude: Glob pattern(s) of modules to leave exact.
        strict: Fail the run when an activation module cannot be replaced.
        measure: Measure the saved bytes in one eager training forward (the first step's, or
            remat's warmup step with ``remat.enabled``) and print the reduction.
    """

    enabled: bool = False
    bits: int = 2
    include: Any = None
    exclude: Any = None
    strict: bool = False
    measure: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in _BITS:
            raise InvalidValue("bits", self.bits, f"expected one of {', '.join(map(str, _BITS))}")
        _check_patterns("include", self.include)
        _check_patterns("exclude", self.exclude)


def make_callback(cfg: FewBitConfig) -> Any:
    """Build ``FewBitCallback`` from the section (called only when ``cfg.enabled``)."""
    callback_cls = import_callback("fewbit", "FewBitCallback")
    return callback_cls(
        bits=cfg.bits, include=cfg.include, exclude=cfg.exclude, strict=cfg.strict,
        measure=cfg.measure,
    )


PLUGIN = Plugin(
    config=FewBitConfig,
    make_callback=make_callback,
    order=10,  # replaces activation modules (in setup, so remat captures them in any order)
    description="few-bit activation gradients, 1-4 bits per element (FewBitCallback)",
)
