"""``FewBitCallback``: train with few-bit activation gradients (Novikov et al., "Few-Bit Backward:
Quantized Gradients of Activation Functions for Memory Footprint Reduction", ICML 2022).

Import it from the public entry point::

    from integrations.lightning import FewBitCallback
    Trainer(callbacks=[FewBitCallback(bits=2)])

At ``on_fit_start`` the callback swaps the LightningModule's ``nn.*`` activation modules for their
``FewBit*`` versions (:func:`quant.fewbit.replace_activations`; parameters, ``state_dict`` keys and
forward outputs unchanged) and logs what it swapped and what it could not. During the first training
step it measures the bytes saved for backward and what the exact activations would have saved in
the same step (:class:`quant.fewbit.FewBitMemoryMeter`), and logs the reduction.

The swapped modules stay in the model after ``fit``: they subclass the torch modules, and in eval
mode or without gradients they *are* the torch forward, so validation, testing and inference are
unchanged.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional, Union

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        'FewBitCallback needs Lightning; install it with pip install "hiremate[lightning]"'
    ) from e

from quant.fewbit import FewBitMemoryMeter, FewBitMemoryReport, ReplacementReport
from quant.fewbit import replace_activations
from quant.fewbit._checks import check_bits
from quant.fewbit.replace import _check_selectors

__all__ = ["FewBitCallback"]

log = logging.getLogger(__name__)

Selector = Union[str, type]


class FewBitCallback(Callback):
    """Replace the model's activations by few-bit ones at the start of ``fit``.

    Every rank makes the same replacement (it depends only on the model), and rank 0 logs one
    summary. The replacement report and the measured memory report are kept in the callback's
    checkpoint state.

    Args:
        bits: Bits per element for fitted derivatives (GELU, SiLU, Tanh, ...): 1-4. Two-valued
            derivatives (ReLU & co.) always use 1 exact bit.
        include: Only replace these (``nn.Module`` classes or name/class-name patterns, see
            :func:`quant.fewbit.replace_activations`).
        exclude: Never replace these.
        strict: Fail the fit when an activation module could not be replaced.
        measure: Measure saved bytes during the first training step and log the reduction.

    Raises:
        ValueError: bits outside 1-4.
        TypeError: a selector is neither a string nor an ``nn.Module`` class.

    Example:
        >>> Trainer(callbacks=[FewBitCallback(bits=2, exclude=["head.*"])])  # doctest: +SKIP
    """

    def __init__(
        self,
        bits: int = 2,
        *,
        include: Optional[Sequence[Selector]] = None,
        exclude: Optional[Sequence[Selector]] = None,
        strict: bool = False,
        measure: bool = True,
    ) -> None:
        self.bits = check_bits(bits)
        self.include = _check_selectors(include, "include") or None
        self.exclude = _check_selectors(exclude, "exclude") or None
        self.strict = bool(strict)
        self.measure = bool(measure)
        self.report: Optional[ReplacementReport] = None
        self.memory_report: Optional[FewBitMemoryReport] = None
        self._meter: Optional[FewBitMemoryMeter] = None
        self._measured = False

    # ---- fit start: replace ----------------------------------------------------------------------

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.report = replace_activations(
            pl_module, self.bits, include=self.include, exclude=self.exclude, strict=self.strict
        )
        rank_zero_info(str(self.report))
        if not self.report.replaced:
            rank_zero_info("FewBitCallback: no activation module was replaced")

    # ---- first training step: measure ------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if self.measure and not self._measured and self._meter is None:
            self._meter = FewBitMemoryMeter(pl_module)
            self._meter.__enter__()

    def _finish_measurement(self) -> None:
        if self._meter is None:
            return
        meter, self._meter = self._meter, None
        meter.__exit__(None, None, None)
        self._measured = True
        self.memory_report = meter.report()
        rank_zero_info(f"FewBitCallback, first training step: {self.memory_report}")

    def on_before_backward(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any
    ) -> None:
        self._finish_measurement()  # the forward is complete; backward frees what it saved

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        self._finish_measurement()  # steps without a backward hook (manual optimization)

    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)

    # ---- checkpoint state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"bits": self.bits}
        if self.report is not None:
            state["replaced"] = [(r.name, r.original, r.bits) for r in self.report.replaced]
        if self.memory_report is not None:
            m = self.memory_report
            state["memory"] = {
                "saved_bytes": m.saved_bytes, "exact_bytes": m.exact_bytes, "calls": m.calls,
                "codes_bytes": m.codes_bytes,
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("bits", self.bits) != self.bits:
            log.warning(
                "FewBitCallback: the checkpoint was trained with bits=%s, this run uses bits=%s",
                state_dict["bits"], self.bits,
            )
        memory = state_dict.get("memory")
        if memory is not None and self.memory_report is None:
            self.memory_report = FewBitMemoryReport(**memory)
            self._measured = True  # already measured in the run that saved the checkpoint
