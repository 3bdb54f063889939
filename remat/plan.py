"""``Plan``: what remat decided for one captured graph, in numbers a person can read."""
from __future__ import annotations

from dataclasses import dataclass

from .budget import format_bytes

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """The solved schedule of one captured graph, and its predicted cost.

    All byte counts are *activation* bytes of one training step: everything the step allocates
    (saved activations, temporaries, model outputs, incoming output gradients and the parameter
    gradients it produces), excluding parameters, buffers and inputs that exist before it.

    Attributes:
        baseline_bytes: Predicted peak of the unmodified step (every activation saved).
        budget_bytes: The budget in bytes.
        predicted_peak_bytes: Simulated peak of the chosen schedule.
        predicted_overhead: Extra compute as a fraction of the unmodified step's time
            (``0.12`` = 12% more time): the recomputed ops' profiled times over the captured
            graph's. It prices recomputation only; running a captured graph through
            AOTAutograd (as remat and ``torch.compile`` do) can itself differ from eager: on
            thousands of tiny ops its backward, which calls each op from Python, was 45% slower
            than eager's (a Mamba-style scan), on GPTs from 12% faster to 3% slower
            (``python -m benchmarks.remat_solvers scale``, columns ``runtime``/``recompute``).
        solver: Solver name.
        status: ``"optimal"``, ``"feasible"`` or ``"time_limit"``; ``"eager"`` when the budget
            covers the eager step and nothing was captured; ``"over_budget"`` for a later
            input shape that could not fit (its lowest-peak schedule runs, with a warning).
        solve_time_s: Seconds spent solving.
        lower_bound_bytes: No schedule can have a lower peak than this.
        baseline_time_s: Measured (or modelled) time of the unmodified step.
        saved_bytes: Bytes kept from forward to backward by the schedule.
        num_ops: Ops in the joint graph.
        num_recomputed: Op executions added by recomputation.
        cache_hit: Whether the schedule came from the on-disk plan cache.
        detail: The solver's own notes.
        eager_bytes: Measured peak of the module's eager step (forward + backward; ``0`` when
            not measured), the quantity a percentage budget is of, with ``outside_bytes``
            (NOTE [ A budget is what the user measures ] in :mod:`remat.budget`).
        outside_bytes: Measured memory the rest of the training step (a loss head outside the
            module) adds to it; charged against the budget.
        fingerprint: :meth:`Schedule.fingerprint` of the schedule: equal in two runs exactly
            when they run the same schedule (compare runs, machines, cache hits).
    """

    baseline_bytes: int
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    solver: str
    status: str
    solve_time_s: float
    lower_bound_bytes: int = 0
    baseline_time_s: float = 0.0
    saved_bytes: int = 0
    num_ops: int = 0
    num_recomputed: int = 0
    cache_hit: bool = False
    detail: str = ""
    eager_bytes: int = 0
    outside_bytes: int = 0
    fingerprint: str = ""

    @property
    def predicted_ratio(self) -> float:
        """Predicted peak as a fraction of the baseline peak."""
        return self.predicted_peak_bytes / max(self.baseline_bytes, 1)

    @property
    def predicted_step_ratio(self) -> float:
        """Predicted peak of the whole training step as a fraction of its measured eager peak
        (what a percentage budget promises); of the unmodified step when not measured."""
        if not self.eager_bytes:
            return self.predicted_ratio
        return (self.predicted_peak_bytes + self.outside_bytes) / (self.eager_bytes +
                                                                   self.outside_bytes)

    def _step_rows(self) -> list[tuple[str, str]]:
        """The budget and the predicted peak, as shares of the eager step when it was measured:
        every figure of the whole step (the module's own peak plus what the step adds outside
        it, or less what it drops), so that each percentage is of the number printed above."""
        if not self.eager_bytes:
            return [("budget", format_bytes(self.budget_bytes)),
                    ("predicted peak", f"{format_bytes(self.predicted_peak_bytes)} "
                                       f"({100 * self.predicted_ratio:.1f}% of baseline)")]
        outside, step = self.outside_bytes, self.eager_bytes + self.outside_bytes
        where = ("" if not outside else f": {{}} for the module, "
                 f"{'+' if outside > 0 else ''}{format_bytes(outside)} for the rest of the step")
        return [("budget", f"{format_bytes(self.budget_bytes + outside)} "
                           f"({100 * (self.budget_bytes + outside) / step:.1f}% of the eager step"
                           + where.format(format_bytes(self.budget_bytes)) + ")"),
                ("predicted peak", f"{format_bytes(self.predicted_peak_bytes + outside)} "
                                   f"({100 * self.predicted_step_ratio:.1f}% of the eager step"
                                   + where.format(format_bytes(self.predicted_peak_bytes)) + ")")]

    def summary(self) -> str:
        """A small table for logs."""
        rows = [
            ("solver", f"{self.solver} ({self.status})" + (" [cache hit]" if self.cache_hit else "")),
            *([("schedule", self.fingerprint)] if self.fingerprint else []),
            *([("eager step peak (measured)", format_bytes(self.eager_bytes + self.outside_bytes)
                + (f", {format_bytes(self.outside_bytes)} of it outside the module"
                   if self.outside_bytes > 0 else ""))] if self.eager_bytes else []),
            ("compiled unmodified peak", format_bytes(self.baseline_bytes)),
            *self._step_rows(),
            ("lowest possible peak", format_bytes(self.lower_bound_bytes)),
            ("predicted overhead", f"+{100 * self.predicted_overhead:.1f}% step time "
                                   "(recomputation)"),
            ("saved for backward", format_bytes(self.saved_bytes)),
            ("ops / recomputed", f"{self.num_ops} / {self.num_recomputed}"),
            ("solve time", f"{self.solve_time_s:.2f} s"),
        ]
        if self.status == "eager":  # NOTE [ A budget the eager step fits ]: nothing captured
            rows = [row for row in rows if row[0] in ("solver", "schedule", "budget",
                                                      "eager step peak (measured)")]
            rows.append(("predicted peak", "the eager step's, measured"))
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if self.detail:
            lines.append(f"{'notes':<{width}}  {self.detail}")
        return "\n".join(lines)
