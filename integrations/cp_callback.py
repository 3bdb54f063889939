"""Lightning callback: factorize Conv2d/Linear layers into quantized CP layers (and fine-tune).

Users import it from :mod:`integrations.lightning`::

    from integrations.lightning import CPCompressionCallback
    Trainer(callbacks=[CPCompressionCallback(rate=2.0, bits=4)]).fit(model, data)

A thin adapter over :mod:`quant.cp` (Cherniuk et al., "Quantization Aware Factorization for Deep
Neural Network Compression", 2023). See NOTE [ When the callback acts ] and
NOTE [ Resuming a compressed run ].
"""
from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from typing_extensions import override  # Lightning's own dependency
    from lightning.pytorch.utilities import move_data_to_device, rank_zero_info
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        'CPCompressionCallback needs Lightning: pip install "hiremate[lightning]"'
    ) from e

from integrations._remat_modules import remat_modules
from quant.cp import (
    CompressionPlan,
    CompressionReport,
    CPConv2d,
    CPLinear,
    add_flops,
    apply_plan,
    plan_compression,
    plan_from_state_dict,
    qbounds,
    solve_compressed,
    stored_trainable,
    warn_high_error,
    warn_skipped,
)

__all__ = ["CPCompressionCallback"]

# NOTE [ When the callback acts ]
# An optimizer holds references to parameter objects: CP layers created after it exists are
# silently not trained. Hence:
# * when="fit_start": setup(stage="fit") runs before Lightning builds the optimizers, moves the
#   model and wraps it for DDP. The callback swaps the layers for *empty* trainable CP layers
#   there (plan only, no solving), so the optimizer built afterwards holds their parameters.
#   on_fit_start (after any checkpoint restore) solves each layer by ADMM and writes the values in
#   place -- same parameter objects -- then broadcasts them from rank 0. on_fit_end freezes the
#   factors to int8 codes (freeze_at_end=True).
# * when=<int k>: after k optimizer steps (on_train_batch_start), the trained layers are
#   compressed and the optimizers and LR schedulers rebuilt through the strategy, the schedulers
#   advanced to the current step so the schedule continues. Replacing layers under a DDP wrapper
#   would leave them out of gradient synchronisation, so this mode refuses world_size > 1.
# * when="fit_end": on_fit_end compresses the trained model (no fine-tuning).
# The plan is a pure function of the layer shapes and the options: every rank builds the same.
#
# NOTE [ CP layers under remat ]
# HiRemateCallback captures the network in its on_fit_start, whichever place it has in the
# callbacks list. With when="fit_start" the CP layers exist from setup, so the capture holds
# them (their ops, shapes and saved values) in either order. The ADMM values may be written
# after the capture (HiRemateCallback listed first): the compiled graph reads the factors and
# scales as the tensors they are (the RematModule shares them), never as constants, so the
# training steps compute with the solved values and the gradients are the CP-only run's; only
# remat's warmup step ran on the empty (zero) factors, whose memory and shapes are the same.
# When no example_input_array gives the FLOPs, the layers' shapes are recorded on their first
# eager forward by hooks registered in setup: remat's warmup step, or the first training step
# (the hooks return at once while dynamo traces them, and never run inside a compiled graph).
# when=<int k> would replace layers mid-fit that the compiled graph keeps using, so it is
# refused with HiRemateCallback (in setup); when="fit_end" compresses the user's modules, which
# HiRemateCallback has put back at on_train_end, before any on_fit_end.
#
# NOTE [ Resuming a compressed run ]
# Lightning restores the model's state_dict before the callback's own state. A checkpoint saved
# after compression holds CP factors where the freshly built model still has dense layers, so the
# callback registers a load_state_dict pre-hook on the LightningModule (in setup) that reads the
# CP layers off the incoming keys (quant.cp.plan_from_state_dict) and builds them just before the
# tensors are copied. The optimizer is built after the restore, so it holds the right parameters,
# and nothing is solved again: the restored callback state marks the compression as done.

_MODES = ("fit_start", "fit_end")


def _has_remat_callback(trainer: Any) -> bool:
    """Whether a ``HiRemateCallback`` is among the Trainer's callbacks (none can be when its
    module was never imported)."""
    module = sys.modules.get("integrations.remat_callback")
    cls = getattr(module, "HiRemateCallback", None)
    return cls is not None and any(isinstance(cb, cls) for cb in getattr(trainer, "callbacks", ()))


def _refuse_remat_modules(pl_module: nn.Module, when: str | int) -> None:
    """Raise when layers would be replaced inside a captured ``remat.RematModule``."""
    names = [n for n, _ in remat_modules(pl_module)]
    if names:
        raise ValueError(
            f"CPCompressionCallback(when={when!r}): {', '.join(names)} is rematerialized (a "
            "remat.RematModule): its compiled graph would keep computing with the dense layers "
            "replaced now. Use when='fit_start' (the CP layers are made in setup, before "
            "HiRemateCallback captures) or compress before remat.rematerialize"
        )


def _check_when(when: object) -> str | int:
    if isinstance(when, bool) or not (when in _MODES or (isinstance(when, int) and when >= 0)):
        raise ValueError(
            f"when={when!r}: expected 'fit_start' (compress, then fine-tune), 'fit_end' (compress "
            "the trained model) or an int k >= 0 (compress after k optimizer steps, then "
            "fine-tune for the rest of fit)"
        )
    return when  # type: ignore[return-value]


class CPCompressionCallback(pl.Callback):
    """Replace ``Conv2d``/``Linear`` layers by quantized CP layers during ``Trainer.fit``.

    Cherniuk et al., "Quantization Aware Factorization for Deep Neural Network Compression"
    (2023). The layers are factorized by ADMM with every factor on a ``bits``-bit grid, then
    (``when="fit_start"`` or an int step) fine-tuned quantization-aware (straight-through), or
    (``when="fit_end"``) the trained model is factorized after training. The report (per-layer
    rank, parameters, FLOPs, errors) is logged on rank 0 and kept in :attr:`report`, with the
    metrics last logged before compression in :attr:`metrics_before`. FLOPs are measured when the
    LightningModule defines ``example_input_array``.

    With ``HiRemateCallback`` in the same Trainer (either order), ``when="fit_start"`` and
    ``"fit_end"`` work and ``when=<int>`` is refused (NOTE [ CP layers under remat ]).

    Checkpoints saved after compression resume without re-solving. To load one into a fresh model
    outside ``Trainer.fit``: ``quant.cp.load_compressed(model, checkpoint["state_dict"])``.

    Args:
        rate: parameter reduction per layer when no rank is given (> 1).
        bits: bit width of the factors, in ``[2, 8]``.
        rank: one rank for all layers, ``{layer name: rank}``, or ``None``.
        include: glob pattern(s) of module names (relative to the LightningModule, e.g.
            ``"net.features.*"``) to consider; default all ``Conv2d``/``Linear``.
        exclude: glob pattern(s) of module names to leave dense (e.g. the first conv).
        when: ``"fit_start"``, ``"fit_end"``, or an int ``k``: compress after ``k`` optimizer
            steps and fine-tune for the rest of fit (single process only).
        freeze_at_end: turn fine-tuned factors into int8 codes at the end of fit.
        max_iter: outer ADMM iterations per layer.
        seed: seed of the solver's initialisation.

    Raises:
        ValueError: invalid ``bits``, ``rate``, ``rank``, ``when`` or ``max_iter``.

    Example:
        >>> cb = CPCompressionCallback(bits=4, when=200, exclude="net.features.0")
        >>> pl.Trainer(max_steps=300, callbacks=[cb]).fit(model, data)  # doctest: +SKIP
        >>> print(cb.report.summary())  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        rate: float = 2.0,
        bits: int = 8,
        rank: int | Mapping[str, int] | None = None,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        when: str | int = "fit_start",
        freeze_at_end: bool = True,
        max_iter: int = 50,
        seed: int = 0,
    ) -> None:
        qbounds(bits)  # validates bits
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 1:
            raise ValueError(f"rate={rate!r}: the compression rate must be > 1; pass e.g. rate=2.0")
        if rank is not None and not isinstance(rank, Mapping):
            if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
                raise ValueError(f"rank={rank!r}: expected a positive int, a {{name: rank}} "
                                 "mapping or None")
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
            raise ValueError(f"max_iter={max_iter!r}: expected an int >= 0; pass e.g. max_iter=50")
        self.rate, self.bits, self.rank = rate, bits, rank
        self.include, self.exclude, self.when = include, exclude, _check_when(when)
        self.freeze_at_end, self.max_iter, self.seed = freeze_at_end, max_iter, seed
        self.report: CompressionReport | None = None
        self.metrics_before: dict[str, float] = {}
        self._plan: CompressionPlan | None = None
        self._originals: dict[str, nn.Module] = {}
        self._done = False  # compression solved (or restored) for the current module
        self._hook: Any = None
        self._shape_hooks: list[Any] = []
        self._shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    @override
    @property
    def state_key(self) -> str:
        return self._generate_state_key(rate=self.rate, bits=self.bits, when=self.when)

    # ------------------------------------------------------------------ helpers
    def _make_plan(self, pl_module: nn.Module) -> CompressionPlan:
        plan = plan_compression(pl_module, rate=self.rate, bits=self.bits, rank=self.rank,
                                include=self.include, exclude=self.exclude)
        warn_skipped(plan, stacklevel=4)
        return plan

    @staticmethod
    def _cp_layers(module: nn.Module) -> list[CPConv2d | CPLinear]:
        return [m for m in module.modules() if isinstance(m, (CPConv2d, CPLinear))]

    @staticmethod
    def _structure_pre_hook(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                            *args: Any) -> None:
        # NOTE [ Resuming a compressed run ]
        local = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        plan = plan_from_state_dict(module, local)
        if plan.layers:
            apply_plan(module, plan, trainable=stored_trainable(local))

    def _solve(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *,
               broadcast: bool = True) -> None:
        self.metrics_before = {k: float(v) for k, v in trainer.callback_metrics.items()
                               if isinstance(v, (int, float, torch.Tensor)) and
                               (not isinstance(v, torch.Tensor) or v.numel() == 1)}
        example = getattr(pl_module, "example_input_array", None)
        if example is not None:
            example = move_data_to_device(example, pl_module.device)
        self.report = solve_compressed(pl_module, self._originals, plan=self._plan,
                                       example_inputs=example, max_iter=self.max_iter,
                                       seed=self.seed)
        self._originals = {}
        self._done = True
        warn_high_error(self.report, stacklevel=3)
        if broadcast and trainer.world_size > 1:
            self._broadcast_factors(trainer, pl_module)
        text = self.report.summary()
        if example is None:
            if not self._shape_hooks:
                self._watch_shapes(pl_module, [r.name for r in self.report.layers])
            text += "\n(FLOPs will be measured on the CP layers' first training forward)"
        if self.metrics_before:
            shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(self.metrics_before.items()))
            text += (f"\nmetrics last logged before compression (compressed at step "
                     f"{trainer.global_step}): {shown}")
        rank_zero_info(text)

    def _watch_shapes(self, pl_module: pl.LightningModule, names: Sequence[str]) -> None:
        """Without ``example_input_array``: record the CP layers' shapes on their first eager
        forward (NOTE [ CP layers under remat ])."""
        self._shapes = {}
        for name in names:
            def record(_m: nn.Module, args: tuple, out: torch.Tensor, name: str = name) -> None:
                if torch.compiler.is_compiling():  # traced by remat's capture: not a forward
                    return
                self._shapes.setdefault(name, (tuple(args[0].shape), tuple(out.shape)))
            self._shape_hooks.append(pl_module.get_submodule(name).register_forward_hook(record))

    def _flops_from_shapes(self, pl_module: pl.LightningModule) -> None:
        if not self._shape_hooks or self.report is None:
            return
        if len(self._shapes) < len(self.report.layers):
            return
        for h in self._shape_hooks:
            h.remove()
        self._shape_hooks = []
        self.report = add_flops(self.report, pl_module, self._shapes)
        before, after = self.report.flops_before, self.report.flops_after
        rank_zero_info(
            f"CP compression: FLOPs/sample of the replaced layers {before:,} -> {after:,} "
            f"({before / after:.2f}x), measured on the layers' first training forward"
        )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._flops_from_shapes(pl_module)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._flops_from_shapes(pl_module)

    @staticmethod
    def _broadcast_factors(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Copy rank 0's factors and scales to every rank, in place."""
        tensors = {n: t for n, t in pl_module.state_dict(keep_vars=True).items()
                   if ".factors." in n and isinstance(t, torch.Tensor)}
        source = trainer.strategy.broadcast({n: t.detach().cpu() for n, t in tensors.items()},
                                            src=0)
        with torch.no_grad():
            for n, t in tensors.items():
                t.copy_(source[n].to(t.device))

    @staticmethod
    def _rebuild_optimizers(trainer: pl.Trainer) -> None:
        """New optimizers/schedulers over the current parameters, schedules at the current step."""
        trainer.strategy.setup_optimizers(trainer)
        with warnings.catch_warnings():
            # stepping a fresh scheduler before its optimizer has stepped is intended here
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            for config in trainer.lr_scheduler_configs:
                done = trainer.global_step if config.interval == "step" else trainer.current_epoch
                for _ in range(done // max(config.frequency, 1)):
                    config.scheduler.step()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is None:  # also lets trainer.validate/test(ckpt_path=...) load CP factors
            self._hook = pl_module.register_load_state_dict_pre_hook(self._structure_pre_hook)
        if stage != "fit":
            return
        if isinstance(self.when, int) and trainer.world_size > 1:
            raise ValueError(
                f"when={self.when}: compressing in the middle of fit replaces layers under the "
                f"{type(trainer.strategy).__name__} wrapper (world_size={trainer.world_size}), "
                "which would leave them out of gradient synchronisation; use when='fit_start' on "
                "a model trained in an earlier fit, or when='fit_end'"
            )
        if isinstance(self.when, int) and _has_remat_callback(trainer):
            raise ValueError(
                f"CPCompressionCallback(when={self.when}): compressing after {self.when} steps "
                "replaces layers that HiRemateCallback captures at the start of fit, and its "
                "compiled graph would keep training the dense ones. With HiRemateCallback use "
                "when='fit_start' (the CP layers are made in setup, before the capture, in either "
                "callback order) or when='fit_end' (in a recipe: cp.when=fit_start or fit_end, "
                "or remat.enabled=false)"
            )
        cp_layers = self._cp_layers(pl_module)
        if cp_layers:
            # fit again on an already compressed module: fine-tune the existing factors
            for layer in cp_layers:
                layer.unfreeze()
            self._done = True
            return
        self._done = False
        if self.when == "fit_start":
            _refuse_remat_modules(pl_module, self.when)
            self._plan = self._make_plan(pl_module)
            self._originals = apply_plan(pl_module, self._plan, trainable=True)
            if self._originals and getattr(pl_module, "example_input_array", None) is None:
                # NOTE [ CP layers under remat ]
                self._watch_shapes(pl_module, list(self._originals))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.when == "fit_start" and not self._done and self._originals:
            self._solve(trainer, pl_module)
        else:  # restored from a checkpoint: nothing to solve, no report to complete
            for h in self._shape_hooks:
                h.remove()
            self._shape_hooks = []
        self._originals = {}

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not isinstance(self.when, int) or self._done or trainer.global_step < self.when:
            return
        _refuse_remat_modules(pl_module, self.when)
        self._plan = self._make_plan(pl_module)
        self._originals = apply_plan(pl_module, self._plan, trainable=True)
        self._solve(trainer, pl_module)
        self._rebuild_optimizers(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.when == "fit_end" and not self._done:
            _refuse_remat_modules(pl_module, self.when)
            self._plan = self._make_plan(pl_module)
            self._originals = apply_plan(pl_module, self._plan, trainable=False)
            # after the strategy's teardown: no collectives; the CPU solve is deterministic
            self._solve(trainer, pl_module, broadcast=False)
        elif self.freeze_at_end:
            for layer in self._cp_layers(pl_module):
                layer.freeze()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if stage != "fit":  # shapes wait for the first forward, possibly in a later validate
            for h in self._shape_hooks:
                h.remove()
            self._shape_hooks = []

    # ------------------------------------------------------------------ checkpoint state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": None if self._plan is None else self._plan.to_dict(),
            "done": self._done,
            "metrics_before": dict(self.metrics_before),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("plan") is not None:
            self._plan = CompressionPlan.from_dict(state_dict["plan"])
        self._done = bool(state_dict.get("done", False))
        self.metrics_before = dict(state_dict.get("metrics_before", {}))
