"""``HiRemateCallback``: keep a Lightning model's activation memory under a budget, exact gradients.

Import it from the public entry point::

    from integrations.lightning import HiRemateCallback
    Trainer(callbacks=[HiRemateCallback(budget="50%")])

At ``on_fit_start`` (after the strategy wrapped the model and the optimizers exist) the callback
runs the user's own ``training_step`` on one real batch as a warmup, recording the real call
arguments of the target networks; then it captures, profiles and solves each target with
:func:`remat.rematerialize` and swaps it for the resulting :class:`remat.RematModule`, which
shares the original's ``Parameter`` objects and ``state_dict`` keys (the optimizer keeps training
the same tensors; checkpoints load into the plain model). At the end of training the original
modules are put back. Papers: HiRemate (Gusak, Zhao, Le Hellard, Li, Eyraud-Dubois, Beaumont,
ICML 2025), Rockmate (Zhao et al., ICML 2023), Checkmate (Jain et al., MLSys 2020).

NOTE [ Where the example batch comes from ]
    The batch is read from a fresh iterator of the training dataloader, asked again from its
    source (``train_dataloader()`` of the DataModule/LightningModule, or the loader passed to
    ``fit``) inside an RNG-isolated block. The fit loop's own ``setup_data`` is *not* called
    early: it would move its RNG draws before the other ``on_fit_start`` hooks and, when resuming,
    before the loop state (and a stateful loader's position) is restored. Under DDP every rank
    reads the unsharded loader's first batch: only its shapes and dtypes matter (rank 0 times the
    ops on it; see NOTE [ Same plan on every rank ] in ``integrations/_remat_shared.py``).

NOTE [ Callbacks that watch the warmup step ]
    The training steps of a rematerialized network run compiled graphs, where Python hooks on its
    submodules do not run: the warmup is the one eager step of the network that is captured. A
    callback that needs to see an eager forward (``FewBitCallback`` measures what its activations
    save there) defines ``remat_warmup(trainer, pl_module)`` returning a context manager; this
    callback enters it around the warmup's ``training_step`` (the forward and the loss, not the
    backward), whatever the order of the callbacks list. It must not allocate device memory: the
    warmup's measured peak is what a percentage budget is of.

NOTE [ Composing with the other callbacks ]
    Callbacks that replace modules (``FewBitCallback``, ``CPCompressionCallback``) or change how
    they run (``InterpolatedAdjointCallback``) do so in ``setup("fit")``, which Lightning runs for
    every callback before any ``on_fit_start``: the warmup and the capture here see the network
    that trains, whatever the list order. The originals are put back at ``on_train_end`` (and,
    failing that, at ``teardown``), so that a callback acting in ``on_fit_end``
    (``CPCompressionCallback(when="fit_end")``) changes the user's modules, not the
    ``RematModule`` standing in for them. A target holding an ``ode.ODEBlock`` is not captured: its
    solve branches on tensor values (step control and checks; even a fixed-step method fails on a
    data-dependent guard), which one graph cannot express; it trains unmodified with a warning
    (``strict=True``: an error) and the modules around the block can be named with ``module=``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Sequence, Union

import torch

try:
    import lightning.pytorch as pl
    from typing_extensions import override  # Lightning's own dependency
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import CombinedLoader, rank_zero_info, rank_zero_warn
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        'HiRemateCallback needs Lightning; install it with pip install "hiremate[lightning]"'
    ) from e
from torch.utils._pytree import tree_unflatten

import remat
from remat import Plan, RematModule
from remat.cache import plan_cache_for

from integrations._fsdp import (
    Unplannable,
    fsdp2_line,
    fsdp2_miss,
    rematerialize_fsdp2,
    uninstall,
    units_to_plan,
)
from integrations._lightning_warnings import quiet_leafspec
from integrations._remat_shared import (
    Collectives,
    StepMeter,
    Target,
    TargetResult,
    check_settings,
    default_targets,
    first_step_line,
    format_table,
    resolve_names,
    solve_targets,
)
from integrations._warmup import (
    CannotDrawBatch,
    first_batch,
    isolated_rng,
    preserved_state,
    record_first_calls,
)

__all__ = ["HiRemateCallback"]

_OWNER = "HiRemateCallback"
_STATE_VERSION = 1


class _StopWarmup(Exception):
    """Raised by the patched ``manual_backward`` to end a manual-optimization warmup."""


def _check_strategy(strategy: Any) -> None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    names = [cls.__name__ for cls in type(strategy).__mro__]
    unsupported = [n for n in names if n.startswith(("DeepSpeed", "XLA", "SingleDeviceXLA"))]
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not unsupported:
        return
    if _is_fsdp2(strategy):
        return  # tensor parallelism is refused once the mesh exists (_check_mesh)
    if "FSDPStrategy" in names:
        raise ValueError(
            f"{_OWNER} does not support strategy={type(strategy).__name__} (FSDP1): it replaces "
            "the parameters with flat buffers that remat cannot capture. Use FSDP2: "
            "strategy=ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with "
            "fully_shard(layer) for each layer, then fully_shard(model), in configure_model; "
            "or keep FSDPStrategy(activation_checkpointing_policy=...) without the callback.")
    raise ValueError(
        f"{_OWNER} does not support strategy={type(strategy).__name__} yet: it supports one device "
        "(strategy='auto'), data parallel strategies ('ddp', 'ddp_spawn', 'ddp_fork', ...) and "
        "FSDP2 (ModelParallelStrategy with tensor_parallel_size=1). DeepSpeed and XLA shard or "
        "replace the parameters it would capture. Remove the callback, or use the strategy's own "
        "activation checkpointing."
    )


def _is_fsdp2(strategy: Any) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _check_mesh(strategy: Any) -> None:
    """NOTE [ Remat inside an FSDP unit ] needs whole parameters inside a unit: no tensor
    parallelism."""
    mesh = strategy.device_mesh
    tp = mesh["tensor_parallel"].size() if "tensor_parallel" in (mesh.mesh_dim_names or ()) \
        else 1
    if tp > 1:
        raise ValueError(
            f"{_OWNER} does not support tensor parallelism (ModelParallelStrategy with "
            f"tensor_parallel_size={tp}): a rematerialized FSDP unit needs its whole parameters. "
            "Use ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) (FSDP2 "
            "only), or remove the callback.")


@contextlib.contextmanager
def _silenced(pl_module: "pl.LightningModule", *, manual: bool):
    """``self.log``/``self.log_dict`` do nothing (they raise inside ``on_fit_start``); with manual
    optimization ``manual_backward`` ends the warmup (no optimizer step may run)."""
    def no_log(*args: Any, **kwargs: Any) -> None:
        return None

    def stop(*args: Any, **kwargs: Any) -> None:
        raise _StopWarmup

    patches = {"log": no_log, "log_dict": no_log}
    if manual:
        patches["manual_backward"] = stop
    saved = {name: pl_module.__dict__[name] for name in patches if name in pl_module.__dict__}
    pl_module.__dict__.update(patches)
    try:
        yield
    finally:
        for name in patches:
            pl_module.__dict__.pop(name, None)
        pl_module.__dict__.update(saved)


def _uncapturable(module: torch.nn.Module) -> str:
    """Why ``module`` cannot be captured as one graph, known before trying, or ``""``."""
    ode = sys.modules.get("ode")  # not imported: no ODEBlock can exist
    block_type = getattr(ode, "ODEBlock", None)
    if block_type is None:
        return ""
    for name, sub in module.named_modules():
        if isinstance(sub, block_type):
            return (f"it holds the ode.ODEBlock {name!r}" if name else "it is an ode.ODEBlock") + (
                ", whose solve branches on tensor values (step control and checks), which no "
                "single captured graph can express; name the modules around the block with "
                "HiRemateCallback(module=[...])")
    return ""


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) and loss.requires_grad else None


class HiRemateCallback(Callback):
    """Rematerialize the LightningModule's network(s) under an activation-memory budget.

    Gradients are exactly those of the unmodified model (random ops are never re-drawn,
    BatchNorm statistics are updated once): a run with the callback gives the same loss curve,
    bit for bit on CPU. What changes is the peak memory of each training step (and its time:
    recomputation costs ``plan.predicted_overhead``).

    Every rank of a DDP run uses the plan solved on rank 0. The plans are kept in the callback's
    checkpoint state, so resuming does not profile or solve again; ``cache_dir`` also keeps them
    on disk across runs. Batches of other sizes (dynamic padding, a short last batch) reuse the
    captured graph with the fastest schedule that fits at their size (NOTE [ Shape-generic
    plans ] in ``remat/sizes.py``).

    Callbacks that replace or reconfigure modules (``FewBitCallback``, ``CPCompressionCallback``,
    ``InterpolatedAdjointCallback``) may come before or after it in the callbacks list: they act
    in ``setup``, before this callback's warmup and capture (NOTE [ Composing with the other
    callbacks ]).

    Args:
        budget: Memory budget: ``"70%"``/``0.7`` of the unmodified warmup step's measured peak
            (the whole ``training_step`` with its loss; what runs outside the targets is charged
            against it), or bytes of that peak, with a unit (``"6GiB"``, ``"512MB"``; a bare
            number other than a fraction in (0, 1], such as ``50``, is refused).
        module: Which LightningModule attribute(s) to rematerialize: a name (``"net"``), a dotted
            path (``"model.encoder"``) or a list of them. Default: every top-level child holding
            parameters that is called during the training step.
        solver: One of ``remat.SOLVERS`` (default ``"hierarchical"``).
        time_limit: Seconds each solve may take; the best schedule found by then is used.
        cache_dir: Directory of the on-disk :class:`remat.PlanCache` shared across runs;
            ``None`` (default) the user's cache directory, so every run of a model gets the
            same plan (``HIREMATE_CACHE_DIR`` moves it; ``"off"`` keeps plans in memory).
        strict: Raise when a target cannot be captured or the budget is infeasible. With
            ``False`` (default) that target trains unmodified and rank 0 warns.
        verbose: Log progress lines, the summary table, and the measured peaks of the warmup step
            and of the first training step (on CPU the profiler runs during those two steps; the
            warmup is measured whatever ``verbose`` is, since the budget is of it).

    Attributes:
        results: Target name -> :class:`~integrations._remat_shared.TargetResult` (plan, every
            plan solved, capture time, why it was skipped).
        plans: Target name -> the :class:`remat.Plan` solved for the warmup batch.
        cache: The :class:`remat.PlanCache` (saved in checkpoints).
        eager_peak_bytes: Measured peak of the unmodified warmup step (forward + backward), or
            ``None``.
        step_peak_bytes: Measured peak of the first training step with remat (forward + backward,
            up to the optimizer step), or ``None``.

    Raises:
        ValueError: a malformed budget (``"150%"``, ``"-1GB"``, ``"abc"``, a bare ``50``), an
            unknown solver, a time limit that is not a finite number > 0 (``nan``, ``inf``,
            ``0``) or a malformed module name: in ``__init__``. An unsupported
            strategy: in ``setup``. A ``module=`` name that is not a submodule of the
            LightningModule: at the start of ``on_fit_start``, before any batch is read (the
            attribute may be created by ``configure_model``, after ``setup``).
        remat.RematError: with ``strict=True``, in ``on_fit_start``, when a target cannot be
            captured or no schedule fits the budget (a target holding an ``ode.ODEBlock``:
            before any batch is read).

    Example:
        >>> trainer = Trainer(callbacks=[HiRemateCallback(budget="50%")])  # doctest: +SKIP
        >>> trainer.fit(model, datamodule)                                   # doctest: +SKIP
        >>> print(trainer.callbacks[0].plans["net"].summary())               # doctest: +SKIP
    """

    def __init__(
        self,
        budget: Union[str, float, int] = "70%",
        *,
        module: Union[str, Sequence[str], None] = None,
        solver: str = remat.DEFAULT_SOLVER,
        time_limit: float = 60.0,
        cache_dir: Optional[str] = None,
        strict: bool = False,
        verbose: bool = True,
    ) -> None:
        self.settings = check_settings(
            budget=budget, solver=solver, time_limit=time_limit, module=module,
            cache_dir=cache_dir, strict=strict, verbose=verbose,
        )
        self.cache = plan_cache_for(self.settings.cache_dir)
        self.results: dict[str, TargetResult] = {}
        self.eager_peak_bytes: Optional[int] = None
        self.step_peak_bytes: Optional[int] = None
        self._swapped: list[tuple[Target, RematModule]] = []
        self._fsdp2_units: list[torch.nn.Module] = []  # whose forward is ours
        self._measure_next_step = False
        self._first_step = StepMeter()

    @property
    def plans(self) -> dict[str, Plan]:
        return {name: r.plan for name, r in self.results.items() if r.plan is not None}

    # ---- fit start: warmup, solve, swap ----------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _check_strategy(trainer.strategy)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        _check_strategy(trainer.strategy)
        self._restore()
        self.results, self.eager_peak_bytes, self.step_peak_bytes = {}, None, None
        if _is_fsdp2(trainer.strategy):
            return self._fit_start_fsdp2(trainer, pl_module)
        if self.settings.module is not None:
            targets = resolve_names(pl_module, self.settings.module, owner=_OWNER)
        else:
            targets = default_targets(pl_module)
        already = [t.name for t in targets if isinstance(t.module, RematModule)]
        targets = [t for t in targets if not isinstance(t.module, RematModule)]
        if already:
            self._info(f"{_OWNER}: {', '.join(already)} already rematerialized; left as is")
        blocked = self._skip_uncapturable(targets)  # NOTE [ Composing with the other callbacks ]
        targets = [t for t in targets if t.name not in blocked]
        self.results = dict(blocked)
        if not targets:
            if not blocked:  # (a blocked target has had its warning)
                self._info(f"{_OWNER}: no module holding trainable parameters to rematerialize")
            return
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            return self._cannot("training_step takes a dataloader_iter, so no single batch can "
                                "be replayed as the warmup step")
        with isolated_rng():  # see NOTE [ A warmup step that leaves no trace ]
            try:
                batch = self._example_batch(trainer)
            except CannotDrawBatch as e:
                return self._cannot(str(e))
            with preserved_state(pl_module), \
                    _silenced(pl_module, manual=not pl_module.automatic_optimization):
                calls = self._warmup(trainer, pl_module, self._on_device(trainer, pl_module, batch),
                                     targets)
        del batch
        missing = [t.name for t in targets if t.name not in calls]
        explicit_missing = [t.name for t in targets if t.explicit and t.name in missing]
        if explicit_missing:
            raise ValueError(
                f"{_OWNER}(module={list(self.settings.module)!r}): "
                f"{', '.join(map(repr, explicit_missing))} was not called by training_step on the "
                "warmup batch" + (" before its first manual_backward" if not
                                  pl_module.automatic_optimization else "")
                + "; name the module(s) the training step runs"
            )
        targets = [t for t in targets if t.name in calls]
        if not targets:
            self._info(f"{_OWNER}: training_step called none of "
                       f"{', '.join(missing)}; nothing to rematerialize")
            return
        comm = self._collectives(trainer)
        with isolated_rng(), trainer.precision_plugin.train_step_context():
            self.results.update(solve_targets(
                targets, calls, self.settings, self.cache, owner=_OWNER, comm=comm,
                info=self._info, warn=self._warn, step_peak_bytes=self.eager_peak_bytes,
            ))
        del calls
        self._swap(pl_module, targets)
        if self.settings.verbose:
            rank_zero_info(format_table(self.results, self.settings, owner=_OWNER,
                                        eager_peak_bytes=self.eager_peak_bytes))
        self._measure_next_step = self.settings.verbose and bool(self._swapped)

    def _fit_start_fsdp2(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """NOTE [ Remat inside an FSDP unit ], NOTE [ One step budget over FSDP units ]."""
        _check_mesh(trainer.strategy)
        if self.settings.module is not None:
            raise ValueError(
                f"{_OWNER}(module={list(self.settings.module)!r}): under FSDP2 the callback "
                "rematerializes every fully_shard unit inside the root; leave module= out")
        try:
            units = units_to_plan(pl_module)
        except Unplannable as e:
            return self._cannot(f"{e} in configure_model")
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True) \
                or not pl_module.automatic_optimization:
            return self._cannot("the FSDP2 budget is measured on a whole training step, which "
                                "needs automatic optimization and a batch argument")
        with isolated_rng():  # see NOTE [ A warmup step that leaves no trace ]
            try:
                batch = self._example_batch(trainer)
            except CannotDrawBatch as e:
                return self._cannot(str(e))
            batch = self._on_device(trainer, pl_module, batch)

            def step(warmup: bool, batch: Any = batch) -> int | None:
                # the other callbacks watch the warmup step, not the trials
                with preserved_state(pl_module), _silenced(pl_module, manual=False):
                    meter = StepMeter()
                    self._run_step(trainer, pl_module, batch, meter, watched=warmup)
                return meter.peak_bytes

            try:
                with trainer.precision_plugin.train_step_context():
                    planned, self.eager_peak_bytes, results = rematerialize_fsdp2(
                        pl_module, step, self.settings, self.cache,
                        comm=self._collectives(trainer), info=self._info, owner=_OWNER)
            except Unplannable as e:
                return self._cannot(str(e))
        del batch, step  # the batch and the recorded calls
        self._fsdp2_units = [u for _, u in units]
        self.results.update(results)
        self._info(fsdp2_line(planned, self.eager_peak_bytes, owner=_OWNER))
        if not planned.fits:
            self._warn(fsdp2_miss(planned, self.eager_peak_bytes, owner=_OWNER))
        if self.settings.verbose:
            rank_zero_info(format_table(self.results, self.settings, owner=_OWNER,
                                        eager_peak_bytes=self.eager_peak_bytes))
        self._measure_next_step = self.settings.verbose

    def _skip_uncapturable(self, targets: list[Target]) -> dict[str, TargetResult]:
        """Targets that cannot be captured, known before any batch is read (an ODE block)."""
        blocked = {}
        for t in targets:
            why = _uncapturable(t.module)
            if not why:
                continue
            label = repr(t.name) if t.name else "the model"
            if self.settings.strict:
                raise remat.CaptureError(f"{_OWNER}: {label} cannot be rematerialized: {why}",
                                         reason="data_dependent")
            self._warn(f"{_OWNER}: {label} trains unmodified (strict=False): {why}")
            blocked[t.name] = TargetResult(t.name, skipped=why)
        return blocked

    @contextlib.contextmanager
    def _watched(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Iterator[None]:
        """NOTE [ Callbacks that watch the warmup step ]."""
        with contextlib.ExitStack() as stack:
            for callback in trainer.callbacks:
                watch = getattr(callback, "remat_warmup", None)
                if callback is not self and callable(watch):
                    stack.enter_context(watch(trainer, pl_module))
            yield

    def _example_batch(self, trainer: "pl.Trainer") -> Any:
        """See NOTE [ Where the example batch comes from ]."""
        source = getattr(trainer.fit_loop, "_data_source", None)
        if source is None or not source.is_defined():
            raise CannotDrawBatch("the Trainer has no training dataloader to read a batch from")
        loaders = source.dataloader()
        with quiet_leafspec():  # NOTE [ Lightning's LeafSpec warning ]
            combined = loaders if isinstance(loaders, CombinedLoader) else \
                CombinedLoader(loaders, "max_size_cycle")
        batches = [first_batch(loader) for loader in combined.flattened]
        return tree_unflatten(batches, combined._spec)

    def _warmup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                targets: list[Target]) -> dict[str, tuple[tuple, dict]]:
        """Run ``training_step`` on ``batch`` recording the targets' calls (and the eager peak)."""
        warmup = StepMeter()
        with record_first_calls(targets) as calls:
            self._run_step(trainer, pl_module, batch, warmup, watched=True)
        self.eager_peak_bytes = warmup.peak_bytes
        return dict(calls)

    def _run_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                  meter: StepMeter, *, watched: bool = False) -> None:
        """``training_step`` and its backward on ``batch`` (already on the device), measured by
        ``meter``; the caller restores the state it changes."""
        args = (batch, 0) if is_param_in_hook_signature(pl_module.training_step, "batch_idx",
                                                         min_args=2) else (batch,)
        # The whole step's peak is what a percentage budget is of (NOTE [ Charging the rest of
        # the step ]); manual optimization stops at its first manual_backward, so not there.
        measure = pl_module.automatic_optimization
        with trainer.precision_plugin.train_step_context():
            if measure:
                meter.start(trainer.strategy.root_device)
            try:
                with self._watched(trainer, pl_module) if watched else contextlib.nullcontext():
                    output = pl_module.training_step(*args)
                loss = _loss_of(output) if measure else None
                if loss is not None:
                    loss.backward()
                del output, loss
            except _StopWarmup:
                pass
            finally:
                meter.stop()

    @staticmethod
    def _on_device(trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any) -> Any:
        batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
        return trainer.strategy.batch_to_device(batch, dataloader_idx=0)

    def _swap(self, pl_module: "pl.LightningModule", targets: list[Target]) -> None:
        keys = list(pl_module.state_dict())
        for target in targets:
            rm = self.results[target.name].remat_module
            if rm is not None:
                setattr(target.parent, target.attr, rm)
                self._swapped.append((target, rm))
        if list(pl_module.state_dict()) != keys:
            self._restore()
            remat.errors.internal_assert(False, "swapping in a RematModule changed the "
                                                "LightningModule's state_dict keys")

    def _restore(self) -> None:
        """Put the original modules back (end of fit, or an error)."""
        if self._fsdp2_units:  # NOTE [ Remat inside an FSDP unit ]: nothing was swapped
            for unit in self._fsdp2_units:
                uninstall(unit)
            self._fsdp2_units = []
            for result in self.results.values():
                if result.remat_module is not None:
                    result.plans, result.remat_module = result.remat_module.plans, None
        while self._swapped:
            target, rm = self._swapped.pop()
            if getattr(target.parent, target.attr, None) is rm:
                target.module.train(rm.training)
                setattr(target.parent, target.attr, target.module)
            result = self.results.get(target.name)
            if result is not None:
                result.plans = rm.plans
                result.remat_module = None

    def _cannot(self, why: str) -> None:
        if self.settings.strict:
            raise RuntimeError(f"{_OWNER}: cannot rematerialize (strict=True): {why}")
        self._warn(f"{_OWNER}: training unmodified (strict=False): {why}")

    def _collectives(self, trainer: "pl.Trainer") -> Collectives:
        strategy = trainer.strategy
        if trainer.world_size <= 1:
            return Collectives()
        def all_max(number: int) -> int:
            value = torch.tensor(float(number), dtype=torch.float64, device=strategy.root_device)
            return int(strategy.reduce(value, reduce_op="max").item())

        return Collectives(
            rank=trainer.global_rank, world_size=trainer.world_size,
            broadcast=lambda obj: strategy.broadcast(obj, src=0),
            all_true=lambda flag: bool(strategy.reduce_boolean_decision(flag, all=True)),
            all_max=all_max,
        )

    def _info(self, message: str) -> None:
        if self.settings.verbose:
            rank_zero_info(message)

    @staticmethod
    def _warn(message: str) -> None:
        rank_zero_warn(message)

    # ---- training: keep modes in sync, measure the first step ------------------------------------

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        if self._measure_next_step:
            self._measure_next_step = False
            self._first_step.start(trainer.strategy.root_device)

    def _stop_measuring(self) -> None:
        if not self._first_step.running:
            return
        self.step_peak_bytes = self._first_step.stop()
        self._info(first_step_line(self.step_peak_bytes, self.eager_peak_bytes, owner=_OWNER))

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        self._stop_measuring()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._stop_measuring()

    # ---- end of fit ------------------------------------------------------------------------------

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # before any on_fit_end: NOTE [ Composing with the other callbacks ]
        self._stop_measuring()
        self._restore()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self._stop_measuring()
            self._restore()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                     exception: BaseException) -> None:
        self._stop_measuring()
        self._restore()

    # ---- checkpoint state ------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "budget": str(self.settings.budget),
            "solver": self.settings.solver,
            "plan_cache": self.cache.state_dict(),
            "plans": {name: dataclasses.asdict(plan) for name, plan in self.plans.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != _STATE_VERSION:
            rank_zero_warn(f"{_OWNER}: ignoring checkpoint state of version "
                           f"{state_dict.get('version')!r} (expected {_STATE_VERSION}); the plans "
                           "will be solved again")
            return
        self.cache.load_state_dict(state_dict.get("plan_cache", {}))
