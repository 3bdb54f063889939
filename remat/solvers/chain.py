"""Dynamic programming over a chain of blocks with options (Rotor / Rockmate).

NOTE [ The chain DP ]
Blocks 0..L-1 run in sequence; ``input_bytes[l]`` is what crosses into block l (its stored input
when it is a checkpoint), ``input_bytes[L]`` the size of the loss gradient entering backward. Each
block has options (:mod:`remat.solvers.options`): a forward that keeps ``saved_bytes`` and a
backward that uses them, and a forward that keeps nothing. ``C(s, t, m)`` is the least time to go
from "input of s stored, gradient of t's output available" to "gradient of s's input available"
within ``m`` bytes (everything the sub-problem allocates, including its stored input and the
incoming gradient; gradients left behind by later blocks are subtracted as they appear). Either

* run block s keeping option o's activations, solve ``(s+1, t)`` in what is left, then run
  option o's backward of s; or
* run blocks s..j-1 keeping nothing, store j's input, solve ``(j, t)``, then solve ``(s, j-1)``
  again from the stored input of s (a recomputed segment may be recomputed more than once).

The top call ``C(0, L-1, budget)`` includes the first forward, so the result minus the
unmodified step's time is the recomputation overhead. Memory is counted in slots of
``capacity / slots`` bytes, rounded up, and the table is computed for every capacity at once
(numpy over the memory axis), so a caller can pick the largest capacity whose schedule, once
simulated exactly, fits the real budget. Beaumont et al., "Optimal checkpointing for
heterogeneous chains" (2019); Zhao et al., Rockmate (ICML 2023).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["StageOption", "Stage", "ChainTable", "solve_chain"]

_CHECKPOINT = 1_000_000  # choice codes >= this are "checkpoint at j"


@dataclass(frozen=True)
class StageOption:
    """One option of a block, as the DP sees it."""

    saved_bytes: int
    forward_peak: int
    backward_peak: int
    forward_time: float
    backward_time: float


@dataclass(frozen=True)
class Stage:
    """One block of the chain.

    Attributes:
        input_bytes: Bytes that cross into the block (stored when it is a checkpoint).
        grad_bytes: Gradients its backward leaves behind until the end of the step.
        nosave_time: Seconds of a forward that keeps nothing.
        nosave_peak: Peak of that forward.
        options: The block's options.
    """

    input_bytes: int
    grad_bytes: int
    nosave_time: float
    nosave_peak: int
    options: tuple[StageOption, ...]


@dataclass
class ChainTable:
    """The DP table: best time and choice for every sub-chain and capacity."""

    stages: tuple[Stage, ...]
    unit: float
    slots: int
    time: dict[tuple[int, int], np.ndarray]
    choice: dict[tuple[int, int], np.ndarray]
    w: list[int]
    a: list[list[int]]
    g: list[int]

    def best_time(self, slot: int) -> float:
        return float(self.time[(0, len(self.stages) - 1)][slot])

    def actions(self, slot: int) -> list[tuple]:
        """The schedule at capacity ``slot``: ``("F0", l)`` forward keeping nothing,
        ``("F", l, o)`` forward keeping option o, ``("B", l, o)`` backward with option o."""
        out: list[tuple] = []
        self._rebuild(0, len(self.stages) - 1, slot, out)
        return out

    def _rebuild(self, s: int, t: int, m: int, out: list[tuple]) -> None:
        # Explicit stack (chains can be long): ("run", s, t, m) expands, ("emit", a) appends.
        work: list = [("run", s, t, m)]
        while work:
            item = work.pop()
            if item[0] == "emit":
                out.append(item[1])
                continue
            _, s, t, m = item
            code = int(self.choice[(s, t)][m])
            if code < 0:
                raise ValueError("no schedule at this capacity")
            if code < _CHECKPOINT:
                o = code
                later: list = [("emit", ("F", s, o))]
                if s < t:
                    later.append(("run", s + 1, t, m - self.w[s] - self.a[s][o]))
                later.append(("emit", ("B", s, o)))
                work.extend(reversed(later))
            else:
                j = code - _CHECKPOINT
                later = [("emit", ("F0", k)) for k in range(s, j)]
                later.append(("run", j, t, m - self.w[s]))
                later.append(("run", s, j - 1, m - sum(self.g[j:t + 1])))
                work.extend(reversed(later))


def _shift(arr: np.ndarray, k: int) -> np.ndarray:
    """``out[m] = arr[m - k]`` (``inf`` where ``m < k``)."""
    if k <= 0:
        return arr
    out = np.full_like(arr, np.inf)
    if k < len(arr):
        out[k:] = arr[: len(arr) - k]
    return out


def solve_chain(stages: list[Stage], final_grad_bytes: int, capacity_bytes: int, *,
                slots: int = 500) -> ChainTable:
    """Fill the DP table of NOTE [ The chain DP ] for capacities up to ``capacity_bytes``."""
    n = len(stages)
    unit = max(1.0, capacity_bytes / slots)

    def q(nbytes: float) -> int:
        return int(math.ceil(nbytes / unit))

    w = [q(s.input_bytes) for s in stages] + [q(final_grad_bytes)]
    g = [q(s.grad_bytes) for s in stages]
    a = [[q(o.saved_bytes) for o in s.options] for s in stages]
    fpk = [[q(o.forward_peak) for o in s.options] for s in stages]
    bpk = [[q(o.backward_peak) for o in s.options] for s in stages]
    npk = [q(s.nosave_peak) for s in stages]
    m_axis = np.arange(slots + 1)
    time: dict[tuple[int, int], np.ndarray] = {}
    choice: dict[tuple[int, int], np.ndarray] = {}
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length - 1
            best = np.full(slots + 1, np.inf)
            pick = np.full(slots + 1, -1, dtype=np.int64)
            g_after = sum(g[s + 1:t + 1])
            for o, opt in enumerate(stages[s].options):
                need = max(w[s] + w[t + 1] + fpk[s][o], w[s] + w[s + 1] + bpk[s][o] + g_after)
                cost = opt.forward_time + opt.backward_time
                if s == t:
                    cand = np.where(m_axis >= need, cost, np.inf)
                else:
                    cand = cost + _shift(time[(s + 1, t)], w[s] + a[s][o])
                    cand[m_axis < need] = np.inf
                better = cand < best
                best[better], pick[better] = cand[better], o
            nosave = 0.0
            need = 0
            for j in range(s + 1, t + 1):
                k = j - 1
                nosave += stages[k].nosave_time
                need = max(need, w[s] + w[t + 1] + (w[k] if k > s else 0) + npk[k])
                cand = nosave + _shift(time[(j, t)], w[s]) + _shift(time[(s, j - 1)], sum(g[j:t + 1]))
                cand[m_axis < need] = np.inf
                better = cand < best
                best[better], pick[better] = cand[better], _CHECKPOINT + j
            time[(s, t)], choice[(s, t)] = best, pick
    return ChainTable(tuple(stages), unit, slots, time, choice, w, a, g)
