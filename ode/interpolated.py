"""The interpolated reverse dynamic method (Daulbaev, Katrutsa, Markeeva, Gusak, Cichocki and
Oseledets, "Interpolation Technique to Speed Up Gradients Propagation in Neural ODEs",
NeurIPS 2020).

Forward: one torchdiffeq solve from ``t[0]`` to ``t[-1]``, asked for the state at the
Chebyshev–Lobatto nodes of every output interval (a *segment*). Backward: for each segment, from
its end to its start, torchdiffeq integrates only the adjoint ``a`` and the parameter gradient
``g``::

    da/dt = -a^T df/dz (t, z(t)),   dg/dt = -a^T df/dtheta (t, z(t)),
    a(t_N) = dL/dy(t_N),   g(t_N) = 0,   dL/dtheta = g(t_0),   dL/dy0 = a(t_0),

with ``z(t)`` the barycentric interpolant of the stored nodes. At each output time ``t_i`` the
incoming gradient ``dL/dy(t_i)`` is added to ``a``.

NOTE [ Nodes from dense output, no extra evaluations ]
    torchdiffeq's adaptive Runge–Kutta solvers choose their steps independently of the requested
    output times: they step past a requested time and evaluate their dense-output polynomial there
    (``RKAdaptiveStepsizeODESolver._advance``). So asking one solve for the state at all the nodes
    takes exactly the steps (and function evaluations) of a plain solve at ``t`` and returns the
    same outputs; the node values are the solver's 4th-order dense output. This is checked by
    tests/ode/test_interpolated.py::test_forward_matches_plain_solve.

NOTE [ Landing on segment ends ]
    Left alone, torchdiffeq's backward solve would (a) pick its first step by evaluating the
    dynamics at ``t0 + h0``, which may be outside the segment, and (b) step past the segment's
    start and read its dense output there — both evaluating the interpolant outside its segment
    (see NOTE [ Never extrapolate ] in ode.interp). We pass ``step_t=[segment start]``, which
    makes torchdiffeq clip the step that would cross it so that the step ends exactly there (then
    ``_advance`` stops, no stage reaches beyond), and ``first_step`` (the forward solve's accepted
    step at the segment's end, capped at the segment's length), which skips the initial-step
    probe. The interpolant checks every evaluation time; tests/ode/test_interpolated.py has the
    regression test for the overshoot case.

NOTE [ Gradient with respect to the output times ]
    ``y(t_i) = phi(t_i; t_0, y_0)`` so ``dL/dt_i = <dL/dy(t_i), f(t_i, y(t_i))>`` for ``i >= 1``
    and ``dL/dt_0 = -<a(t_0^+), f(t_0, y_0)>``, where ``a(t_0^+)`` is the adjoint arriving at
    ``t_0`` before ``dL/dy(t_0)`` is added (it holds for non-autonomous ``f`` too). This costs
    ``len(t)`` extra evaluations, only when ``t.requires_grad``.
"""
from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from .config import INTERP_ERROR_POLICY_NAMES, SolveConfig, require_torchdiffeq
from .errors import InterpolationError, internal_assert
from .interp import LobattoInterpolant, nested_error
from .nodes import segment_nodes
from .stats import MonitoredFunc, ODEStats, RecordingFunc

__all__ = ["solve_interpolated", "INTERP_ERROR_POLICIES", "InterpolationWarning"]


class InterpolationWarning(UserWarning):
    """The nested-grid error estimate of a stored segment exceeds ``interp_tol``."""


@dataclass
class _Segment:
    """One stored piece of trajectory: nodes in flow order, and where its values live."""

    start: float
    end: float
    interval: int  # output interval [t[interval-1], t[interval]]
    traj: int  # index into _Recording.trajectories
    row: int  # first row of this segment's nodes in that trajectory
    depth: int = 0  # bisections that produced it
    estimate: float = 0.0
    fallback: bool = False
    first_step: float = 0.0

    def nodes(self, n: int) -> torch.Tensor:
        return segment_nodes(self.start, self.end, n)


@dataclass
class _Recording:
    """What the forward pass stores for the backward pass."""

    trajectories: list = field(default_factory=list)  # (rows, *state_shape) tensors
    segments: list = field(default_factory=list)  # _Segment, in flow order

    def values(self, seg: _Segment, n: int) -> torch.Tensor:
        return self.trajectories[seg.traj][seg.row:seg.row + n]


def _solve_nodes(func: RecordingFunc, y_start: torch.Tensor, pieces: list[tuple[float, float]],
                 config: SolveConfig) -> torch.Tensor:
    """One torchdiffeq solve through the Lobatto nodes of consecutive pieces; returns the state at
    every node (shared ends once). See NOTE [ Nodes from dense output, no extra evaluations ]."""
    torchdiffeq = require_torchdiffeq()
    n = config.n_nodes
    grid = [segment_nodes(a, b, n)[:-1] for a, b in pieces] + [
        torch.tensor([pieces[-1][1]], dtype=torch.float64)]
    grid = torch.cat(grid)
    return torchdiffeq.odeint(func, y_start, grid.to(y_start.device), rtol=config.rtol,
                              atol=config.atol, method=config.method,
                              options=dict(config.options))


def _check_resolvable(times: list[float], n: int) -> None:
    for i in range(len(times) - 1):
        nodes = segment_nodes(times[i], times[i + 1], n)
        step = nodes[1:] - nodes[:-1]
        if not (bool((step > 0).all()) or bool((step < 0).all())):
            raise ValueError(
                f"t[{i}]={times[i]!r} and t[{i + 1}]={times[i + 1]!r} are too close for "
                f"n_nodes={n} distinct float64 nodes between them; merge the two output times or "
                "use fewer nodes")


def _record(func: RecordingFunc, y0: torch.Tensor, times: list[float],
            config: SolveConfig) -> _Recording:
    n = config.n_nodes
    pieces = list(zip(times[:-1], times[1:]))
    traj = _solve_nodes(func, y0, pieces, config)
    rec = _Recording(trajectories=[traj])
    for k, (a, b) in enumerate(pieces):
        seg = _Segment(start=a, end=b, interval=k + 1, traj=0, row=k * (n - 1))
        rec.segments.append(seg)
    for seg in rec.segments:
        _estimate(rec, seg, config)
    return rec


def _estimate(rec: _Recording, seg: _Segment, config: SolveConfig) -> None:
    n = config.n_nodes
    seg.estimate = nested_error(seg.nodes(n), rec.values(seg, n), atol=config.atol)


def _failing(rec: _Recording, config: SolveConfig) -> list[_Segment]:
    return [s for s in rec.segments if not s.fallback and s.estimate > config.resolved_interp_tol]


def _worst_error(rec, config, block, detail=""):
    worst = max(_failing(rec, config), key=lambda s: s.estimate)
    return InterpolationError(block=block, interval=(worst.start, worst.end),
                              estimate=worst.estimate, interp_tol=config.resolved_interp_tol,
                              n_nodes=config.n_nodes, detail=detail)


def _policy_warn(rec, func, config, stats, block):
    if _failing(rec, config):
        warnings.warn(str(_worst_error(rec, config, block)), InterpolationWarning,
                      stacklevel=_user_stacklevel())


def _policy_raise(rec, func, config, stats, block):
    if _failing(rec, config):
        raise _worst_error(rec, config, block)


def _policy_fallback(rec, func, config, stats, block):
    for seg in _failing(rec, config):
        seg.fallback = True
        stats.fallback_segments += 1


def _policy_refine(rec, func, config, stats, block):
    n = config.n_nodes
    while True:
        todo = [s for s in _failing(rec, config) if s.depth < config.max_refine]
        if not todo:
            break
        for seg in todo:
            mid = 0.5 * (seg.start + seg.end)
            y_start = rec.values(seg, n)[0]
            traj = _solve_nodes(func, y_start, [(seg.start, mid), (mid, seg.end)], config)
            rec.trajectories.append(traj)
            halves = [
                _Segment(start=seg.start, end=mid, interval=seg.interval,
                         traj=len(rec.trajectories) - 1, row=0, depth=seg.depth + 1),
                _Segment(start=mid, end=seg.end, interval=seg.interval,
                         traj=len(rec.trajectories) - 1, row=n - 1, depth=seg.depth + 1),
            ]
            for half in halves:
                _estimate(rec, half, config)
            i = next(k for k, s in enumerate(rec.segments) if s is seg)
            rec.segments[i:i + 1] = halves
            stats.refined += 1
    if _failing(rec, config):
        warnings.warn(str(_worst_error(
            rec, config, block, detail=f" after {config.max_refine} bisections (max_refine)")),
            InterpolationWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """stacklevel pointing at the first frame outside this package and torch.nn (the user's
    call of odeint or of the block)."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    skip = (here, os.path.dirname(os.path.abspath(torch.nn.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


# on_interp_error value -> policy(recording, func, config, stats, block_name)
INTERP_ERROR_POLICIES = {
    "warn": _policy_warn,
    "raise": _policy_raise,
    "refine": _policy_refine,
    "fallback": _policy_fallback,
}
if tuple(INTERP_ERROR_POLICIES) != INTERP_ERROR_POLICY_NAMES:  # the names SolveConfig accepts
    raise ImportError(f"ode.interpolated.INTERP_ERROR_POLICIES {tuple(INTERP_ERROR_POLICIES)} "
                      f"differs from ode.config.INTERP_ERROR_POLICY_NAMES "
                      f"{INTERP_ERROR_POLICY_NAMES}")


def _assign_first_steps(rec: _Recording, steps: list[tuple[float, float]], direction: float):
    """First step of each backward solve: the forward step that crossed the segment's end.
    See NOTE [ Landing on segment ends ]."""
    steps = sorted(steps, key=lambda step: direction * step[0])  # refine re-solves come last
    starts = [direction * t0 for t0, _ in steps]
    for seg in rec.segments:
        length = abs(seg.end - seg.start)
        k = bisect.bisect_left(starts, direction * seg.end) - 1
        dt = steps[k][1] if 0 <= k < len(steps) else length
        seg.first_step = min(dt, length)


class _AdjointDynamics:
    """Right-hand side of the backward solve on one segment: the adjoint and the parameter
    gradient (and the state itself on a fallback segment), flattened into one vector."""

    def __init__(self, func: MonitoredFunc, params: tuple[torch.Tensor, ...],
                 interpolant: LobattoInterpolant | None, shape: torch.Size):
        self.func = func
        self.params = params
        self.interpolant = interpolant
        self.shape = shape
        self.numel = shape.numel()
        self.offset = 0 if interpolant is not None else self.numel  # state first when fallback
        sizes = ([] if interpolant is not None else [self.numel]) + [self.numel] + [
            p.numel() for p in params]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        self.slices = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]

    def __call__(self, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if self.interpolant is not None:
            z = self.interpolant(t)
        else:
            z = s[:self.numel].view(self.shape)
        a = s[self.offset:self.offset + self.numel].view(self.shape)
        with torch.enable_grad():
            z = z.detach().requires_grad_(True)
            f = self.func(t, z)
            inputs = (z, *self.params)
            if f.requires_grad:
                vjps = torch.autograd.grad(f, inputs, -a, allow_unused=True)
            else:  # dynamics that ignore the state and the parameters
                vjps = (None,) * len(inputs)
        parts = [] if self.interpolant is not None else [f.detach().reshape(-1)]
        for x, v in zip(inputs, vjps):
            parts.append(torch.zeros(x.numel(), dtype=s.dtype, device=s.device) if v is None
                         else v.reshape(-1).to(s.dtype))
        return torch.cat(parts)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Error norm of the step controller: the largest RMS over the parts, as torchdiffeq's
        adjoint does, so that step counts are comparable."""
        return torch.stack([x[sl].square().mean().sqrt() for sl in self.slices]).max()

    def callback_step(self, t0, y0, dt) -> None:
        self.func.callback_step(t0, y0, dt)


@dataclass
class _Plan:
    """Everything the backward pass needs besides the saved tensors."""

    func: RecordingFunc
    params: tuple
    versions: tuple
    config: SolveConfig
    segments: list
    n_traj: int
    shape: torch.Size
    block: str


def _integrate_segment(plan: _Plan, seg: _Segment, values: torch.Tensor, a: torch.Tensor,
                       g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torchdiffeq = require_torchdiffeq()
    config = plan.config
    n = config.n_nodes
    interp = None if seg.fallback else LobattoInterpolant(seg.nodes(n), values)
    dyn = _AdjointDynamics(plan.func, plan.params, interp, plan.shape)
    parts = ([values[-1].reshape(-1)] if seg.fallback else []) + [a.reshape(-1), g]
    s_end = torch.cat(parts)
    device = a.device
    options = dict(config.options)
    options.update(step_t=torch.tensor([seg.start], dtype=torch.float64, device=device),
                   first_step=seg.first_step, norm=dyn.norm)
    out = torchdiffeq.odeint(
        dyn, s_end, torch.tensor([seg.end, seg.start], dtype=torch.float64, device=device),
        rtol=config.backward_rtol, atol=config.backward_atol, method=config.method,
        options=options)[1]
    numel = plan.shape.numel()
    off = numel if seg.fallback else 0
    return out[off:off + numel].view(plan.shape), out[off + numel:]


class _InterpolatedAdjoint(torch.autograd.Function):
    """Attaches the interpolated adjoint to a trajectory solved (without autograd) outside.

    Inputs: ``plan`` (non-tensor), ``y0``, ``t``, ``ys`` (the solved outputs, detached), the
    stored trajectories, then the parameters. Output: a copy of ``ys``.
    """

    @staticmethod
    def forward(ctx, plan: _Plan, y0, t, ys, *tensors):
        ctx.plan = plan
        ctx.save_for_backward(t, *tensors[:plan.n_traj])
        return ys.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ys):
        plan: _Plan = ctx.plan
        t, *trajectories = ctx.saved_tensors
        for i, (p, v) in enumerate(zip(plan.params, plan.versions)):
            if p._version != v:
                raise RuntimeError(
                    f"{plan.block}: adjoint_params[{i}] (shape {tuple(p.shape)}) was modified in "
                    "place between the forward and the backward pass (e.g. an optimizer step "
                    "before backward); call backward before changing the parameters")
        need_y0, need_t = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_y0, grad_t, grad_params = _adjoint_backward(plan, trajectories, grad_ys, t, need_t)
        # plan, ys and the trajectories are data, not differentiable inputs
        return (None, grad_y0 if need_y0 else None, grad_t, None,
                *([None] * plan.n_traj), *grad_params)


def _adjoint_backward(plan: _Plan, trajectories, grad_ys: torch.Tensor, t: torch.Tensor,
                      need_t: bool):
    n = plan.config.n_nodes
    rec = _Recording(trajectories=list(trajectories))
    by_interval: dict[int, list[_Segment]] = {}
    for seg in plan.segments:
        by_interval.setdefault(seg.interval, []).append(seg)
    n_out = grad_ys.shape[0]
    dtype = grad_ys.dtype
    a = grad_ys[-1].clone()
    g = torch.zeros(sum(p.numel() for p in plan.params), dtype=dtype, device=a.device)
    grad_t = None
    outputs = rec.trajectories[0][::n - 1]  # the forward outputs (refinement never moves them)
    if need_t:  # NOTE [ Gradient with respect to the output times ]
        grad_t = torch.zeros(n_out, dtype=t.dtype, device=t.device)
        for i in range(1, n_out):
            f_i = plan.func(t[i].to(dtype), outputs[i])
            grad_t[i] = (grad_ys[i] * f_i).sum().to(t.dtype)
    for i in range(n_out - 1, 0, -1):
        for seg in reversed(by_interval[i]):
            a, g = _integrate_segment(plan, seg, rec.values(seg, n), a, g)
        if i > 1:
            a = a + grad_ys[i - 1]
    if need_t:
        grad_t[0] = -(a * plan.func(t[0].to(dtype), outputs[0])).sum().to(t.dtype)
    grad_y0 = a + grad_ys[0]
    grad_params, offset = [], 0
    for p in plan.params:
        grad_params.append(g[offset:offset + p.numel()].view(p.shape).to(p.dtype))
        offset += p.numel()
    return grad_y0, grad_t, grad_params


def solve_interpolated(func: RecordingFunc, y0: torch.Tensor, t: torch.Tensor,
                       params: tuple[torch.Tensor, ...], config: SolveConfig,
                       stats: ODEStats) -> torch.Tensor:
    """``grad="interpolated"`` of :func:`ode.odeint` (inputs already checked)."""
    torchdiffeq = require_torchdiffeq()
    times = [float(x) for x in t.detach().to(torch.float64).cpu()]
    _check_resolvable(times, config.n_nodes)
    needs_grad = torch.is_grad_enabled() and (
        y0.requires_grad or t.requires_grad or any(p.requires_grad for p in params))
    if not needs_grad:  # inference: a plain solve, same steps and outputs, nothing stored
        with torch.no_grad():
            ys = torchdiffeq.odeint(func, y0, t.detach().to(torch.float64), rtol=config.rtol,
                                    atol=config.atol, method=config.method,
                                    options=dict(config.options))
        func.start_backward()
        stats.segments, stats.stored_bytes = 0, 0
        return ys
    with torch.no_grad():
        rec = _record(func, y0.detach(), times, config)
        INTERP_ERROR_POLICIES[config.on_interp_error](rec, func, config, stats, func.block)
    func.start_backward()
    direction = 1.0 if times[-1] > times[0] else -1.0
    _assign_first_steps(rec, func.accepted, direction)
    internal_assert(len(rec.segments) >= len(times) - 1, "lost a segment")
    ys = rec.trajectories[0][::config.n_nodes - 1]
    internal_assert(ys.shape[0] == len(times), f"{ys.shape[0]} outputs for {len(times)} times")
    interpolated = [s.estimate for s in rec.segments if not s.fallback]
    stats.interp_error = max(interpolated) if interpolated else None
    stats.segments = len(rec.segments)
    stats.stored_bytes = sum(x.numel() * x.element_size() for x in rec.trajectories)
    plan = _Plan(func=func, params=params, versions=tuple(p._version for p in params),
                 config=config, segments=rec.segments, n_traj=len(rec.trajectories),
                 shape=y0.shape, block=func.block)
    return _InterpolatedAdjoint.apply(plan, y0, t, ys, *rec.trajectories, *params)
