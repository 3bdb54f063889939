"""``InterpolatedAdjointCallback``: train a model's neural-ODE blocks with the interpolated adjoint
(Daulbaev et al., "Interpolation Technique to Speed Up Gradients Propagation in Neural ODEs",
NeurIPS 2020) during ``fit``, log their function-evaluation counts, and optionally check their
gradients against a tight-tolerance reference.

Import it from the public entry point::

    from integrations.lightning import InterpolatedAdjointCallback
    Trainer(callbacks=[InterpolatedAdjointCallback(n_nodes=17, check_every_n_steps=100)])

NOTE [ Per-block gradient check ]
    Every ``check_every_n_steps`` training steps the callback records, for each ODE block, its
    first input of the step and the gradient arriving at its output. After backward (parameters
    not yet updated) it computes the block's vector-Jacobian product twice — with the block's
    current (interpolated) settings and with ``grad="backprop"`` at ``check_rtol`` — and logs the
    relative difference of the two (input and parameter gradients together). Re-running the
    block in isolation keeps the check exact even when the parameters' ``.grad`` also holds
    other contributions, never touches ``.grad``, and needs neither the batch nor the loss.

NOTE [ Switching before remat's warmup ]
    The blocks are switched in ``setup("fit")``, which Lightning runs for every callback before
    any ``on_fit_start``: ``HiRemateCallback``'s warmup step (whose measured peak a percentage
    budget is of) then runs the blocks as they train, whatever the order of the callbacks list.
    Blocks created later (``configure_model``) are switched at ``on_fit_start``. A block is never
    inside a rematerialized graph: its solve branches on tensor values (step control and
    checks), which no captured graph can express, so ``HiRemateCallback`` leaves a target holding one
    unmodified (with a warning; an error with ``strict=True``) and the per-step hooks here always
    run. To rematerialize the rest of such a model, name the modules around the block:
    ``HiRemateCallback(module=["encoder", "head"])``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from typing_extensions import override  # Lightning's own dependency
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_info
    from lightning.pytorch.utilities.seed import isolate_rng
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "InterpolatedAdjointCallback needs Lightning; install it with "
        'pip install "hiremate[lightning]"'
    ) from e

from ode import ODEBlock, SolveConfig

__all__ = ["InterpolatedAdjointCallback"]


@dataclass
class _Tracked:
    """One ODE block under the callback: what to restore, and this step's records."""

    name: str
    block: ODEBlock
    saved_config: SolveConfig
    saved_name: str | None
    handle: Any = None
    stats: list = field(default_factory=list)
    check_input: torch.Tensor | None = None
    check_grad: torch.Tensor | None = None


class InterpolatedAdjointCallback(Callback):
    """Switch every :class:`ode.ODEBlock` of the model to ``grad="interpolated"`` for ``fit``.

    At ``setup("fit")`` (NOTE [ Switching before remat's warmup ]) the callback finds the model's
    ODE blocks, replaces their solver settings (keeping whatever is not overridden here), names
    them by module path for error messages, and logs one table on rank 0; at the end of fit (or
    on an exception) it restores each block's settings. During training it logs, per step, the
    summed forward and backward function evaluations of all blocks (``ode/forward_nfe``,
    ``ode/backward_nfe``) and the largest interpolation error estimate (``ode/interp_error``).
    Every rank makes the same decisions.

    Args:
        n_nodes: Nodes per output interval (odd); ``None`` keeps each block's own.
        rtol: Solver relative tolerance; ``None`` keeps each block's own.
        atol: Solver absolute tolerance; ``None`` keeps each block's own.
        on_interp_error: ``"warn"``, ``"raise"``, ``"refine"`` or ``"fallback"``; ``None`` keeps
            each block's own.
        interp_tol: Threshold of the error estimate; ``None`` keeps each block's own.
        check_every_n_steps: Check the blocks' gradients against a tight-tolerance backprop
            reference every this many training steps (0: never). See NOTE [ Per-block gradient
            check ]; the result is logged as ``ode/grad_rel_error``.
        check_rtol: Relative tolerance of the reference solve (``atol`` is 1e-3 of it).
        check_warn_above: Warn when a checked relative gradient error exceeds this.
        log_stats: Log the function-evaluation counts and error estimate each step.

    Raises:
        ValueError: on invalid settings (at construction, before training starts).

    Example:
        >>> trainer = Trainer(max_epochs=5, callbacks=[InterpolatedAdjointCallback(n_nodes=17)])
        >>> trainer.fit(model)  # model holds ode.ODEBlock modules
    """

    def __init__(
        self,
        *,
        n_nodes: int | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        on_interp_error: str | None = None,
        interp_tol: float | None = None,
        check_every_n_steps: int = 0,
        check_rtol: float = 1e-7,
        check_warn_above: float = 1e-2,
        log_stats: bool = True,
    ):
        overrides = {"grad": "interpolated", "n_nodes": n_nodes, "rtol": rtol, "atol": atol,
                     "on_interp_error": on_interp_error, "interp_tol": interp_tol}
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        SolveConfig(**self.overrides)  # validate now, not at fit time
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 0:
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r}: must be an integer "
                             ">= 0 (0 disables the gradient check); pass e.g. 100")
        if isinstance(check_rtol, bool) or not isinstance(check_rtol, (int, float)) \
                or not check_rtol > 0:
            raise ValueError(f"check_rtol={check_rtol!r}: must be a positive number such as 1e-7 "
                             "(the reference solve's relative tolerance)")
        if not isinstance(check_warn_above, (int, float)) or not check_warn_above > 0:
            raise ValueError(f"check_warn_above={check_warn_above!r}: must be a positive number "
                             "such as 1e-2")
        self.check_every_n_steps = check_every_n_steps
        self.check_rtol = float(check_rtol)
        self.check_warn_above = float(check_warn_above)
        self.log_stats = bool(log_stats)
        self._tracked: list[_Tracked] = []
        self._check_armed = False
        self._checking = False
        self.last_check: dict[str, float] = {}

    # -- switching -----------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._restore()  # a second fit with the same callback starts clean
        self._switch(pl_module)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._switch(pl_module)  # blocks created after setup (configure_model)
        if not self._tracked:
            warnings.warn(
                f"InterpolatedAdjointCallback: {type(pl_module).__name__} has no ode.ODEBlock "
                "modules, so nothing was switched; build the model's neural-ODE layers with "
                "ode.ODEBlock", UserWarning, stacklevel=2)

    def _switch(self, pl_module: "pl.LightningModule") -> None:
        """Switch the blocks not switched yet and log them."""
        known = {id(tracked.block) for tracked in self._tracked}
        new = []
        for name, module in pl_module.named_modules():
            if not isinstance(module, ODEBlock) or id(module) in known:
                continue
            tracked = _Tracked(name=name or type(pl_module).__name__, block=module,
                               saved_config=module.config, saved_name=module.name)
            module.config = module.config.replace(**self.overrides)
            if module.name is None:
                module.name = tracked.name
            tracked.handle = module.register_forward_hook(self._make_hook(tracked))
            known.add(id(module))
            new.append(tracked)
        if new:
            self._tracked += new
            rank_zero_info(self._summary(new))

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._restore()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                     exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for tracked in self._tracked:
            tracked.block.config = tracked.saved_config
            tracked.block.name = tracked.saved_name
            if tracked.handle is not None:
                tracked.handle.remove()
        self._tracked = []

    def _summary(self, tracked: list[_Tracked]) -> str:
        rows = [("block", "was", "now", "n_nodes", "rtol", "atol", "on_interp_error")]
        for tr in tracked:
            c, old = tr.block.config, tr.saved_config
            rows.append((tr.name, old.grad, c.grad, str(c.n_nodes), f"{c.rtol:g}", f"{c.atol:g}",
                         c.on_interp_error))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
        return "InterpolatedAdjointCallback: ODE blocks during fit\n" + "\n".join(lines)

    # -- per-step records ----------------------------------------------------------------------

    def _make_hook(self, tracked: _Tracked):
        def hook(module: ODEBlock, args, output):
            if self._checking or not (module.training and torch.is_grad_enabled()):
                return
            tracked.stats.append(module.last_stats)
            if self._check_armed and tracked.check_input is None and torch.is_tensor(output) \
                    and output.requires_grad:
                tracked.check_input = args[0].detach()

                def keep_grad(grad):
                    tracked.check_grad = grad.detach()

                output.register_hook(keep_grad)

        return hook

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        k = self.check_every_n_steps
        self._check_armed = bool(k) and trainer.global_step % k == 0
        for tracked in self._tracked:
            tracked.stats = []
            tracked.check_input = tracked.check_grad = None

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = [s for tracked in self._tracked for s in tracked.stats if s is not None]
        if not (self.log_stats and stats):
            return
        values = {
            "ode/forward_nfe": float(sum(s.forward_nfe for s in stats)),
            "ode/backward_nfe": float(sum(s.backward_nfe for s in stats)),
        }
        errors = [s.interp_error for s in stats if s.interp_error is not None]
        if errors:
            values["ode/interp_error"] = float(max(errors))
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    # -- gradient check ------------------------------------------------------------------------

    @override
    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self._check_armed:
            return
        self._check_armed = False
        results = {}
        for tracked in self._tracked:
            if tracked.check_input is not None and tracked.check_grad is not None:
                results[tracked.name] = self._check_block(tracked)
        if not results:
            return
        self.last_check = results
        worst = max(results.values())
        pl_module.log("ode/grad_rel_error", worst, on_step=True, on_epoch=False, batch_size=1)
        if worst > self.check_warn_above:
            name = max(results, key=results.get)
            warnings.warn(
                f"InterpolatedAdjointCallback: gradient check at step {trainer.global_step}: "
                f"{name}'s interpolated-adjoint gradient differs from a backprop reference at "
                f"rtol={self.check_rtol:g} by {worst:.3g} (relative), above "
                f"check_warn_above={self.check_warn_above:g}; tighten rtol/atol or store more "
                "nodes (n_nodes)", UserWarning, stacklevel=2)

    def _check_block(self, tracked: _Tracked) -> float:
        block = tracked.block
        params = [p for p in block.parameters() if p.requires_grad]
        config, last_stats = block.config, block.last_stats
        reference = config.replace(grad="backprop", rtol=self.check_rtol,
                                   atol=self.check_rtol * 1e-3)
        grads = []
        self._checking = True
        try:
            for cfg in (config, reference):
                block.config = cfg
                x = tracked.check_input.clone().requires_grad_(True)
                with isolate_rng(), torch.enable_grad():
                    y = block(x)
                    g = torch.autograd.grad(y, [x, *params], tracked.check_grad,
                                            allow_unused=True)
                grads.append(torch.cat([
                    (torch.zeros_like(p) if gi is None else gi).reshape(-1)
                    for gi, p in zip(g, [x, *params])]))
        finally:
            block.config, block.last_stats = config, last_stats
            self._checking = False
        got, ref = grads
        return float((got - ref).norm() / ref.norm().clamp_min(torch.finfo(ref.dtype).tiny))
