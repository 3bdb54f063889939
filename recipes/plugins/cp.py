"""Plugin section ``cp:``: quantized CP factorization of conv/linear layers by ADMM
(``CPCompressionCallback``).

Example (YAML)::

    cp:
      enabled: true
      bits: 4                       # 2..8 bits per factor value
      rate: 2.0                     # parameter reduction of each compressed layer
      when: 200                     # fit_start | fit_end | a step: compress, then fine-tune
      include: [net.features.*]     # glob patterns on module names
      exclude: [net.features.0]     # the 1-channel first conv is too small to gain

With ``remat.enabled: true`` as well, ``when`` must be ``fit_start`` (the CP layers are made
before remat captures the network) or ``fit_end``; a step count is refused when ``fit`` starts,
since remat's compiled graph would keep training the dense layers replaced mid-fit.

Paper: Cherniuk, Abukhovich, Phan, Oseledets, Cichocki, Gusak, "Quantization Aware Factorization
for Deep Neural Network Compression", 2023.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from recipes.errors import InvalidValue
from recipes.registry import Plugin, import_callback

# kept in sync with quant.cp (the callback re-checks everything when it is built)
_MIN_BITS, _MAX_BITS = 2, 8
_WHENS = ("fit_start", "fit_end")


def _check_patterns(name: str, value: Any) -> None:
    names = [value] if isinstance(value, str) else value
    if value is not None and not (isinstance(names, list) and names and
                                  all(isinstance(n, str) and n for n in names)):
        raise InvalidValue(name, value, "expected null, a glob pattern such as net.features.*, "
                                        "or a list of them")


@dataclass
class CPConfig:
    """The ``cp:`` section; the fields after ``enabled`` are ``CPCompressionCallback``'s arguments.

    Attributes:
        enabled: Add the callback to the run.
        rate: Parameter reduction per compressed layer (> 1); sets each layer's CP rank.
        bits: Bit width of the factors, 2..8.
        rank: One CP rank for every layer instead of ``rate``, or ``null``.
        include: Glob pattern(s) of module names to compress (``null``: every Conv2d/Linear).
        exclude: Glob pattern(s) of module names to leave dense.
        when: ``fit_start`` (compress the initial model, then train), ``fit_end`` (compress the
            trained model) or a step count ``k`` (train k steps, compress, fine-tune for the rest).
        freeze_at_end: Turn the fine-tuned factors into int8 codes at the end of fit.
        max_iter: Outer ADMM iterations per layer.
        seed: Seed of the solver's initialisation.
    """

    enabled: bool = False
    rate: float = 2.0
    bits: int = 8
    rank: Optional[int] = None
    include: Any = None
    exclude: Any = None
    when: Any = "fit_start"
    freeze_at_end: bool = True
    max_iter: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if not _MIN_BITS <= self.bits <= _MAX_BITS:
            raise InvalidValue("bits", self.bits, f"expected an int in [{_MIN_BITS}, {_MAX_BITS}]")
        if not self.rate > 1:
            raise InvalidValue("rate", self.rate, "expected a float > 1 (parameters before/after)")
        if self.rank is not None and self.rank < 1:
            raise InvalidValue("rank", self.rank, "expected null or an int >= 1")
        if isinstance(self.when, bool) or not (
                self.when in _WHENS or (isinstance(self.when, int) and self.when >= 0)):
            raise InvalidValue("when", self.when,
                               "expected fit_start, fit_end or a step count (an int >= 0)")
        _check_patterns("include", self.include)
        _check_patterns("exclude", self.exclude)
        if self.max_iter < 0:
            raise InvalidValue("max_iter", self.max_iter, "expected an int >= 0")


def make_callback(cfg: CPConfig) -> Any:
    """Build ``CPCompressionCallback`` from the section (called only when ``cfg.enabled``)."""
    callback_cls = import_callback("cp", "CPCompressionCallback")
    return callback_cls(
        rate=cfg.rate,
        bits=cfg.bits,
        rank=cfg.rank,
        include=cfg.include,
        exclude=cfg.exclude,
        when=cfg.when,
        freeze_at_end=cfg.freeze_at_end,
        max_iter=cfg.max_iter,
        seed=cfg.seed,
    )


def check(cfg: CPConfig, recipe: Any) -> None:
    """With ``remat`` enabled too, compressing at a step count is refused when the recipe is
    loaded (the callback would refuse it when ``fit`` starts)."""
    remat = getattr(recipe, "remat", None)
    if isinstance(cfg.when, int) and remat is not None and remat.enabled:
        raise InvalidValue("when", cfg.when,
                           "with remat.enabled=true the CP layers must exist before remat "
                           "captures the network (its compiled graph would keep training the "
                           "dense layers replaced mid-fit); use when=fit_start or when=fit_end, "
                           "or disable remat")


PLUGIN = Plugin(
    config=CPConfig,
    make_callback=make_callback,
    check=check,
    order=20,  # replaces layers (in setup, so remat captures them in any order)
    description="quantized CP factorization of conv/linear layers by ADMM (CPCompressionCallback)",
)
