"""Accelerate integration: the ``HIREMATE_*`` launcher flag, ``HiRemateAccelerator`` and a function.

Three ways in, from least to most code change::

    # 1. the launcher flag: no code change; every Accelerator the script builds rematerializes
    #    the models it prepares (python -m integrations.accelerate train.py for one process)
    HIREMATE_BUDGET=50% accelerate launch -m integrations.accelerate train.py --lr 1e-3

    # 2. in the script (then a plain `HIREMATE_BUDGET=50% accelerate launch train.py` works too)
    from integrations.accelerate import HiRemateAccelerator, HiRematePlugin
    accelerator = HiRemateAccelerator(hiremate_plugin=HiRematePlugin(budget="50%"))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # 3. keep your own Accelerator
    model = rematerialize_for_accelerate(accelerator, model, batch, HiRematePlugin(budget="50%"))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Accelerate rejects unknown kwargs handlers, launch-config keys and CLI flags, so the flag is a set
of environment variables read by :meth:`HiRematePlugin.from_env`. The launcher (1.) lives in
:mod:`integrations._accelerate_launch`; ``python -m integrations.accelerate`` runs it. Papers:
HiRemate (Gusak et al., ICML 2025), Rockmate (Zhao et al., ICML 2023).

NOTE [ The example batch in prepare() ]
    ``prepare`` needs one real batch to capture and profile the model. It reads the first batch of
    a *fresh* iterator over the first ``DataLoader`` passed to the same ``prepare`` call (or, if
    none, over a loader prepared earlier), inside an RNG-isolated block: the user's own iteration
    later starts from the beginning with the same shuffle and the same random state, so training
    is unchanged (the warmup does not consume a batch). With ``split_batches=True`` the batch is
    cut to one process's share. The model is called with it by this convention: a mapping is
    passed as keyword arguments (``model(**batch)``, Hugging Face style), a tensor as the only
    argument, a tuple or list as ``(inputs, targets, ...)`` (``model(batch[0])``). For anything
    else call :meth:`HiRemateAccelerator.rematerialize` (or :func:`rematerialize_for_accelerate`)
    with a batch in one of these forms before ``prepare``; ``prepare`` itself warns and leaves
    the model unmodified (``strict``: raises), as when it sees no ``DataLoader``.

NOTE [ Wrapping order ]
    The model is rematerialized *before* Accelerate prepares it: ``prepare`` then moves and wraps
    the :class:`remat.RematModule` (DDP, mixed-precision forward), whose parameters are the
    original ``Parameter`` objects, so an optimizer created earlier keeps training them and the
    ``state_dict`` keys are unchanged. With ``module=None`` the returned model *is* a
    ``RematModule`` (attributes of your class are on ``model.original``;
    ``HiRemateAccelerator.unwrap_model`` returns the original). With ``module="name"`` only that
    submodule is swapped, in place, and your model object stays what it was.

NOTE [ FSDP2 under Accelerate ]
    With ``fsdp_version: 2`` ``prepare`` itself shards the model (``fully_shard`` on each layer
    its auto-wrap policy names, then on the model), so the model is rematerialized *after*
    ``prepare``, the other way round from NOTE [ Wrapping order ]: every FSDP unit gets a
    rematerialized forward inside FSDP's hooks and the units share one budget for the whole step
    on each rank (NOTE [ Remat inside an FSDP unit ] and NOTE [ One step budget over FSDP
    units ] in ``integrations/_fsdp.py``, the code the Lightning callback runs too). The step
    measured is the model's forward and backward on the example batch (its loss, or the sum of
    its outputs). A model sharded by hand (``fully_shard`` before ``rematerialize_for_accelerate``
    or ``HiRemateAccelerator.rematerialize``) takes the same path under any process group; that
    is how it is tested on CPUs, where Accelerate runs no FSDP. Nothing in the module tree is
    replaced: the model, its ``state_dict`` keys and the optimizer's parameters stay FSDP's.
    FSDP1, DeepSpeed, tensor/context parallelism and FSDP's own activation checkpointing are
    refused with the reason and the supported alternative.

NOTE [ Measuring the first step of a loop we do not own ]: in
:mod:`integrations._accelerate_first_step`.
"""
from __future__ import annotations

import difflib
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.utils import (
        DistributedType,
        broadcast_object_list,
        find_batch_size,
        gather_object,
        send_to_device,
        slice_tensors,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "integrations.accelerate needs Accelerate; install it with "
        'pip install "hiremate[accelerate]"'
    ) from e

import remat
from remat import PlanCache, RematModule
from remat.cache import CACHE_OFF, plan_cache_for

from integrations._accelerate_first_step import EAGER_DETAIL, FirstStepReport, warmup_peak
from integrations._fsdp import (
    Unplannable,
    fsdp2_line,
    fsdp2_miss,
    fsdp_units,
    rematerialize_fsdp2,
    units_to_plan,
)
from integrations._remat_shared import (
    Collectives,
    RematSettings,
    Target,
    TargetResult,
    check_settings,
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

__all__ = ["ENV_VARS", "HiRematePlugin", "HiRemateAccelerator", "rematerialize_for_accelerate"]

log = logging.getLogger(__name__)

_OWNER = "HiRemateAccelerator"

# Environment variable -> HiRematePlugin field. HIREMATE_BUDGET switches rematerialization on.
ENV_VARS = {
    "HIREMATE_BUDGET": "budget",
    "HIREMATE_SOLVER": "solver",
    "HIREMATE_TIME_LIMIT": "time_limit",
    "HIREMATE_MODULE": "module",
    "HIREMATE_CACHE_DIR": "cache_dir",
    "HIREMATE_STRICT": "strict",
    "HIREMATE_VERBOSE": "verbose",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Accelerate's data-parallel modes; the others shard or replace parameters (DeepSpeed, FSDP,
# Megatron) or run elsewhere (XLA).
_SUPPORTED = {DistributedType.NO: "one process", DistributedType.MULTI_CPU: "DDP on CPUs",
              DistributedType.MULTI_GPU: "DDP on GPUs"}


@dataclass(frozen=True)
class HiRematePlugin:
    """Rematerialization settings for :class:`HiRemateAccelerator` (frozen, checked when built).

    Args:
        budget: Memory budget: ``"70%"``/``0.7`` of the model's eager step peak measured on the
            example batch (its loss, when the model computes it; a loss computed outside the
            model is not measured here), or bytes of that peak with a unit (``"6GiB"``,
            ``"512MB"``; ``HIREMATE_BUDGET=50`` is refused: ``50%`` or ``50MiB``?).
        solver: One of ``remat.SOLVERS``.
        time_limit: Seconds each solve may take.
        module: ``None`` (the whole model), or the name(s) of submodules to rematerialize in
            place (``"transformer"``, ``["encoder", "decoder"]``, dotted paths allowed).
        cache_dir: Directory of an on-disk :class:`remat.PlanCache`: a restarted job reuses the
            plans instead of solving again. ``None`` (default): the user's cache directory, so
            every run of a model gets the same plan (``"off"``: plans kept in memory only).
        strict: Raise when the model cannot be captured or the budget is infeasible; with
            ``False`` the model trains unmodified and the main process warns.
        verbose: Log progress lines and the summary table (``logging``, main process only).

    Raises:
        ValueError: a malformed budget (a bare ``50`` included), unknown solver, a time limit
            that is not a finite number > 0, bad module name.
        TypeError: a value of the wrong type.

    Example:
        >>> HiRematePlugin(budget="50%", module="transformer")  # doctest: +SKIP
    """

    budget: Union[str, float, int] = "70%"
    solver: str = remat.DEFAULT_SOLVER
    time_limit: float = 60.0
    module: Union[str, Sequence[str], None] = None
    cache_dir: Optional[str] = None
    strict: bool = False
    verbose: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "_settings", check_settings(
            budget=self.budget, solver=self.solver, time_limit=self.time_limit,
            module=self.module, cache_dir=self.cache_dir, strict=self.strict, verbose=self.verbose,
        ))

    @property
    def settings(self) -> RematSettings:
        """The validated, normalised settings."""
        return self._settings

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["HiRematePlugin"]:
        """The plugin described by the ``HIREMATE_*`` environment variables, or ``None``.

        ``HIREMATE_BUDGET`` switches rematerialization on (``"70%"``, ``"0.7"``, ``"6GiB"``); the
        others are optional: ``HIREMATE_SOLVER``, ``HIREMATE_TIME_LIMIT`` (seconds),
        ``HIREMATE_MODULE`` (comma-separated names), ``HIREMATE_CACHE_DIR``, ``HIREMATE_STRICT``
        and ``HIREMATE_VERBOSE`` (``1/0``, ``true/false``, ``yes/no``, ``on/off``).

        Args:
            environ: The variables to read (default ``os.environ``).

        Returns:
            A plugin, or ``None`` when no ``HIREMATE_*`` variable is set.

        Raises:
            ValueError: a malformed value or a misspelt variable name (e.g. ``HIREMATE_BUDGT``),
                naming the variable; an option set without ``HIREMATE_BUDGET``.

        Example:
            ``HIREMATE_BUDGET=50% HIREMATE_SOLVER=dp accelerate launch train.py``
        """
        env = os.environ if environ is None else environ
        given = {k: v for k, v in env.items() if k.startswith("HIREMATE_")}
        for name, value in given.items():
            if name not in ENV_VARS:
                close = difflib.get_close_matches(name, list(ENV_VARS), n=1, cutoff=0.8)
                if close:  # an unrelated HIREMATE_* variable of another tool is left alone
                    raise ValueError(f"{name}={value!r}: unknown variable; did you mean "
                                     f"{close[0]}? hiremate reads {', '.join(ENV_VARS)}")
        given = {k: v for k, v in given.items() if k in ENV_VARS}
        # HIREMATE_CACHE_DIR alone says where plans go (every front door reads it: NOTE [ The
        # same plan every run ] in remat/cache.py), not that this script should rematerialize.
        if set(given) <= {"HIREMATE_CACHE_DIR"}:
            return None
        if "HIREMATE_BUDGET" not in given:
            options = sorted(set(given) - {"HIREMATE_CACHE_DIR"})
            raise ValueError(
                f"{', '.join(options)} is set but HIREMATE_BUDGET is not: set e.g. "
                "HIREMATE_BUDGET=70% to turn rematerialization on, or unset the other variables"
            )
        kwargs: dict[str, Any] = {}
        for name, raw in given.items():
            key = ENV_VARS[name]
            kwargs[key] = _parse_env(name, key, raw)
        check_settings(**{k: kwargs.get(k, getattr(cls, k)) for k in ENV_VARS.values()},
                       names={v: k for k, v in ENV_VARS.items()})
        return cls(**kwargs)


def _parse_env(name: str, key: str, raw: str) -> Any:
    value = raw.strip()
    if key == "time_limit":
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a number of seconds > 0, e.g. "
                             f"{name}=60") from None
        # NOTE [ One check per setting ]: the message shows the variable as it was written.
        return remat.check_time_limit(seconds, name=name, shown=repr(raw))
    if key in ("strict", "verbose"):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
    if key == "module":
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names:
            raise ValueError(f"{name}={raw!r}: expected comma-separated module names such as "
                             f"{name}=transformer, or unset it to rematerialize the whole model")
        return names
    if key == "cache_dir":  # "off": the default cache, which that same variable turns off
        return None if value.lower() in CACHE_OFF else value
    return value


def _check_supported(accelerator: Accelerator, owner: str = _OWNER) -> None:
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not _is_fsdp2(accelerator):
        raise ValueError(
            f"{owner}: FSDP1 (fsdp_version: 1) is not supported: it flattens the parameters into "
            "buffers remat cannot capture. Use FSDP2: fsdp_version: 2 in the Accelerate config "
            "(or FullyShardedDataParallelPlugin(fsdp_version=2)); each layer the auto-wrap "
            "policy shards is then rematerialized, under one budget for the whole step.")
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.activation_checkpointing:
        raise ValueError(
            f"{owner}: fsdp_activation_checkpointing: true checkpoints every FSDP unit already; "
            "remat plans the units itself under the budget. Turn one off: unset "
            "fsdp_activation_checkpointing, or unset HIREMATE_BUDGET.")
    if kind == DistributedType.DEEPSPEED:
        raise ValueError(
            f"{owner}: DeepSpeed is not supported: ZeRO-3 partitions the parameters and gathers "
            "them in hooks remat cannot capture (ZeRO-1/2 are not planned for either). Use "
            "FSDP2 (fsdp_version: 2 in the Accelerate config), whose units remat rematerializes "
            "under one step budget; or unset HIREMATE_BUDGET and use DeepSpeed's activation "
            "checkpointing.")
    if kind not in _SUPPORTED and kind != DistributedType.FSDP:
        allowed = ", ".join(f"{k.value} ({v})" for k, v in _SUPPORTED.items())
        raise ValueError(
            f"{owner}: distributed_type={kind.value} is not supported yet; supported: {allowed}, "
            "and FSDP2 (fsdp_version: 2). Megatron-LM and XLA shard or replace the parameters "
            "remat captures: unset HIREMATE_BUDGET and use their own activation checkpointing."
        )
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and (getattr(config, "tp_enabled", False) or
                               getattr(config, "cp_enabled", False)):
        raise ValueError(f"{owner}: tensor/context parallelism is not supported yet: a "
                         "rematerialized unit needs its whole parameters. Unset HIREMATE_BUDGET "
                         "or disable it in the parallelism config (FSDP2 data parallelism alone "
                         "is supported)")
    backend = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    if backend is not None and getattr(backend, "value", backend) != "NO":
        raise ValueError(
            f"{owner}: dynamo_backend={getattr(backend, 'value', backend)} would compile the "
            "model a second time; remat compiles it itself. Launch without --dynamo_backend "
            "(or pass dynamo_backend='no')."
        )


def _is_fsdp2(accelerator: Accelerator) -> bool:
    """Whether ``prepare`` shards models with FSDP2 (Accelerate does so on GPUs only)."""
    return accelerator.distributed_type == DistributedType.FSDP and \
        getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2


def _batch_problem(batch: Any) -> Optional[str]:
    """Why the model cannot be called on ``batch`` by the convention, or ``None``."""
    if isinstance(batch, (Mapping, torch.Tensor)) or (isinstance(batch, (tuple, list)) and batch):
        return None
    return (f"cannot call the model on a batch of type {type(batch).__name__}; pass a mapping of "
            "keyword arguments, a tensor, or an (inputs, targets) tuple to "
            "rematerialize_for_accelerate / HiRemateAccelerator.rematerialize")


def _call_args(batch: Any, owner: str = _OWNER) -> tuple[tuple, dict]:
    """How the model is called on a batch; see NOTE [ The example batch in prepare() ]."""
    problem = _batch_problem(batch)
    if problem is not None:
        raise TypeError(f"{owner}: {problem}")
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    return (batch[0],), {}


def _collectives(accelerator: Accelerator) -> Collectives:
    if accelerator.num_processes <= 1:
        return Collectives()

    def broadcast(obj: Any) -> Any:
        return broadcast_object_list([obj], from_process=0)[0]

    def all_true(flag: bool) -> bool:
        return all(gather_object([bool(flag)]))

    def all_max(number: int) -> int:
        return max(gather_object([number]))

    return Collectives(rank=accelerator.process_index, world_size=accelerator.num_processes,
                       broadcast=broadcast, all_true=all_true, all_max=all_max)


def _rematerialize(accelerator: Accelerator, model: nn.Module, batch: Any,
                   settings: RematSettings, cache: PlanCache, *,
                   device_placement: Optional[bool] = None, owner: str = _OWNER
                   ) -> tuple[nn.Module, dict[str, TargetResult]]:
    """Rematerialize ``model`` (or its named submodules) on ``batch``; returns the model to use."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: expected an nn.Module")
    _check_supported(accelerator, owner)
    if fsdp_units(model)[0]:
        return _rematerialize_fsdp2(accelerator, model, batch, settings, cache, owner=owner)
    main = accelerator.is_main_process
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
    base = model.module if wrapped else model
    if isinstance(base, RematModule):
        return model, {}
    if settings.module is None:
        if wrapped:
            raise TypeError(f"{owner}: the model is already wrapped by DistributedDataParallel; "
                            "rematerialize it before accelerator.prepare(...), or name the "
                            "submodules to rematerialize with module=...")
        targets = [Target("", None, "", base, explicit=True)]
    else:
        targets = resolve_names(base, settings.module, owner=owner)
    placement = accelerator.device_placement if device_placement is None else device_placement
    if placement and not wrapped:
        base.to(accelerator.device)
    params = [p for p in base.parameters()]
    device = params[0].device if params else accelerator.device
    batch = send_to_device(batch, device)
    args, kwargs = _call_args(batch, owner)

    report = settings.verbose and main

    def info(message: str) -> None:
        if report:
            log.info(message)

    def warn(message: str) -> None:
        if main:
            warnings.warn(message, stacklevel=4)

    with isolated_rng(), accelerator.autocast():  # NOTE [ A warmup step that leaves no trace ]
        if settings.module is None:
            calls = {"": (args, kwargs)}
        else:
            with preserved_state(base), record_first_calls(targets) as recorded, \
                    torch.enable_grad():
                try:
                    base(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - the batch convention may not fit
                    raise TypeError(
                        f"{owner}: calling {type(base).__name__} on the example batch failed "
                        f"({type(e).__name__}: {e}); pass a batch the model accepts to "
                        "HiRemateAccelerator.rematerialize / rematerialize_for_accelerate "
                        "(see NOTE [ The example batch in prepare() ])") from e
            calls = dict(recorded)
            missing = [t.name for t in targets if t.name not in calls]
            if missing:
                raise ValueError(f"{owner}(module={list(settings.module)!r}): "
                                 f"{', '.join(map(repr, missing))} was not called by the model's "
                                 "forward on the example batch; name modules the forward runs")
        measured = None
        if report and settings.module is not None:  # the whole model, before the swap
            measured = warmup_peak(base, args, kwargs)
        results = solve_targets(targets, calls, settings, cache, owner=owner,
                                comm=_collectives(accelerator), info=info, warn=warn)
    plan = results[""].plan if settings.module is None else None
    if report and plan is not None and plan.eager_bytes:  # rematerialize measured the model
        measured = plan.eager_bytes + plan.outside_bytes
    for target in targets:
        rm = results[target.name].remat_module
        if rm is None:
            continue
        if target.parent is None:
            model = rm
        else:
            setattr(target.parent, target.attr, rm)
    if report:
        log.info(format_table(results, settings, owner=owner, eager_peak_bytes=measured,
                              eager_detail=EAGER_DETAIL))
        if any(r.remat_module is not None for r in results.values()):
            FirstStepReport(model, device, measured, owner)
    return model, results


def _rematerialize_fsdp2(accelerator: Accelerator, model: nn.Module, batch: Any,
                         settings: RematSettings, cache: PlanCache, *, owner: str
                         ) -> tuple[nn.Module, dict[str, TargetResult]]:
    """NOTE [ FSDP2 under Accelerate ]: every unit of the FSDP2-sharded ``model`` planned for one
    budget of the whole step on each rank; returns ``model`` itself."""
    if settings.module is not None:
        raise ValueError(f"{owner}(module={list(settings.module)!r}): under FSDP2 every "
                         "fully_shard unit inside the root is rematerialized; leave module= "
                         "(HIREMATE_MODULE) out")
    main = accelerator.is_main_process
    try:
        units_to_plan(model)  # refused before the batch moves
    except Unplannable as e:
        _train_unmodified(accelerator, settings, e, owner=owner)
        return model, {}
    params = list(model.parameters())
    batch = send_to_device(batch, params[0].device if params else accelerator.device)
    args, kwargs = _call_args(batch, owner)

    def step(warmup: bool) -> int:
        # forward and backward of the model's loss (or outputs' sum), as the user's loop runs it
        return remat.measure_eager_step(model, *args, **kwargs)

    def info(message: str) -> None:
        if settings.verbose and main:
            log.info(message)

    with isolated_rng(), accelerator.autocast():  # NOTE [ A warmup step that leaves no trace ]
        planned, eager, results = rematerialize_fsdp2(
            model, step, settings, cache, comm=_collectives(accelerator), info=info, owner=owner)
    info(fsdp2_line(planned, eager, owner=owner))
    if not planned.fits and main:
        warnings.warn(fsdp2_miss(planned, eager, owner=owner), stacklevel=4)
    if settings.verbose and main:
        log.info(format_table(results, settings, owner=owner, eager_peak_bytes=eager,
                              eager_detail=EAGER_DETAIL))
    return model, results


def rematerialize_for_accelerate(accelerator: Accelerator, model: nn.Module, batch: Any,
                                 plugin: Optional[HiRematePlugin] = None) -> nn.Module:
    """Rematerialize ``model`` for training with your own ``Accelerator``.

    Call it before ``accelerator.prepare(model, ...)`` (see NOTE [ Wrapping order ]); on a model
    you sharded with ``fully_shard`` yourself, after sharding (NOTE [ FSDP2 under Accelerate ]).
    Under DDP or FSDP2 call it on every process: rank 0 solves and the others reuse its plan.

    Args:
        accelerator: Your ``Accelerator`` (device, mixed precision, processes).
        model: The model, not yet prepared (or, with ``plugin.module`` set, prepared).
        batch: One real training batch: a mapping of keyword arguments, a tensor, or an
            ``(inputs, targets, ...)`` tuple (see NOTE [ The example batch in prepare() ]).
        plugin: The settings; ``None`` reads the ``HIREMATE_*`` variables and, when none is set,
            returns ``model`` unchanged.

    Returns:
        The model to pass to ``prepare``: a :class:`remat.RematModule` sharing ``model``'s
        parameters (``plugin.module=None``), or ``model`` itself with the named submodules
        swapped; ``model`` unchanged if it trains unmodified (``strict=False``).

    Raises:
        ValueError: an unsupported distributed setup, a module name that does not exist.
        remat.RematError: with ``strict=True``, when the model cannot be captured or the budget
            is infeasible.

    Example:
        >>> model = rematerialize_for_accelerate(accelerator, model, next(iter(loader)),
        ...                                      HiRematePlugin(budget="50%"))  # doctest: +SKIP
    """
    if plugin is None:
        plugin = HiRematePlugin.from_env()
        if plugin is None:
            return model
    if not isinstance(plugin, HiRematePlugin):
        raise TypeError(f"plugin={plugin!r}: expected a HiRematePlugin or None")
    model, _ = _rematerialize(accelerator, model, batch, plugin.settings,
                              plan_cache_for(plugin.settings.cache_dir))
    model._hiremate_done = True  # a prepare() that rematerializes must not do it again
    return model


# ---- what HiRemateAccelerator and the launcher share ---------------------------------------------
#
# NOTE [ One implementation, two ways in ]
#     ``HiRemateAccelerator`` (a subclass, settings from its plugin or HIREMATE_*) and the
#     launcher (``python -m integrations.accelerate``, which wraps ``Accelerator.prepare`` for
#     every instance: see ``integrations/_accelerate_launch.py``) run the same code. ``_attach``
#     gives an accelerator the state ``prepare`` needs (``hiremate_plugin``, ``hiremate_results``
#     and a plan cache), ``_prepare`` runs Accelerate's ``prepare`` with the modules among its
#     arguments rematerialized (before it, or after it under FSDP2), ``_original`` is what
#     ``unwrap_model`` adds. Every model either
#     way (or ``rematerialize_for_accelerate``) has handled is marked ``_hiremate_done``, and the
#     launcher leaves ``HiRemateAccelerator`` instances to their own ``prepare``, so nothing is
#     rematerialized twice.


def _attach(accelerator: Accelerator, plugin: Optional[HiRematePlugin]) -> None:
    """Give ``accelerator`` the settings, results and plan cache of NOTE [ One implementation, two
    ways in ] (``plugin=None``: rematerialization off)."""
    accelerator.hiremate_plugin = plugin
    accelerator.hiremate_results = {}
    accelerator._hiremate_cache = None if plugin is None else plan_cache_for(plugin.settings.cache_dir)


def _rematerialize_one(accelerator: Accelerator, model: nn.Module, batch: Any, *, owner: str,
                       device_placement: Optional[bool] = None) -> nn.Module:
    """Rematerialize ``model`` on ``batch`` with the attached settings; records the results."""
    result, results = _rematerialize(accelerator, model, batch,
                                     accelerator.hiremate_plugin.settings,
                                     accelerator._hiremate_cache,
                                     device_placement=device_placement, owner=owner)
    accelerator.hiremate_results.update(results)
    result._hiremate_done = True  # prepare() must not do it again
    return result


def _prepare(accelerator: Accelerator, args: list, device_placement: Optional[list],
             prepare: Any, *, owner: str, advice: str) -> Any:
    """``prepare(*args, device_placement=...)`` (Accelerate's own) with the models among
    ``args`` rematerialized on the first batch of a loader: before ``prepare`` wraps them (NOTE
    [ Wrapping order ]), or, where ``prepare`` shards them with FSDP2, after (NOTE [ FSDP2
    under Accelerate ]).

    See NOTE [ The example batch in prepare() ]; ``advice`` says what to do when ``prepare`` sees
    no DataLoader.
    """
    todo = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module)
            and not getattr(obj, "_hiremate_done", False)
            and not getattr(obj, "_is_accelerate_prepared", False)]
    batch = _example_batch(accelerator, args, owner=owner, advice=advice) if todo else None
    if batch is None:
        return prepare(*args, device_placement=device_placement)
    if _is_fsdp2(accelerator):
        prepared = prepare(*args, device_placement=device_placement)
        result = list(prepared) if len(args) > 1 else [prepared]
        for i in todo:
            result[i] = _rematerialize_one(accelerator, result[i], batch, owner=owner)
        return tuple(result) if len(args) > 1 else result[0]
    for i in todo:
        placement = None if device_placement is None else device_placement[i]
        args[i] = _rematerialize_one(accelerator, args[i], batch, owner=owner,
                                     device_placement=placement)
    return prepare(*args, device_placement=device_placement)


def _train_unmodified(accelerator: Accelerator, settings: RematSettings, why: Exception, *,
                      owner: str) -> None:
    """Raise ``why`` as a ``ValueError`` when ``strict``; else warn (main process) that the model
    trains unmodified."""
    if settings.strict:
        raise ValueError(f"{owner}: {why}") from why
    if accelerator.is_main_process:
        warnings.warn(f"{owner}: the model trains unmodified (strict=False): {why}",
                      stacklevel=5)


def _example_batch(accelerator: Accelerator, args: list, *, owner: str, advice: str) -> Any:
    """The first batch of the first loader among ``args`` (or prepared before), one process's
    share; ``None`` (with a warning) when there is none to use and ``strict`` is off."""
    loaders = [obj for obj in args if isinstance(obj, torch.utils.data.DataLoader)]
    loaders = loaders or list(accelerator._dataloaders)
    try:
        if not loaders:
            raise CannotDrawBatch("prepare() got no DataLoader to read an example batch from "
                                  f"(and none was prepared before); {advice}")
        with isolated_rng():
            batch = first_batch(loaders[0])
        if _batch_problem(batch) is not None:  # a script left as it is keeps training
            raise CannotDrawBatch(f"its first batch does not fit: {_batch_problem(batch)}")
    except CannotDrawBatch as e:
        _train_unmodified(accelerator, accelerator.hiremate_plugin.settings, e, owner=owner)
        return None
    if accelerator.split_batches and accelerator.num_processes > 1:
        share = find_batch_size(batch) // accelerator.num_processes
        batch = slice_tensors(batch, slice(0, share))
    return batch


def _original(model: nn.Module) -> nn.Module:
    """The user's module behind a :class:`remat.RematModule` (anything else as it is)."""
    return model.original if isinstance(model, RematModule) else model


class HiRemateAccelerator(Accelerator):
    """An ``Accelerator`` whose ``prepare`` rematerializes the models it is given.

    Every other behaviour is Accelerate's. Without a plugin and without ``HIREMATE_BUDGET`` in the
    environment it is a plain ``Accelerator``. To rematerialize a script that builds a plain
    ``Accelerator`` without editing it, launch it with ``python -m integrations.accelerate``
    instead (the same code runs; NOTE [ One implementation, two ways in ]).

    Args:
        *args: ``Accelerator`` arguments.
        hiremate_plugin: The settings; ``None`` reads them from the ``HIREMATE_*`` environment
            variables (see :meth:`HiRematePlugin.from_env`).
        **kwargs: ``Accelerator`` keyword arguments.

    Attributes:
        hiremate_plugin: The settings in use, or ``None`` (rematerialization off).
        hiremate_results: Target name (``""`` for a whole model) ->
            :class:`~integrations._remat_shared.TargetResult`, for the models prepared so far.

    Raises:
        ValueError: malformed ``HIREMATE_*`` variables, or a distributed setup that is not
            supported (DeepSpeed, FSDP1, Megatron-LM, XLA, tensor parallelism, dynamo backend).

    Example:
        >>> accelerator = HiRemateAccelerator(hiremate_plugin=HiRematePlugin(budget="50%"))
        >>> model, opt, loader = accelerator.prepare(model, opt, loader)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, hiremate_plugin: Optional[HiRematePlugin] = None,
                 **kwargs: Any) -> None:
        if hiremate_plugin is None:
            hiremate_plugin = HiRematePlugin.from_env()
        elif not isinstance(hiremate_plugin, HiRematePlugin):
            raise TypeError(f"hiremate_plugin={hiremate_plugin!r}: expected a HiRematePlugin or "
                            "None (read HIREMATE_* variables)")
        super().__init__(*args, **kwargs)
        _attach(self, hiremate_plugin)
        if hiremate_plugin is not None:
            _check_supported(self)

    def rematerialize(self, model: nn.Module, batch: Any, *,
                      device_placement: Optional[bool] = None) -> nn.Module:
        """Rematerialize ``model`` on ``batch`` now (call it before ``prepare``).

        Use it when ``prepare`` gets no DataLoader, or the batch needs another form (see
        NOTE [ The example batch in prepare() ]). ``prepare`` then leaves the model as it is.

        Returns:
            The model to pass to ``prepare`` (see :func:`rematerialize_for_accelerate`).

        Raises:
            ValueError: when no plugin is configured.
        """
        if self.hiremate_plugin is None:
            raise ValueError(f"{_OWNER}.rematerialize: no HiRematePlugin; pass "
                             "hiremate_plugin=HiRematePlugin(...) or set HIREMATE_BUDGET")
        return _rematerialize_one(self, model, batch, owner=_OWNER,
                                  device_placement=device_placement)

    def prepare(self, *args: Any, device_placement: Optional[list] = None) -> Any:
        """Rematerialize the models among ``args``, then ``Accelerator.prepare`` everything.

        See NOTE [ The example batch in prepare() ] and NOTE [ Wrapping order ].
        """
        if self.hiremate_plugin is None:
            return super().prepare(*args, device_placement=device_placement)
        return _prepare(self, list(args), device_placement, super().prepare, owner=_OWNER,
                        advice="pass the training DataLoader in the same prepare() call, or "
                               "call accelerator.rematerialize(model, batch) first")

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """``Accelerator.unwrap_model``, then the original module of a ``RematModule``."""
        return _original(super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                              keep_torch_compile=keep_torch_compile))


if __name__ == "__main__":
    # ``python -m integrations.accelerate SCRIPT [ARGS...]``: this file runs as ``__main__``, a
    # second copy of the module; the launcher uses the imported ``integrations.accelerate`` so
    # that the script, HiRemateAccelerator and the patch see one set of classes.
    from integrations._accelerate_launch import main

    raise SystemExit(main())
