"""Solver scale and quality: solve times and overheads on many models, the gap to the exact ILP.

    python -m benchmarks.remat_solvers scale                          # every model, 50% budget
    python -m benchmarks.remat_solvers scale --models mlp unet gpt6 --budget 0.3 --threads 1
    python -m benchmarks.remat_solvers scale --quick --models mlp gpt6 mamba   # shrunk, ~30 s
    python -m benchmarks.remat_solvers quality                        # vs the ILP at 70/50/30%
    python -m benchmarks.remat_solvers quality --quick --models mlp gpt2

``scale`` rematerializes each model of :data:`MODELS` (an MLP, a 4-block ViT, a U-Net, a
T5-small-config encoder-decoder, GPTs of 6 to 96 layers, a 24-layer GPT whose layers all differ,
a Mamba-style model whose scan is a Python loop; by name also LSTM and GRU language models and an
``nn.LSTMCell`` loop) with each solver at one budget, and prints per
row: the joint graph's op count, the seconds spent capturing (and profiling) apart from the
seconds spent solving, the predicted peak and step-time overhead, and the peak and overhead
measured by running the rematerialized module and the eager model side by side for a few
training steps. ``quality`` compares the predicted overhead of every solver with the exact ILP's
on the graphs small enough for it. A model that cannot be captured or solved prints its row with
the reason. Not a test: prints tables for the issue notes; a legend under each defines its columns.

Models: ``--models`` picks from :data:`MODELS`; ``--quick`` shrinks each (small widths and
batches, a sixth of a GPT's layers plus one, a 4-step scan), for a test. Capturing dominates the
run time (dynamo and AOTAutograd take 20-70 ops a second on 2 CPU cores), so the full ``scale``
takes many minutes there, most of it in the 48- and 96-layer GPTs and the 6,477-op Mamba.
On a machine shared with other jobs pass ``--threads 1``: OpenMP threads spinning against them
make step times erratic (a 7 ms step measured anywhere from 20 ms to 1 s on 2 busy cores).
``scale`` first tells glibc to keep the memory a step frees (``keep_freed_memory``), as CUDA's
caching allocator does: otherwise whether a step faults its pages in again depends on the
allocator's state, and one run measured a 6-layer GPT's unmodified step 7,521 page faults (and
7 points of 'recompute') slower than its rematerialized one. ``--system-malloc`` measures with
the allocator as configured.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

import remat
from remat.schedule import save_all_schedule, simulate
from remat.solvers import Problem, get_solver
from benchmarks.models import (GPT, MLP, CellLoopLM, GPTConfig, Mamba, RecurrentLM, UNet, ViT,
                               gpt_batch, image_batch)
from benchmarks.remat_compare import LabelledLM, alternate_steps, keep_freed_memory, measure


class Supervised(nn.Module):
    """``model(x)`` scored against ``target`` by ``loss``: a training step that returns its loss."""

    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x), target)


def _mlp(quick: bool):
    depth, width, n = (4, 64, 512) if quick else (12, 256, 2048)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 64, generator=g), torch.randint(10, (n,), generator=g)
    return Supervised(MLP(d_in=64, width=width, depth=depth), nn.CrossEntropyLoss()), (x, y)


def _vit(quick: bool):
    image, d_model, n = (16, 64, 64) if quick else (32, 192, 16)
    x, y = image_batch(n, size=image)
    return ViT(image=image, patch=4, d_model=d_model, depth=4, n_head=4, dropout=0.1), (x, y)


def _unet(quick: bool):
    width, image, n = (4, 32, 16) if quick else (16, 64, 8)
    x = image_batch(n, size=image)[0]  # reconstruct the input: a dense loss over the output map
    return Supervised(UNet(width=width, depth=4), nn.MSELoss()), (x, x)


def _t5(quick: bool):
    """T5-small's architecture (relative attention, ReLU FFN, RMS norms) scaled down; no weights."""
    import transformers

    d_model, d_ff, heads, layers, seq, vocab = ((64, 128, 2, 1, 16, 256) if quick
                                                else (256, 1024, 8, 2, 64, 1024))
    cfg = transformers.T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // heads,
                                d_ff=d_ff, num_layers=layers, num_decoder_layers=layers,
                                num_heads=heads, dropout_rate=0.1, pad_token_id=0,
                                decoder_start_token_id=0, eos_token_id=1)
    ids = torch.randint(2, vocab, (4, seq), generator=torch.Generator().manual_seed(0))
    return LabelledLM(transformers.T5ForConditionalGeneration(cfg)), (ids,)


def _gpt_config(layers: int, quick: bool, varied: bool = False) -> GPTConfig:
    d_model, seq, vocab = (64, 64, 128) if quick else (256, 128, 512)
    # Every layer's MLP a different width (symmetric around 4 * d_model, 16 apart), so no two
    # layers are identical and the hierarchical solver cannot solve one for all.
    widths = (tuple(4 * d_model + 8 * (2 * i - layers + 1) for i in range(layers)) if varied
              else None)
    return GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d_model, n_layer=layers, n_head=4,
                     dropout=0.1, mlp_widths=widths)


def _gpt(layers: int, *, varied: bool = False) -> Callable[[bool], tuple]:
    def make(quick: bool):
        # --quick: a sixth of the layers plus one (gpt6: 2 layers, gpt96: 17); gpt1 and gpt2 as is.
        cfg = _gpt_config(layers // 6 + 1 if quick and layers > 2 else layers, quick, varied)
        return GPT(cfg), gpt_batch(cfg, 8 if quick else 4)
    return make


def _mamba(quick: bool):
    d_model, seq = (32, 4) if quick else (64, 64)
    model = Mamba(vocab_size=256, d_model=d_model, n_layer=2, d_state=16)
    idx = torch.randint(256, (4, seq), generator=torch.Generator().manual_seed(0))
    return model, (idx, torch.roll(idx, -1, dims=1))


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return idx, torch.roll(idx, -1, dims=1)


def _recurrent(cell: type, bidirectional: bool = False) -> Callable[[bool], tuple]:
    def make(quick: bool):
        batch, seq = (4, 8) if quick else (16, 48)
        return (RecurrentLM(cell, bidirectional=bidirectional), _tokens(1000, batch, seq))
    return make


def _lstm_cell_loop(quick: bool):
    seq = 4 if quick else 64
    return CellLoopLM(), _tokens(256, 8, seq)


# name -> factory(quick) returning (model, batch); model(*batch) returns the step's scalar loss.
MODELS: dict[str, Callable[[bool], tuple[nn.Module, tuple]]] = {
    "mlp": _mlp,
    "vit4": _vit,
    "unet": _unet,
    "t5-small": _t5,
    **{f"gpt{n}": _gpt(n) for n in (1, 2, 6, 12, 24, 48, 96)},
    "gpt24-var": _gpt(24, varied=True),
    "mamba": _mamba,
    "lstm-lm": _recurrent(nn.LSTM),
    "lstm-bi": _recurrent(nn.LSTM, bidirectional=True),
    "gru-lm": _recurrent(nn.GRU),
    "lstm-cell": _lstm_cell_loop,
}
SCALE_MODELS = ["mlp", "vit4", "unet", "t5-small", "gpt6", "gpt12", "gpt24", "gpt48", "gpt96",
                "gpt24-var", "mamba"]
# Whole-graph ILPs these solve within their time limit (graphs up to ~1000 ops).
QUALITY_MODELS = ["mlp", "unet", "gpt1", "gpt2", "vit4"]

# Variants of a solver with options, by the name the tables print.
VARIANTS = {"hier-only": ("hierarchical", {"exact_top": False}),
            "hier+ilp": ("hierarchical", {"exact_top": True})}

# A budget in bytes that every schedule meets: the unmodified step's reference run.
_ANYTHING_FITS = f"{1 << 62}B"  # bytes carry their unit (remat.parse_budget)

# Steps whose page faults differ by this many pages (1 MiB) differ in time by ~1 ms on CPU for a
# reason the cost model leaves out (NOTE [ Page faults are not an op's cost ]): said in notes.
_FAULTS_WORTH_A_NOTE = 256

# How a failed rematerialize shows in the status column.
_ERROR_STATUS = {remat.CaptureError: "no-capture", remat.InfeasibleBudgetError: "infeasible",
                 remat.SolverError: "solver-error"}


def _build(name: str, quick: bool) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model, batch = MODELS[name](quick)
    return model.train(), batch


def _error_status(exc: remat.RematError) -> str:
    return next((s for cls, s in _ERROR_STATUS.items() if isinstance(exc, cls)), "error")


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:240]


def _legend(intro: str, terms: list[tuple[str, str]], width: int = 100) -> list[str]:
    """An introductory sentence, then one wrapped definition per column."""
    lines = textwrap.wrap(intro, width)
    for term, text in terms:
        lines += textwrap.wrap(text, width, initial_indent=f"{term + ':':<11}",
                               subsequent_indent=" " * 11)
    return lines


# ---------------------------------------------------------------------------------------- scale


@dataclass
class ScaleRow:
    model: str
    solver: str
    status: str
    ops: int = 0
    capture_s: float = math.nan
    solve_s: float = math.nan
    peak: float = math.nan  # predicted, of the measured eager step
    overhead: float = math.nan  # predicted
    measured_peak: float = math.nan  # of eager's, measured in this run
    measured_overhead: float = math.nan  # median step time over eager's, minus 1
    runtime: float = math.nan  # the unmodified captured step's over eager's, minus 1
    recompute: float = math.nan  # the rematerialized step's over the unmodified captured one's
    note: str = ""


def scale_model(name: str, args: argparse.Namespace) -> list[ScaleRow]:
    """Rematerialize model ``name`` with every solver at ``args.budget``; measure each."""
    model, batch = _build(name, args.quick)
    eager = ref = unmodified = None
    rows = []
    for solver in args.solvers:
        solver_name, options = VARIANTS.get(solver, (solver, {}))
        start = time.perf_counter()
        try:
            # No plan cache: this measures the solve (and the op timing a cache would also keep),
            # which a second run would otherwise read back in 0.00 s.
            rm = remat.rematerialize(model, *batch, budget=args.budget, solver=solver_name,
                                     options=options, time_limit=args.time_limit, cache=False)
        except remat.RematError as exc:
            rows.append(ScaleRow(name, solver, _error_status(exc), note=_reason(exc)))
            if isinstance(exc, remat.CaptureError):
                break  # every solver would fail the same way
            continue
        total = time.perf_counter() - start
        plan = rm.plan
        row = ScaleRow(name, solver, plan.status, plan.num_ops, total - plan.solve_time_s,
                       plan.solve_time_s, plan.predicted_step_ratio, plan.predicted_overhead,
                       note=_fallback(plan.detail))
        if args.measure_steps > 0:
            if eager is None:
                eager, ref = measure("eager", model, lambda: model(*batch), None, 0)
                # The step 'pred ovh' is relative to: the same captured graph, run by the same
                # generated code, saving every value backward reads (solver "none", under a
                # budget anything fits). Not torch.compile(backend="aot_eager..."): its graphs
                # call each op through a Python frame, ours do not (NOTE [ Ops called without
                # a Python frame ]), which made 'recompute' read up to 10 points low (the
                # Mamba-style scan's 6,477 ops: -3.9% against it, +7.4% against this); and the
                # min-cut partitioner recomputes cheap ops itself.
                unmodified = remat.rematerialize(model, *batch, budget=_ANYTHING_FITS,
                                                 solver="none", options={"progress": False})
                measure("unmodified", unmodified, lambda: unmodified(*batch), ref, 0)
            remat_row, _ = measure(solver, rm, lambda: rm(*batch), ref, 0)
            faults: list[float] = []
            eager_s, unmodified_s, remat_s = alternate_steps(
                [(model, lambda: model(*batch)), (unmodified, lambda: unmodified(*batch)),
                 (rm, lambda: rm(*batch))], args.measure_steps, faults=faults)
            row.measured_peak = remat_row.peak / max(eager.peak, 1)
            row.measured_overhead = remat_s / eager_s - 1
            row.runtime = unmodified_s / eager_s - 1
            row.recompute = remat_s / unmodified_s - 1
            notes = [row.note]
            if abs(faults[1] - faults[2]) >= _FAULTS_WORTH_A_NOTE:
                notes.append(f"page faults a step: unmodified {faults[1]:,.0f}, remat "
                             f"{faults[2]:,.0f}")
            if remat_row.grad_diff > 0:
                notes.append(f"gradients differ from eager's by up to {remat_row.grad_diff:.1e}")
            row.note = "; ".join(filter(None, notes))
        rows.append(row)
        rm = None  # freed before the next solver's module is built
        gc.collect()
    return rows


def _fallback(detail: str) -> str:
    """The schedule rematerialize ran instead of the solver's, if any (:mod:`remat.planner`
    offers block checkpointing, the least-memory schedule and the model's own checkpointing)."""
    why = ("the solver found none", "faster than the solver's schedule")
    return "; ".join(part for part in detail.split("; ") if part.endswith(why))


def _num(value: float, spec: str, width: int, unit: str = "") -> str:
    """``value`` right-aligned in ``width`` characters (``unit`` included), ``-`` for NaN."""
    if math.isnan(value):
        return f"{'-':>{width}}"
    return f"{format(value, spec) + unit:>{width}}"


def scale_report(rows: list[ScaleRow], *, budget: float, steps: int) -> str:
    """The ``scale`` table, then a legend that defines each column."""
    lines = [f"{'model':<11}{'ops':>7}{'capture s':>11}{'solver':>14}{'solve s':>9}"
             f"{'status':>13}{'pred peak':>11}{'pred ovh':>10}{'meas peak':>11}{'meas ovh':>10}"
             f"{'runtime':>9}{'recompute':>11}  notes"]
    for r in rows:
        lines.append(f"{r.model:<11}{r.ops or '-':>7}{_num(r.capture_s, '.1f', 11)}"
                     f"{r.solver:>14}{_num(r.solve_s, '.2f', 9)}{r.status:>13}"
                     f"{_num(r.peak, '.3f', 11)}{_num(100 * r.overhead, '+.1f', 10, '%')}"
                     f"{_num(r.measured_peak, '.3f', 11)}"
                     f"{_num(100 * r.measured_overhead, '+.1f', 10, '%')}"
                     f"{_num(100 * r.runtime, '+.1f', 9, '%')}"
                     f"{_num(100 * r.recompute, '+.1f', 11, '%')}"
                     f"  {r.note}")
    lines += ["", *_legend(
        f"Each row: remat.rematerialize(model, *batch, budget={budget:g}, solver=...) on one "
        "training step (forward, loss, backward) of the model.", [
            ("ops", "ops in the captured joint forward+backward graph"),
            ("solver", "the solver= of rematerialize (hierarchical: the default; a name of "
                       "VARIANTS: that solver with options)"),
            ("capture s", "rematerialize's wall time except the solve: eager-step measurement, "
                          "dynamo + AOTAutograd capture, timing every op on the batch, checking "
                          "the schedule, code generation"),
            ("solve s", "the solver's own time (plan.solve_time_s)"),
            ("status", "the solver's (optimal: proven; feasible: fits, not proven optimal; "
                       "time_limit: fits, the time limit ended the search), or why there is no "
                       "schedule (no-capture, infeasible, solver-error; the reason in notes)"),
            ("pred peak", "simulated peak of the schedule over the eager step's measured peak "
                          "(at most the budget)"),
            ("pred ovh", "simulated extra step time over the captured, unmodified step's (the "
                         "sum of its ops' profiled times; a recomputed op at its time run again: "
                         "NOTE [ What a recomputation costs ]): what 'recompute' measures"),
            ("meas peak", "the rematerialized step's measured peak over eager PyTorch's "
                          "(remat.track_memory: the CPU allocator's events, or the CUDA "
                          "allocator)"),
            ("meas ovh", f"its median step time over eager's, minus one: eager, the captured "
                         f"unmodified step and remat take turns for {steps} steps in this run, "
                         "the garbage collector off ('-': not measured, --measure-steps 0); "
                         "it is (1 + runtime) x (1 + recompute) - 1"),
            ("runtime", "the unmodified step as remat runs it (rematerialize(solver='none'): "
                        "the captured graph, every storage backward reads saved, views remade) "
                        "over eager's, minus one: what running a captured graph costs before "
                        "any recomputation (its backward calls the ops from one Python function "
                        "where eager's autograd runs in C++, and each tensor handed to backward "
                        "costs AOTAutograd a few microseconds: a few percent on a model of "
                        "thousands of tiny ops, about nothing on large ones)"),
            ("recompute", "the rematerialized step over that unmodified one, minus one: the "
                          "measured cost of recomputation, which 'pred ovh' predicts"),
            ("notes", "why a row has no schedule; the schedule rematerialize ran instead of "
                      "the solver's, and why; the page faults a step of the unmodified and "
                      "the rematerialized step where they differ (glibc handing memory back "
                      "between steps: each 4 KiB page faulted in again costs ~1 us, which "
                      "'pred ovh' leaves out); how far the gradients are from eager's, if they "
                      "differ"),
        ])]
    return "\n".join(lines)


def scale(args: argparse.Namespace) -> list[ScaleRow]:
    # Before any capture: ops are profiled, and steps measured, without page faults, as on
    # CUDA (NOTE [ Page faults are not an op's cost ]); --system-malloc measures them as is.
    kept = not args.system_malloc and keep_freed_memory()
    rows = []
    for name in args.models:
        rows += scale_model(name, args)
    print(f"remat_solvers scale: budget {args.budget:g}, solvers {' '.join(args.solvers)}, "
          f"{'--quick sizes, ' if args.quick else ''}torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, "
          f"{'glibc keeps freed memory' if kept else 'the system allocator as configured'}")
    print(scale_report(rows, budget=args.budget, steps=args.measure_steps))
    return rows


# -------------------------------------------------------------------------------------- quality


def capture(model: torch.nn.Module, *args) -> tuple[remat.RematGraph, float]:
    torch._dynamo.reset()
    start = time.perf_counter()
    # No limit: the graph as captured (a percentage is of the eager step, maybe below it).
    rm = remat.rematerialize(model, *args, budget="1TiB", solver="none")
    return rm.graphs[0], time.perf_counter() - start


def solve(graph, solver: str, fraction: float, time_limit: float):
    base = simulate(graph, save_all_schedule(graph)).peak_bytes
    name, options = VARIANTS.get(solver, (solver, {}))
    start = time.perf_counter()
    result = get_solver(name).solve(
        Problem(graph, int(fraction * base), time_limit=time_limit,
                options={"progress": False, **options}))
    elapsed = time.perf_counter() - start
    sim = result.simulation
    overhead = (sim.time - graph.baseline_time) / graph.baseline_time if sim else float("nan")
    peak = sim.peak_bytes / base if sim else float("nan")
    return result.status, elapsed, overhead, peak, result.detail


def quality(args: argparse.Namespace) -> None:
    lines = [f"{'graph':<11}{'ops':>6}{'budget':>8}{'solver':>14}{'status':>13}{'solve s':>9}"
             f"{'peak':>7}{'overhead':>10}{'vs ilp':>9}"]
    for name in args.models:
        model, batch = _build(name, args.quick)
        try:
            graph, _ = capture(model, *batch)
        except remat.RematError as exc:
            lines.append(f"{name:<11}{'-':>6}{'-':>8}{'-':>14}{_error_status(exc):>13}  "
                         f"{_reason(exc)}")
            continue
        for fraction in args.budgets:
            ilp = solve(graph, "ilp", fraction, args.time_limit)
            exact = ilp[0] in ("optimal", "feasible", "time_limit")
            for solver in ["ilp", *[s for s in args.solvers if s != "ilp"]]:
                status, elapsed, overhead, peak, _ = ilp if solver == "ilp" else \
                    solve(graph, solver, fraction, args.time_limit)
                gap = (1 + overhead) / (1 + ilp[2]) - 1 if exact else float("nan")
                if status == "infeasible":  # its schedule (if any) is over the budget
                    peak = overhead = gap = float("nan")
                lines.append(f"{name:<11}{len(graph.ops):>6}{fraction:>8.0%}{solver:>14}"
                             f"{status:>13}{elapsed:>9.2f}{_num(peak, '.3f', 7)}"
                             f"{_num(100 * overhead, '+.1f', 10, '%')}"
                             f"{_num(100 * gap, '+.1f', 9, '%')}")
    lines += ["", *_legend(
        "Each model's joint forward+backward graph is captured once; each solver then solves it "
        "alone (plain data, no code generation).", [
            ("ops", "ops in the graph"),
            ("budget", "share of the captured, unmodified step's simulated peak the schedule "
                       "may use"),
            ("status", "the solver's (optimal: proven; feasible: fits, not proven; time_limit: "
                       f"its time limit, {args.time_limit:g} s, ended the search; infeasible: "
                       "no schedule within the budget, and the next three columns are '-')"),
            ("solve s", "the solver's wall time"),
            ("peak", "the schedule's simulated peak over the unmodified step's"),
            ("overhead", "its simulated extra step time over the unmodified step's"),
            ("vs ilp", "its step time over the ILP schedule's at the same budget, minus one "
                       "('-': the ILP found none)"),
            ("solver", "ilp: the whole-graph ILP (Checkmate's; PuLP + HiGHS or CBC), exact "
                       "within its model, which recomputes only right before each backward op "
                       "and counts what it recomputes as live for the whole stage: a schedule "
                       "outside that model can beat it (a negative gap) or fit where it finds "
                       "none; stopped by its time limit, it is compared by its best schedule. "
                       "hierarchical: the default (the whole-graph ILP is solved only where no "
                       "hierarchy fits); hier-only: without that ILP; hier+ilp: with it always, "
                       "keeping the faster; dp: the chain DP with keep-all/keep-nothing blocks; "
                       "checkpoint: recompute each block, like torch.utils.checkpoint"),
        ])]
    print(f"remat_solvers quality: {'--quick sizes, ' if args.quick else ''}"
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    solvers = [*remat.SOLVERS, *VARIANTS]
    p = sub.add_parser("scale")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=SCALE_MODELS,
                   metavar="NAME", help=f"of {', '.join(MODELS)} (default: all but gpt1, gpt2)")
    p.add_argument("--budget", type=float, default=0.5, help="fraction of eager's step peak")
    p.add_argument("--solvers", nargs="+", choices=solvers, default=["hierarchical"])
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--measure-steps", type=int, default=5,
                   help="training steps of eager and remat, taking turns (0: do not measure)")
    p.add_argument("--system-malloc", action="store_true",
                   help="leave glibc handing freed memory back between steps (default: keep "
                        "it, as CUDA's caching allocator does, so no step pays page faults)")
    q = sub.add_parser("quality")
    q.add_argument("--models", nargs="+", choices=list(MODELS), default=QUALITY_MODELS,
                   metavar="NAME", help=f"as for scale (default: {' '.join(QUALITY_MODELS)})")
    q.add_argument("--budgets", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    q.add_argument("--solvers", nargs="+", choices=solvers,
                   default=["hierarchical", "hier-only", "dp", "checkpoint"])
    q.add_argument("--time-limit", type=float, default=None,
                   help="seconds per solve (default 120, 20 with --quick)")
    for s in (p, q):
        s.add_argument("--quick", action="store_true",
                       help="every model shrunk (a sixth of a GPT's layers plus one, small "
                            "widths and batches): a fast run, for a test")
        s.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "quality" and args.time_limit is None:
        args.time_limit = 20.0 if args.quick else 120.0
    scale(args) if args.what == "scale" else quality(args)


if __name__ == "__main__":
    main(sys.argv[1:])
