"""What ``HiRemateCallback`` (Lightning) and the Accelerate integration share.

Framework-free (torch and :mod:`remat` only): argument checks, which modules are targets, solving
on rank 0 then sharing the plans with every rank, and the summary table (the warmup step that
records the targets' calls is in :mod:`integrations._warmup`). Papers: HiRemate (Gusak et
al., ICML 2025), Rockmate (Zhao et al., ICML 2023).

NOTE [ Same plan on every rank ]
    ``rematerialize`` times each op on the example batch; times measured on different ranks
    differ, so independent solves could pick different schedules. Rank 0 captures and solves;
    its :class:`remat.PlanCache` is broadcast and the other ranks capture the same graph, which
    hits the cache (no solve; the op costs rank 0 measured where the machines match: NOTE
    [ Costs measured once ]). Rank 0's failures are broadcast too, so every rank takes the same
    decision (raise with ``strict=True``, train that target unmodified otherwise)
    and no rank waits forever in a collective. A schedule solved later in training (a size bucket
    none of the schedules fits) is solved by each rank on its own: gradients stay exact, only the
    schedules may differ between ranks.

NOTE [ Budgets over many batch sizes ]
    ``remat.rematerialize`` captures the warmup batch's shapes as they are (NOTE [ Static first
    ] in ``remat/module.py``), and the first batch of other sizes (dynamic padding, a short last
    batch) captures the step once more, inside that training step, with dynamic dimensions: it
    takes the first capture's op costs and, where the graphs match op for op, its schedule, so
    nothing is measured there unless a tenth of the ops differ (NOTE [ Costs carried to the
    dynamic capture ] in ``remat/carry.py``). Static shapes halved the setup of the FSDP2 test
    run whose shapes never change (117 -> 55 s, one capture per unit and rank). Later batches
    reuse the dynamic graph and run the fastest solved schedule that fits at their size,
    re-priced by the simulator, with a new solve only per size bucket that none fits (NOTE [
    Shape-generic plans ] in ``remat/sizes.py``). A byte budget holds for every size; a fraction
    follows the largest unmodified-step peak seen so far; a size that cannot fit runs with the
    lowest-peak schedule and one warning.
"""
from __future__ import annotations

import difflib
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

import remat
from remat import (
    Budget,
    CaptureError,
    Plan,
    PlanCache,
    RematError,
    RematModule,
    format_bytes,
    track_memory,
)
from remat.example_call import OWN_OPTION_WARNING

__all__ = [
    "Collectives",
    "RematSettings",
    "StepMeter",
    "Target",
    "TargetResult",
    "check_settings",
    "default_targets",
    "resolve_names",
    "solve_targets",
    "first_step_line",
    "format_table",
]

_NAME = re.compile(r"^\w+(\.\w+)*$")


# ---- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RematSettings:
    """Validated settings common to the callback and the Accelerate plugin.

    Attributes:
        budget: The parsed budget (``budget.text`` is what the user wrote).
        solver: A key of ``remat.SOLVERS``.
        time_limit: Seconds each solve may take.
        module: Dotted attribute paths of the modules to rematerialize, or ``None`` (default).
        cache_dir: Directory of the on-disk plan cache, or ``None``.
        strict: Raise instead of training unmodified when a target cannot be rematerialized.
        verbose: Log progress lines and the summary table.
    """

    budget: Budget
    solver: str
    time_limit: float
    module: tuple[str, ...] | None
    cache_dir: str | None
    strict: bool
    verbose: bool


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_settings(
    *,
    budget: Any,
    solver: Any,
    time_limit: Any,
    module: Any,
    cache_dir: Any,
    strict: Any,
    verbose: Any,
    names: Mapping[str, str] | None = None,
) -> RematSettings:
    """Check every setting and return them normalised.

    The budget and the time limit are checked by remat's own checkers (NOTE [ One check per
    setting ] in ``remat/settings.py``), so the callbacks, the ``HIREMATE_*`` variables, a
    recipe and ``remat.rematerialize`` accept and refuse the same values.

    Args:
        budget, solver, time_limit, module, cache_dir, strict, verbose: As the user gave them.
        names: How the user spelled each setting in messages (default: the argument name, e.g.
            ``{"budget": "HIREMATE_BUDGET"}`` for environment variables).

    Raises:
        ValueError: a malformed budget (a bare number other than a fraction in (0, 1]
            included), an unknown solver, a time limit that is not a finite number > 0, an
            empty or malformed module name.
        TypeError: a value of the wrong type (``time_limit="60"``, ``strict="yes"``, ...).
    """
    label = {k: k for k in ("budget", "solver", "time_limit", "module", "cache_dir", "strict",
                            "verbose")}
    label.update(names or {})
    parsed = remat.parse_budget(budget, name=label["budget"])
    if not isinstance(solver, str) or solver not in remat.SOLVERS:
        raise ValueError(
            f"{label['solver']}={solver!r}: unknown solver{_suggest(str(solver), remat.SOLVERS)}; "
            f"expected one of {', '.join(remat.SOLVERS)} (default {remat.DEFAULT_SOLVER!r})"
        )
    seconds = remat.check_time_limit(time_limit, name=label["time_limit"])
    names_ = _check_module(module, label["module"])
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"{label['cache_dir']}={cache_dir!r}: expected a directory path or None")
    for key, value in (("strict", strict), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"{label[key]}={value!r}: expected True or False")
    return RematSettings(
        budget=parsed, solver=solver, time_limit=seconds, module=names_,
        cache_dir=None if cache_dir is None else os.fspath(cache_dir), strict=strict,
        verbose=verbose,
    )


def _check_module(module: Any, label: str) -> tuple[str, ...] | None:
    if module is None:
        return None
    names = [module] if isinstance(module, str) else module
    if not isinstance(names, (list, tuple)) or not names:
        raise TypeError(f"{label}={module!r}: expected None (automatic), an attribute name such "
                        "as 'net', or a list of names such as ['encoder', 'decoder']")
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{label}={module!r}: {name!r} is not an attribute path; expected "
                             "names such as 'net' or 'model.encoder'")
    if len(set(names)) != len(names):
        raise ValueError(f"{label}={module!r}: a name is listed twice")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"{label}={module!r}: {b!r} is inside {a!r}; list only one of them")
    return tuple(names)


# ---- targets -------------------------------------------------------------------------------------


@dataclass
class Target:
    """A module to rematerialize and where it hangs.

    Attributes:
        name: Dotted path from the root (``""`` for the root itself).
        parent: The module holding it (``None`` for the root).
        attr: Its attribute name on ``parent``.
        module: The module.
        explicit: Named by the user (rather than chosen automatically).
    """

    name: str
    parent: nn.Module | None
    attr: str
    module: nn.Module
    explicit: bool


def resolve_names(root: nn.Module, names: Sequence[str], *, owner: str) -> list[Target]:
    """The targets named by ``names`` (dotted attribute paths under ``root``).

    Raises:
        ValueError: a name that is not a submodule of ``root``, with the closest name and the
            top-level children that hold parameters.
    """
    targets = []
    for name in names:
        *path, attr = name.split(".")
        parent = root
        try:
            for part in path:
                parent = getattr(parent, part)
            module = getattr(parent, attr)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Module) or not isinstance(parent, nn.Module):
            candidates = [n for n, m in root.named_children() if _has_parameters(m)]
            every = [n for n, _ in root.named_modules() if n]
            raise ValueError(
                f"{owner}(module={name!r}): {type(root).__name__} has no submodule {name!r}"
                f"{_suggest(name, every)} Top-level modules holding parameters: "
                f"{', '.join(candidates) or '(none)'}. Pass one of them, a dotted path such as "
                "'net.encoder', or module=None to choose every top-level module that holds "
                "parameters and is called in the training step."
            )
        targets.append(Target(name, parent, attr, module, explicit=True))
    return targets


def _has_parameters(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def default_targets(root: nn.Module) -> list[Target]:
    """Every top-level child of ``root`` holding parameters that require grad."""
    return [Target(name, root, name, child, explicit=False)
            for name, child in root.named_children() if _has_parameters(child)]


# ---- solving -------------------------------------------------------------------------------------


@dataclass
class TargetResult:
    """What happened to one target.

    Attributes:
        name: Its dotted path.
        plan: The plan solved for the warmup batch (``None`` if it trains unmodified).
        plans: Every plan solved for it so far (the first, then one per size bucket that needed
            its own schedule; updated while swapped).
        capture_time_s: Wall time of capture + profiling + solve (or cache lookup) on this rank.
        skipped: Why it trains unmodified, or ``""``.
        remat_module: The :class:`remat.RematModule` swapped in (``None`` if skipped).
    """

    name: str
    plan: Plan | None = None
    plans: list[Plan] = field(default_factory=list)
    capture_time_s: float = 0.0
    skipped: str = ""
    remat_module: RematModule | None = field(default=None, repr=False)


@dataclass
class Collectives:
    """How to talk to the other ranks (the defaults suit one process).

    Attributes:
        rank: This process's global rank.
        world_size: Number of processes.
        broadcast: ``broadcast(obj) -> obj`` from rank 0 (called on every rank).
        all_true: ``all_true(flag) -> bool``: whether ``flag`` holds on every rank.
        all_max: ``all_max(number) -> number``: the largest of every rank's ``number``.
    """

    rank: int = 0
    world_size: int = 1
    broadcast: Callable[[Any], Any] = lambda obj: obj
    all_true: Callable[[bool], bool] = lambda flag: flag
    all_max: Callable[[int], int] = lambda number: number


def _label(name: str) -> str:
    return repr(name) if name else "the model"


def _rematerialize(target: Target, args: tuple, kwargs: dict, settings: RematSettings,
                   cache: PlanCache, result: TargetResult,
                   measured: tuple[int, int] | None = None) -> None:
    t0 = time.perf_counter()
    eager, step = measured if measured is not None else (None, None)
    with warnings.catch_warnings():  # the options are the integration's, not the user's
        # NOTE [ Options that share a name with the model's ]: the recorded call is the whole
        # example call; Mixtral's forward takes ``cache`` and warned on every fit
        warnings.filterwarnings("ignore", message=OWN_OPTION_WARNING, category=UserWarning)
        rm = remat.rematerialize(
            target.module, *args, budget=settings.budget, solver=settings.solver,
            time_limit=settings.time_limit, cache=cache, eager_peak_bytes=eager,
            step_peak_bytes=step, example_kwargs=kwargs,
        )
    result.capture_time_s = time.perf_counter() - t0
    result.remat_module = rm
    result.plan = rm.plan
    result.plans = rm.plans


def _step_shares(targets: Sequence[Target], calls: Mapping[str, tuple[tuple, dict]],
                 step_peak_bytes: int | None) -> dict[str, tuple[int, int]]:
    """Name -> ``(eager_peak_bytes, step_peak_bytes)`` for :func:`remat.rematerialize`.

    NOTE [ Charging the rest of the step ]
    A percentage budget is a percentage of the whole training step the user measures, loss
    included (NOTE [ A budget is what the user measures ] in ``remat/budget.py``). The warmup
    measures that step; each target's own eager step is measured here, and the step is shared
    among the targets in proportion to their own peaks, so that what the rest of the step adds
    (a loss head over the logits, code between the targets) is charged against the budget once,
    not once per target.
    """
    if not step_peak_bytes or not targets:
        return {}
    own = {}
    for t in targets:
        try:
            own[t.name] = remat.measure_eager_step(t.module, *calls[t.name][0],
                                                   **calls[t.name][1])
        except Exception:  # noqa: BLE001 - the capture reports a broken target with its reason
            return {}
    total = sum(own.values())
    if total <= 0:
        return {}
    return {name: (peak, max(1, round(step_peak_bytes * peak / total)))
            for name, peak in own.items() if peak > 0}


def solve_targets(
    targets: Sequence[Target],
    calls: Mapping[str, tuple[tuple, dict]],
    settings: RematSettings,
    cache: PlanCache,
    *,
    owner: str,
    comm: Collectives | None = None,
    info: Callable[[str], None] = lambda message: None,
    warn: Callable[[str], None] = lambda message: None,
    step_peak_bytes: int | None = None,
) -> dict[str, TargetResult]:
    """Rematerialize every target with its recorded call; see NOTE [ Same plan on every rank ].

    Nothing is swapped here: each successful result carries its ``remat_module``.

    Args:
        targets: The targets (all of them present in ``calls``).
        calls: Name -> the ``(args, kwargs)`` recorded for it.
        settings: Budget, solver, ...
        cache: The plan cache (filled on rank 0, received on the others).
        owner: ``"HiRemateCallback"`` or ``"HiRemateAccelerator"``, for messages.
        comm: Collectives for multi-process runs.
        info: Logs progress lines (rank 0 only).
        warn: Emits a warning (rank 0 only).
        step_peak_bytes: The measured peak of the whole eager training step (loss included),
            when the targets are only part of it: see NOTE [ Charging the rest of the step ].

    Returns:
        Name -> :class:`TargetResult`.

    Raises:
        remat.RematError: with ``strict=True``, when a target cannot be rematerialized (on every
            rank: rank 0 raises the original error, the others a ``RematError`` quoting it).
    """
    comm = comm or Collectives()
    measured = _step_shares(targets, calls, step_peak_bytes)
    results = {t.name: TargetResult(t.name) for t in targets}
    errors: dict[str, str] = {}
    originals: dict[str, BaseException] = {}
    fatal: BaseException | None = None
    if comm.rank == 0:
        for t in targets:
            # Whether the plan cache has it is known only once the graph is captured.
            then = (", then solving unless the plan cache has it" if len(cache) or cache.directory
                    else " and solving")
            info(f"{owner}: capturing {_label(t.name)}{then} (budget {settings.budget}, solver "
                 f"{settings.solver!r}, time limit {settings.time_limit:g} s) ...")
            try:
                _rematerialize(t, *calls[t.name], settings, cache, results[t.name],
                               measured.get(t.name))
            except CaptureError as e:
                if e.reason == "no_grad" and not t.explicit:
                    results[t.name].skipped = "nothing requires grad in its call"
                    continue
                errors[t.name], originals[t.name] = f"{type(e).__name__}: {e}", e
            except RematError as e:
                errors[t.name], originals[t.name] = f"{type(e).__name__}: {e}", e
            except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
                fatal = e
                break
            else:
                plan = results[t.name].plan
                cut = ("; time_limit cut the solve short, so this plan may differ from run "
                       f"to run: raise time_limit (was {settings.time_limit:g} s) for one that "
                       "does not depend on machine load"
                       if plan.status == "time_limit" and not plan.cache_hit else "")
                info(f"{owner}: {_label(t.name)} ready in "
                     f"{results[t.name].capture_time_s:.1f} s ("
                     + ("plan from the cache" if plan.cache_hit else
                        f"solved in {plan.solve_time_s:.1f} s, {plan.status}") + f"){cut}")
    if comm.world_size > 1:
        payload = comm.broadcast({
            "cache": cache.state_dict(), "errors": errors,
            "skipped": {n: r.skipped for n, r in results.items() if r.skipped},
            "fatal": None if fatal is None else f"{type(fatal).__name__}: {fatal}",
        } if comm.rank == 0 else None)
        if comm.rank != 0:
            if payload["fatal"] is not None:
                raise RematError(f"{owner}: rank 0 failed while solving: {payload['fatal']}")
            cache.load_state_dict(payload["cache"])
            errors = dict(payload["errors"])
            for t in targets:
                if t.name in payload["skipped"]:
                    results[t.name].skipped = payload["skipped"][t.name]
                elif t.name not in errors:
                    try:
                        _rematerialize(t, *calls[t.name], settings, cache, results[t.name],
                               measured.get(t.name))
                    except Exception as e:  # noqa: BLE001 - every rank decides together below
                        errors[t.name] = f"{type(e).__name__} on rank {comm.rank}: {e}"
                        originals[t.name] = e
                        warnings.warn(f"{owner}: {errors[t.name]}", stacklevel=2)
                    if results[t.name].plan is not None and not results[t.name].plan.cache_hit:
                        warnings.warn(
                            f"{owner}: rank {comm.rank} captured a different graph for "
                            f"{t.name!r} than rank 0 and solved its own plan; ranks may use "
                            "different schedules (gradients are still exact)", stacklevel=2)
        if not comm.all_true(not (set(errors) - set(payload["errors"]))):
            # Some rank failed where rank 0 succeeded: no rank uses remat for any target (with
            # strict=True every rank raises), so no rank is left waiting in a collective.
            for name in results:
                if name not in errors and not results[name].skipped:
                    errors[name] = "another rank could not rematerialize the targets"
    if fatal is not None:
        raise fatal
    for name, message in errors.items():
        result = results[name]
        result.remat_module, result.plan, result.plans = None, None, []
        if settings.strict:
            if name in originals:
                raise originals[name]
            raise RematError(f"{owner}: {_label(name)} cannot be rematerialized: {message}")
        result.skipped = message
        warn(f"{owner}: {_label(name)} trains unmodified (strict=False): {message}")
    return results


# ---- report --------------------------------------------------------------------------------------


class StepMeter:
    """The measured peak of one step (``remat.track_memory`` between :meth:`start` and
    :meth:`stop`): the eager warmup step and the first training step that the callback and the
    Accelerate integration report (on CPU the profiler runs during those steps only).

    Attributes:
        peak_bytes: The peak of the last measured step (``None`` before one was measured).
    """

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self._open: tuple[Any, Any] | None = None

    @property
    def running(self) -> bool:
        return self._open is not None

    def start(self, device: torch.device) -> bool:
        """Start measuring on ``device``; ``False`` when it cannot measure now (another device
        type, or another ``torch.profiler`` session running on CPU)."""
        if self._open is not None or device.type not in ("cpu", "cuda"):
            return False
        memory = track_memory(device)
        try:
            self._open = (memory, memory.__enter__())
        except RuntimeError:  # a torch.profiler session is already running (CPU)
            return False
        return True

    def stop(self) -> int | None:
        """Stop measuring: the step's peak bytes (``None`` when nothing was being measured)."""
        if self._open is None:
            return None
        (memory, tracker), self._open = self._open, None
        memory.__exit__(None, None, None)
        self.peak_bytes = tracker.peak_bytes
        return self.peak_bytes


def first_step_line(step_peak_bytes: int, eager_peak_bytes: int | None, *, owner: str) -> str:
    """``"<owner>: measured peak of the first training step: 62.41 MiB (48% of the unmodified
    warmup step's 129.20 MiB)"``: the rematerialized step against the unmodified one."""
    line = f"{owner}: measured peak of the first training step: {format_bytes(step_peak_bytes)}"
    if eager_peak_bytes:
        line += (f" ({100 * step_peak_bytes / eager_peak_bytes:.0f}% of the unmodified warmup "
                 f"step's {format_bytes(eager_peak_bytes)})")
    return line


def format_table(results: Mapping[str, TargetResult], settings: RematSettings, *, owner: str,
                 eager_peak_bytes: int | None = None,
                 eager_detail: str = "forward + backward") -> str:
    """One table: a row per target with the plan's numbers (rank 0 logs it), then the measured
    peak of the unmodified warmup step, when known (``eager_detail`` says what it ran)."""
    header = ("target", "baseline", "budget", "predicted peak", "overhead", "solver status",
              "solve", "capture", "cache")
    rows = []
    for name, r in results.items():
        p = r.plan
        if p is None:
            rows.append((name or "(model)", "-", "-", "-", "-", f"unmodified: {r.skipped[:60]}",
                         "-", "-", "-"))
            continue
        rows.append((
            name or "(model)", format_bytes(p.baseline_bytes), format_bytes(p.budget_bytes),
            f"{format_bytes(p.predicted_peak_bytes)} ({100 * p.predicted_step_ratio:.0f}%)",
            f"+{100 * p.predicted_overhead:.1f}%", f"{p.solver} ({p.status})",
            f"{p.solve_time_s:.2f} s", f"{r.capture_time_s:.2f} s",
            "hit" if p.cache_hit else "miss",
        ))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = [f"{owner}: memory under budget {settings.budget} (predicted per step; % of the "
             "measured eager step, of the compiled baseline where it was not measured)"]
    lines += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
              for row in (header, *rows)]
    if eager_peak_bytes is not None:
        lines.append(f"  measured peak of the unmodified warmup step: "
                     f"{format_bytes(eager_peak_bytes)} ({eager_detail})")
    return "\n".join(lines)
