"""``PlanCache``: solved schedules keyed by the graph they were solved for.

NOTE [ Plan cache ]
A key hashes what determines a schedule's validity and cost model: every op's structural
signature, wiring, byte sizes and flags (not its measured time, which is noisy), plus the budget
as the user wrote it, the solver and its options. A hit skips solving, but nothing
in the file is trusted: the schedule is re-simulated on the graph (a stale or foreign entry does
not fit it), checked against the budget requested now (an entry edited or copied from another
budget is refused), and the plan's numbers are recomputed from the simulation. Malformed files
are ignored with a warning; files are written under unique temporary names and renamed into
place; a directory that cannot be written warns and the run goes on. The cache lives in memory
and, when given a directory, in one JSON file per key there, so a re-run or a resumed job skips
solving; ``state_dict()`` lets a Lightning callback keep it in a checkpoint, and broadcasting it
from rank 0 gives every DDP rank the same plan.

NOTE [ The same plan every run ]
Op times measured on a shared machine move by tens of percent from one process to the next, and
the solver's choices move with them: four identical runs of a 4-layer GPT-2 fine-tune at 50%
predicted +3.2%, +16.6%, +3.9% and +8.4% overhead, each a different schedule. A user comparing
two runs (or resuming one) expects the same plan for the same model, batch and budget. So
:func:`remat.rematerialize` (and :func:`remat.backend`) keep solved schedules on disk by default,
in the user's cache directory (:func:`default_cache_dir`): the first run on a machine solves, every
later one runs the same schedule (re-checked as any hit is), whatever the load then. Prices are
also made steadier at the source (NOTE [ The fastest sample is the op's price ] in
:mod:`remat.costs`), so the first solve is less of a lottery. ``Plan.fingerprint`` shows which
schedule a run has. ``cache=False`` or ``HIREMATE_CACHE_DIR=off`` turns the disk cache off.

NOTE [ Costs measured once ]
Measuring a graph's op costs (a run under the memory profiler for scratch bytes, then three timed
runs) took 2.1-2.6 s of the 8.8 s setup of a 4-layer GPT (638 ops) on 2 cores, more than the
solve, and a cache hit measured them again only to re-check a schedule whose numbers it then
printed from new, noisier times. The cache keeps them beside the plans, under a key of the graph
alone (:func:`costs_key`: no budget, so every budget of a model shares them) and tagged with the
machine they were measured on (device model, threads, PyTorch build: :func:`remat.costs.
machine_tag`). A later capture of the same graph on the same machine takes them instead of
measuring: the same scratch bytes for the budget check, the same times for the plan, and no
unmodified step run inside training (NOTE [ Measuring ops one at a time ]). Costs from another
machine, of another length, or not wholly measured (inside a profiler, memory only) are not used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .budget import Budget
from .costs import OpCosts
from .graph import RematGraph
from .plan import Plan
from .schedule import Schedule
from .sized_graph import structure_key

__all__ = ["PlanCache", "costs_key", "default_cache_dir", "graph_key", "plan_cache_for",
           "resolve_cache"]

log = logging.getLogger(__name__)

_VERSION = 1
_COSTS = "costs"  # the subdirectory of measured op costs (NOTE [ Costs measured once ])


def graph_key(graph: RematGraph, budget: Budget, solver: str, options: dict | None = None, *,
              structure: str | None = None) -> str:
    """A stable hash of ``graph``'s structure and the solve settings (see NOTE [ Plan cache ]).

    ``structure`` is ``remat.sized_graph.structure_key(graph)[0]`` when the caller has it already.
    """
    h = hashlib.sha256()
    h.update(f"v{_VERSION}|{budget.fraction}|{budget.bytes}|{solver}|{sorted((options or {}).items())}".encode())
    # The structure with size symbols renamed canonically (captures name them independently),
    # and the bytes at the captured sizes.
    h.update((structure or structure_key(graph)[0]).encode())
    h.update(str([v.nbytes for v in graph.values]).encode())
    return h.hexdigest()[:32]


def costs_key(graph: RematGraph, *, structure: str | None = None) -> str:
    """A stable hash of ``graph``'s structure and byte sizes: what its measured op costs
    depend on in the graph (NOTE [ Costs measured once ])."""
    h = hashlib.sha256()
    h.update(f"costs-v{_VERSION}|".encode())
    h.update((structure or structure_key(graph)[0]).encode())
    h.update(str([v.nbytes for v in graph.values]).encode())
    return h.hexdigest()[:32]


# Values of HIREMATE_CACHE_DIR (or a cache directory setting) that mean "no disk cache".
CACHE_OFF = frozenset({"", "0", "off", "false", "no", "none"})


def default_cache_dir() -> Path | None:
    """Where plans are kept by default (NOTE [ The same plan every run ]): ``$HIREMATE_CACHE_DIR``
    if set (``off``, ``0``, ``false`` or empty: nowhere), else ``hiremate/plans`` in
    ``$XDG_CACHE_HOME`` (``~/.cache`` when unset)."""
    value = os.environ.get("HIREMATE_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in CACHE_OFF else Path(value).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root).expanduser() / "hiremate" / "plans"


def resolve_cache(cache: "PlanCache | str | os.PathLike | bool | None", *,
                  name: str = "cache") -> "PlanCache | None":
    """The plan cache a user's ``cache=`` argument means: ``True`` the default directory
    (:func:`default_cache_dir`, or none when turned off), ``False``/``None`` no cache, a path
    a cache in that directory (``"off"``: none), a :class:`PlanCache` itself."""
    if isinstance(cache, PlanCache) or cache is None:
        return cache
    if isinstance(cache, bool):
        if not cache:
            return None
        directory = default_cache_dir()
        return None if directory is None else PlanCache(directory)
    if isinstance(cache, (str, os.PathLike)):
        return None if os.fspath(cache).strip().lower() in CACHE_OFF else PlanCache(cache)
    raise TypeError(f"{name}={cache!r}: expected True (the default plan cache directory), False "
                    "(no cache), a directory path or a remat.PlanCache; pass e.g. "
                    f"{name}='~/.cache/hiremate/plans'")


def plan_cache_for(directory: "str | os.PathLike | None") -> "PlanCache":
    """The cache a callback or plugin keeps (always one: it also carries plans between DDP
    ranks and into checkpoints): in ``directory``, or the default one when ``None``
    (NOTE [ The same plan every run ]), in memory only where that is turned off."""
    cache = resolve_cache(True if directory is None else directory)
    return PlanCache() if cache is None else cache  # (an empty cache is falsy: no ``or``)


class PlanCache:
    """Solved schedules, in memory and optionally on disk.

    Args:
        directory: Where to keep one JSON file per solved graph (created if missing), or
            ``None`` for an in-memory cache.

    Example:
        >>> cache = remat.PlanCache("~/.cache/hiremate")
        >>> net = remat.rematerialize(net, batch, budget="50%", cache=cache)   # solves
        >>> net = remat.rematerialize(net2, batch, budget="50%", cache=cache)  # cache hit
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else None
        self._entries: dict[str, dict[str, Any]] = {}
        self._costs: dict[str, dict[str, Any]] = {}  # NOTE [ Costs measured once ]
        self._unwritable = False
        if self.directory is not None:
            try:
                (self.directory / _COSTS).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._cannot_write(exc)

    def get(self, key: str) -> tuple[Schedule, Plan] | None:
        """The schedule and plan stored under ``key``, or ``None``.

        The plan's numbers are what the file says: :class:`remat.RematBackend` re-simulates
        the schedule and recomputes them before using it (NOTE [ Plan cache ]). A file that is
        not a well-formed entry is ignored with a warning.
        """
        entry = self._entries.get(key)
        if entry is None and self.directory is not None:
            path = self.directory / f"{key}.json"
            entry = _read(path, "plan cache")
            if entry is None:
                return None
            problem = _malformed(entry)
            if problem:
                warnings.warn(f"remat: ignoring plan cache file {path}: {problem}", stacklevel=2)
                return None
            self._entries[key] = entry
        if entry is None or _malformed(entry):
            return None
        schedule = Schedule(tuple(entry["forward"]), frozenset(entry["saved"]),
                            tuple(entry["backward"]))
        known = {f.name for f in dataclasses.fields(Plan)}
        try:
            plan = Plan(**{k: v for k, v in entry["plan"].items() if k in known})
        except TypeError as exc:
            warnings.warn(f"remat: ignoring plan cache entry {key}: {exc}", stacklevel=2)
            return None
        return schedule, plan

    def put(self, key: str, schedule: Schedule, plan: Plan) -> None:
        """Store a solved schedule (and write it to disk when the cache has a directory).

        The file is written under a unique temporary name and renamed into place, so concurrent
        writers (DDP ranks, two jobs) never collide and readers never see half a file. A
        directory that cannot be written warns once; the run goes on with the in-memory cache.
        """
        entry = {
            "version": _VERSION,
            "forward": list(schedule.forward),
            "saved": sorted(schedule.saved),
            "backward": list(schedule.backward),
            "plan": asdict(plan),
        }
        self._entries[key] = entry
        self._write(f"{key}.json", entry)

    def get_costs(self, key: str, machine: str, num_ops: int) -> OpCosts | None:
        """The op costs measured on ``machine`` for the graph of :func:`costs_key` ``key``
        (NOTE [ Costs measured once ]), or ``None``: none kept, another machine's, or not
        ``num_ops`` well-formed ones."""
        entry = self._costs.get(key)
        if entry is None and self.directory is not None:
            entry = _read(self.directory / _COSTS / f"{key}.json", "op costs")
        if not isinstance(entry, dict) or entry.get("version") != _VERSION or \
                entry.get("machine") != machine:
            return None
        columns = [entry.get(name) for name in ("times", "workspaces", "rerun_times")]
        if not all(isinstance(c, list) and len(c) == num_ops for c in columns) or \
                not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                        for c in columns for x in c):
            return None
        self._costs[key] = entry
        times, workspaces, reruns = columns
        return OpCosts([float(t) for t in times], [int(w) for w in workspaces],
                       [float(t) for t in reruns])

    def put_costs(self, key: str, machine: str, costs: OpCosts) -> None:
        """Keep wholly measured op costs (others are ignored) for later captures of the graph
        on ``machine``."""
        if not costs.complete:
            return
        entry = {"version": _VERSION, "machine": machine, "times": list(costs.times),
                 "workspaces": list(costs.workspaces), "rerun_times": list(costs.rerun_times)}
        self._costs[key] = entry
        self._write(f"{_COSTS}/{key}.json", entry)

    def _write(self, name: str, entry: dict[str, Any]) -> None:
        if self.directory is None or self._unwritable:
            return
        path = self.directory / name
        tmp = None
        try:
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.stem}.",
                                             suffix=".tmp", delete=False) as f:
                tmp = f.name
                json.dump(entry, f)
            os.replace(tmp, path)  # atomic
        except OSError as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._cannot_write(exc)

    def _cannot_write(self, exc: OSError) -> None:
        if not self._unwritable:
            warnings.warn(f"remat: cannot write the plan cache in {self.directory} ({exc}); "
                          "continuing without saving plans there", stacklevel=3)
        self._unwritable = True

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def state_dict(self) -> dict[str, Any]:
        """Every entry seen in this process (to store in a checkpoint or broadcast)."""
        return {"version": _VERSION, "entries": dict(self._entries), "costs": dict(self._costs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Add the entries of a :meth:`state_dict` (entries of other versions or malformed ones
        are ignored)."""
        if not isinstance(state, dict) or state.get("version") != _VERSION:
            return
        entries = state.get("entries", {})
        if isinstance(entries, dict):
            self._entries.update({k: e for k, e in entries.items() if not _malformed(e)})
        costs = state.get("costs", {})
        if isinstance(costs, dict):  # checked against the graph when read (get_costs)
            self._costs.update({k: e for k, e in costs.items() if isinstance(e, dict)})


def _read(path: Path, what: str) -> Any:
    """The JSON in ``path``, or ``None`` when there is no such file or it cannot be read (which
    warns: a bad file never stops a run)."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        warnings.warn(f"remat: ignoring unreadable {what} file {path}: {exc}", stacklevel=4)
        return None


def _malformed(entry: Any) -> str:
    """Why ``entry`` is not a well-formed cache entry (``""`` when it is)."""
    if not isinstance(entry, dict):
        return f"expected a JSON object, got {type(entry).__name__}"
    if entry.get("version") != _VERSION:
        return f"version {entry.get('version')!r}, expected {_VERSION}"
    for name in ("forward", "saved", "backward"):
        ops = entry.get(name)
        if not isinstance(ops, list) or not all(isinstance(i, int) and i >= 0 for i in ops):
            return f"{name!r} must be a list of op indices"
    if not isinstance(entry.get("plan"), dict):
        return "'plan' must be an object"
    return ""
