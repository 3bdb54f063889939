"""Solver scale and quality: solve times on large graphs, overhead vs the exact ILP on small ones.

    python -m benchmarks.remat_solvers scale --layers 12 24          # solve time, 50% budget
    python -m benchmarks.remat_solvers quality                        # vs ILP at 70/50/30%

``scale`` captures a GPT-style model (d_model 256) once, then times each solver on its joint
graph (plain data; capture and profiling are reported separately). ``quality`` compares the
predicted step-time overhead of every solver with the exact ILP's on graphs small enough for it
(an MLP and 1-2 layer transformers). Not a test: prints a table for the issue notes.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import remat
from remat.schedule import save_all_schedule, simulate
from remat.solvers import Problem, get_solver
from benchmarks.models import GPT, MLP, GPTConfig, gpt_batch


def capture(model: torch.nn.Module, *args) -> tuple[remat.RematGraph, float]:
    torch._dynamo.reset()
    start = time.perf_counter()
    # No limit: the graph as captured (a percentage is of the eager step, maybe below it).
    rm = remat.rematerialize(model, *args, budget="1TiB", solver="none")
    return rm.graphs[0], time.perf_counter() - start


# Variants of a solver with options, by the name the tables print.
VARIANTS = {"hier-only": ("hierarchical", {"exact_top": False})}


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


def scale(args: argparse.Namespace) -> None:
    print(f"{'layers':>6}{'ops':>7}{'capture s':>11}{'solver':>14}{'solve s':>9}{'status':>12}"
          f"{'peak':>7}{'overhead':>10}")
    for layers in args.layers:
        cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=256, n_layer=layers, n_head=4,
                        dropout=0.1)
        torch.manual_seed(0)
        graph, captured = capture(GPT(cfg), *gpt_batch(cfg, args.batch))
        for solver in args.solvers:
            status, elapsed, overhead, peak, _ = solve(graph, solver, args.budget, args.time_limit)
            print(f"{layers:>6}{len(graph.ops):>7}{captured:>11.1f}{solver:>14}{elapsed:>9.2f}"
                  f"{status:>12}{peak:>7.3f}{100 * overhead:>9.1f}%")


def quality(args: argparse.Namespace) -> None:
    cases = {
        "mlp": lambda: (MLP(d_in=64, width=256, depth=6), (torch.randn(512, 64),)),
        "gpt-1layer": lambda: _gpt(1),
        "gpt-2layer": lambda: _gpt(2),
    }
    print(f"{'graph':<12}{'ops':>5}{'budget':>8}{'solver':>14}{'status':>12}{'solve s':>9}"
          f"{'peak':>7}{'overhead':>10}{'vs ilp':>9}")
    for name, make in cases.items():
        torch.manual_seed(0)
        graph, _ = capture(*_unpack(make()))
        for fraction in args.budgets:
            ilp = solve(graph, "ilp", fraction, args.time_limit)
            for solver in ["ilp", *[s for s in args.solvers if s != "ilp"]]:
                status, elapsed, overhead, peak, _ = ilp if solver == "ilp" else \
                    solve(graph, solver, fraction, args.time_limit)
                gap = (1 + overhead) / (1 + ilp[2]) - 1 if ilp[0] != "infeasible" else float("nan")
                print(f"{name:<12}{len(graph.ops):>5}{fraction:>8.0%}{solver:>14}{status:>12}"
                      f"{elapsed:>9.2f}{peak:>7.3f}{100 * overhead:>9.1f}%{100 * gap:>8.1f}%")


def _gpt(layers: int):
    cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layer=layers, n_head=4, dropout=0.1)
    return GPT(cfg), gpt_batch(cfg, 8)


def _unpack(pair):
    model, batch = pair
    return (model, *batch)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("scale")
    p.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--solvers", nargs="+", default=["hierarchical", "dp"])
    p.add_argument("--time-limit", type=float, default=60.0)
    q = sub.add_parser("quality")
    q.add_argument("--budgets", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    q.add_argument("--solvers", nargs="+", default=["hierarchical", "hier-only", "dp", "checkpoint"])
    q.add_argument("--time-limit", type=float, default=120.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    scale(args) if args.what == "scale" else quality(args)


if __name__ == "__main__":
    main(sys.argv[1:])
