"""``FewBitCallback``: train with few-bit activation gradients (Novikov et al., "Few-Bit Backward:
Quantized Gradients of Activation Functions for Memory Footprint Reduction", ICML 2022).

Import it from the public entry point::

    from integrations.lightning import FewBitCallback
    Trainer(callbacks=[FewBitCallback(bits=2)])

At ``setup("fit")`` the callback swaps the LightningModule's ``nn.*`` activation modules for their
``FewBit*`` versions (:func:`quant.fewbit.replace_activations`; parameters, ``state_dict`` keys and
forward outputs unchanged) and logs what it swapped and what it could not. It measures the bytes
saved for backward in one eager training forward and what the exact activations would have saved
in the same step (:class:`quant.fewbit.FewBitMemoryMeter`), and logs the reduction.

The swapped modules stay in the model after ``fit``: they subclass the torch modules, and in eval
mode or without gradients they *are* the torch forward, so validation, testing and inference are
unchanged.

NOTE [ Replacing before remat captures ]
    ``HiRemateCallback`` captures the network in its ``on_fit_start``, and Lightning calls
    ``on_fit_start`` in the order of the callbacks list. The swap therefore happens in
    ``setup("fit")``, which Lightning runs for every callback before any ``on_fit_start``: whatever
    the list order, remat's warmup step, its measured eager peak and its captured graph are those
    of the few-bit model (the autograd Function is traced into the graph; the packed codes are
    values its schedule saves or recomputes). Activation modules created after ``setup`` (in the
    LightningModule's ``setup`` or ``configure_model``) are swapped at ``on_fit_start``; if by then
    a ``remat.RematModule`` holds one, a swap could not reach its compiled graph, so the fit stops
    with a message saying to list ``FewBitCallback`` first.

NOTE [ Where the saving is measured ]
    The meter counts saved tensors with Python hooks on the few-bit modules, which do not run
    inside a rematerialized network's compiled graph. With ``HiRemateCallback`` in the Trainer the
    meter therefore runs during its eager warmup step (the step it measures and captures; see
    NOTE [ Callbacks that watch the warmup step ] in ``integrations/remat_callback.py``), whatever
    the list order, and the report says so: what the compiled steps keep (codes included) is the
    schedule's choice, reported in ``HiRemateCallback``'s table. Without remat the meter runs on
    the first training step's forward. The meter allocates nothing (NOTE [ Replaying on meta ] in
    ``quant/fewbit/memory.py``), so it does not change the warmup's measured peak.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

try:
    import lightning.pytorch as pl
    from typing_extensions import override  # Lightning's own dependency
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        'FewBitCallback needs Lightning; install it with pip install "hiremate[lightning]"'
    ) from e

from integrations._remat_modules import remat_modules
from quant.fewbit import FewBitMemoryMeter, FewBitMemoryReport, ReplacementReport
from quant.fewbit import replace_activations
from quant.fewbit._checks import check_bits
from quant.fewbit.modules import _FewBitActivation
from quant.fewbit.replace import _check_selectors, _selected

__all__ = ["FewBitCallback"]

log = logging.getLogger(__name__)

Selector = Union[str, type]

#: ``FewBitCallback.measured_on`` values.
WARMUP_STEP = "HiRemateCallback's eager warmup step"
FIRST_STEP = "the first training step"


class FewBitCallback(Callback):
    """Replace the model's activations by few-bit ones at the start of ``fit``.

    The swap happens in ``setup("fit")``, before any callback's ``on_fit_start``, so that
    ``HiRemateCallback`` captures the few-bit model whatever the order of the callbacks (NOTE
    [ Replacing before remat captures ]). Every rank makes the same replacement (it depends only
    on the model), and rank 0 logs one summary. The replacement report and the measured memory
    report are kept in the callback's checkpoint state.

    Args:
        bits: Bits per element for fitted derivatives (GELU, SiLU, Tanh, ...): 1-4. Two-valued
            derivatives (ReLU & co.) always use 1 exact bit.
        include: Only replace these (``nn.Module`` classes or name/class-name patterns, see
            :func:`quant.fewbit.replace_activations`).
        exclude: Never replace these.
        strict: Fail the fit when an activation module could not be replaced.
        measure: Measure saved bytes in one eager training forward and log the reduction: the
            first training step's, or ``HiRemateCallback``'s warmup step when the network is
            rematerialized (NOTE [ Where the saving is measured ]).

    Attributes:
        report: What was replaced (:class:`quant.fewbit.ReplacementReport`).
        memory_report: The measured :class:`quant.fewbit.FewBitMemoryReport`, or ``None``.
        measured_on: Which step ``memory_report`` was measured on: ``FIRST_STEP`` or
            ``WARMUP_STEP`` (module constants), or ``None``.

    Raises:
        ValueError: bits outside 1-4 (in ``__init__``). In ``setup``/``on_fit_start``: with
            ``strict=True``, an activation that cannot be replaced; an activation to replace
            inside a ``remat.RematModule`` (captured before the swap).
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
        self.measured_on: Optional[str] = None
        self._meter: Optional[FewBitMemoryMeter] = None
        self._measured = False

    # ---- setup: replace (NOTE [ Replacing before remat captures ]) ---------------------------

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._refuse_captured(pl_module)
        self.report = replace_activations(
            pl_module, self.bits, include=self.include, exclude=self.exclude, strict=self.strict
        )
        rank_zero_info(str(self.report))

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # activation modules created after setup (LightningModule.setup, configure_model)
        self._refuse_captured(pl_module)
        late = replace_activations(pl_module, self.bits, include=self.include,
                                   exclude=self.exclude, strict=False)
        known = {s.name for s in self.report.skipped} if self.report is not None else set()
        new_skips = [s for s in late.skipped if s.name not in known]
        if self.strict and new_skips:
            raise ValueError(
                "FewBitCallback(strict=True): activation modules created after setup could not "
                "be replaced: " + "; ".join(f"{s.name} ({s.kind}): {s.reason}" for s in new_skips)
            )
        if late.replaced:
            rank_zero_info(f"FewBitCallback, modules created after setup:\n{late}")
            if self.report is not None:
                late = dataclasses.replace(self.report,
                                           replaced=self.report.replaced + late.replaced)
            self.report = late
        if self.report is None or not self.report.replaced:
            rank_zero_info("FewBitCallback: no activation module was replaced")

    def _refuse_captured(self, pl_module: "pl.LightningModule") -> None:
        """Raise when an activation to replace is inside a captured ``remat.RematModule``."""
        for prefix, rm in remat_modules(pl_module):
            names = [f"{prefix}.{n}" for n, m in rm.named_modules()
                     if n and _selected(f"{prefix}.{n}", m, self.include or (), self.exclude or ())]
            if names:
                raise ValueError(
                    f"FewBitCallback: {prefix!r} is already rematerialized (a remat.RematModule), "
                    f"so replacing {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} now "
                    "would not reach its compiled graph. FewBitCallback replaces in setup, before "
                    "HiRemateCallback captures; modules created later (configure_model) are "
                    "replaced in on_fit_start, so list FewBitCallback before HiRemateCallback, or "
                    "call quant.fewbit.replace_activations before remat.rematerialize"
                )

    # ---- measure: NOTE [ Where the saving is measured ] ----------------------------------------

    @contextlib.contextmanager
    def remat_warmup(self, trainer: "pl.Trainer",
                     pl_module: "pl.LightningModule") -> Iterator[None]:
        """Measure during ``HiRemateCallback``'s eager warmup forward (NOTE [ Callbacks that
        watch the warmup step ] in ``integrations/remat_callback.py``)."""
        if not self.measure or self._measured or self._meter is not None:
            yield
            return
        self._meter = FewBitMemoryMeter(pl_module)
        self._meter.__enter__()
        try:
            yield  # a manual-optimization warmup ends with an exception after its forward
        finally:
            self._finish_measurement(WARMUP_STEP)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if not self.measure or self._measured or self._meter is not None:
            return
        hidden = [name for name, rm in remat_modules(pl_module)
                  if any(isinstance(m, _FewBitActivation) for m in rm.modules())]
        if hidden:  # a RematModule made outside HiRemateCallback: no eager step to measure
            self._measured = True
            rank_zero_info(
                f"FewBitCallback: not measured: the few-bit modules of {', '.join(hidden)} run "
                "inside a compiled remat.RematModule, where the meter's hooks do not run"
            )
            return
        self._meter = FewBitMemoryMeter(pl_module)
        self._meter.__enter__()

    def _finish_measurement(self, measured_on: str = FIRST_STEP) -> None:
        if self._meter is None:
            return
        meter, self._meter = self._meter, None
        meter.__exit__(None, None, None)
        self._measured = True
        self.memory_report, self.measured_on = meter.report(), measured_on
        if measured_on == WARMUP_STEP:
            rank_zero_info(
                f"FewBitCallback, measured on {WARMUP_STEP} (the rematerialized training steps "
                "keep what its schedule chooses, codes included; see its table): "
                f"{self.memory_report}"
            )
        else:
            rank_zero_info(f"FewBitCallback, first training step: {self.memory_report}")

    @override
    def on_before_backward(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: Any
    ) -> None:
        self._finish_measurement()  # the forward is complete; backward frees what it saved

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:
        self._finish_measurement()  # steps without a backward hook (manual optimization)

    @override
    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.__exit__(None, None, None)

    # ---- checkpoint state ------------------------------------------------------------------------

    @override
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
            state["measured_on"] = self.measured_on
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("bits", self.bits) != self.bits:
            log.warning(
                "FewBitCallback: the checkpoint was trained with bits=%s, this run uses bits=%s",
                state_dict["bits"], self.bits,
            )
        memory = state_dict.get("memory")
        if memory is not None and self.memory_report is None:
            self.memory_report = FewBitMemoryReport(**memory)
            self.measured_on = state_dict.get("measured_on", FIRST_STEP)
            self._measured = True  # already measured in the run that saved the checkpoint
