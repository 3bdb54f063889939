"""``PlanCache``: solved schedules keyed by the graph they were solved for.

NOTE [ Plan cache ]
A key hashes what determines a schedule's validity and cost model: every op's structural
signature, wiring, byte sizes and flags (not its measured time, which is noisy), plus the budget
as the user wrote it, the solver and its options. A hit skips profiling and solving: the stored
schedule is checked against the graph with the simulator (a stale or foreign entry is ignored,
never trusted). The cache lives in memory and, when given a directory, in one JSON file per key
there, so a re-run or a resumed job skips solving; ``state_dict()`` lets a Lightning callback
keep it in a checkpoint, and broadcasting it from rank 0 gives every DDP rank the same plan.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .budget import Budget
from .graph import RematGraph
from .plan import Plan
from .schedule import Schedule

__all__ = ["PlanCache", "graph_key"]

log = logging.getLogger(__name__)

_VERSION = 1


def graph_key(graph: RematGraph, budget: Budget, solver: str, options: dict | None = None) -> str:
    """A stable hash of ``graph``'s structure and the solve settings (see NOTE [ Plan cache ])."""
    from .sizes import structure_key

    h = hashlib.sha256()
    h.update(f"v{_VERSION}|{budget.fraction}|{budget.bytes}|{solver}|{sorted((options or {}).items())}".encode())
    # The structure with size symbols renamed canonically (captures name them independently),
    # and the bytes at the captured sizes.
    h.update(structure_key(graph)[0].encode())
    h.update(str([v.nbytes for v in graph.values]).encode())
    return h.hexdigest()[:32]


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
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, dict[str, Any]] = {}

    def get(self, key: str) -> tuple[Schedule, Plan] | None:
        """The schedule and plan stored under ``key``, or ``None``."""
        entry = self._entries.get(key)
        if entry is None and self.directory is not None:
            path = self.directory / f"{key}.json"
            if path.exists():
                try:
                    entry = json.loads(path.read_text())
                except (OSError, ValueError) as exc:
                    log.warning("ignoring unreadable plan cache file %s: %s", path, exc)
                    return None
                self._entries[key] = entry
        if entry is None or entry.get("version") != _VERSION:
            return None
        schedule = Schedule(tuple(entry["forward"]), frozenset(entry["saved"]), tuple(entry["backward"]))
        return schedule, Plan(**entry["plan"])

    def put(self, key: str, schedule: Schedule, plan: Plan) -> None:
        """Store a solved schedule (and write it to disk when the cache has a directory)."""
        entry = {
            "version": _VERSION,
            "forward": list(schedule.forward),
            "saved": sorted(schedule.saved),
            "backward": list(schedule.backward),
            "plan": asdict(plan),
        }
        self._entries[key] = entry
        if self.directory is not None:
            path = self.directory / f"{key}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, path)  # atomic: concurrent ranks never read half a file

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def state_dict(self) -> dict[str, Any]:
        """Every entry seen in this process (to store in a checkpoint or broadcast)."""
        return {"version": _VERSION, "entries": dict(self._entries)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Add the entries of a :meth:`state_dict` (entries of other versions are ignored)."""
        if state.get("version") != _VERSION:
            return
        self._entries.update(state.get("entries", {}))
