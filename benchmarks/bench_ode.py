"""Backprop vs adjoint vs interpolated adjoint (Daulbaev et al., NeurIPS 2020), side by side.

Run:  python benchmarks/bench_ode.py            (synthetic problems + digits classifier)
      python benchmarks/bench_ode.py --quick    (fewer repeats, 3 digits epochs)
      python benchmarks/bench_ode.py --part synthetic | digits

Part 1 — one gradient of ``|y(T)|^2 + sum y(T)`` for MLP dynamics ``W2 tanh(W1 z + b1) + b2 -
lambda z`` (dim 64, hidden 128, batch 32, float64), on a *benign* problem (lambda = 0, T = 1) and
a *contracting* one (lambda = 20, T = 2), each method at rtol 1e-6 / atol 1e-8. Per method:
forward / backward function evaluations (NFE), median forward / backward wall time and the
backward time ratio to the adjoint method (measured in the same run), the gradient's relative
error against backprop at rtol 1e-10 / atol 1e-12, and the bytes each method keeps for backward
(measured with saved-tensor hooks: unique storages, parameters and y0 excluded).
Target (issue 7): on the contracting problem, interpolated backward NFE <= 0.7x the adjoint's at
equal or better gradient error.

Part 2 — a neural-ODE classifier on scikit-learn's bundled digits (1797 8x8 images; no
download): Linear(64, 32) -> ODEBlock(32, hidden 64, t in [0, 1]) -> Linear(32, 10), Adam, the
same initialisation and batches for ``grad="adjoint"`` and ``grad="interpolated"``; test accuracy,
mean backward NFE per iteration and total backward time (ratio measured in the same run).

Timings use one CPU thread by default (``--threads``): on a shared 2-core machine, OpenMP spin
waiting made every kernel ~100x slower with 2 threads. Benchmarks are not tests: nothing here
gates CI.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

import ode

REF_TOL = dict(rtol=1e-10, atol=1e-12)
TOL = dict(rtol=1e-6, atol=1e-8)


class MLPDynamics(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128, lam: float = 0.0):
        super().__init__()
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, dim)
        self.lam = lam

    def forward(self, t, z):
        out = self.l2(torch.tanh(self.l1(z)))
        return out - self.lam * z if self.lam else out


class _SavedBytes:
    """Bytes of the unique storages autograd saves for backward, minus the excluded tensors."""

    def __init__(self, exclude):
        self.skip = {x.untyped_storage().data_ptr() for x in exclude}
        self.seen: dict[int, int] = {}

    def pack(self, x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return x

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _one_gradient(func, y0, t, **kwargs):
    y0 = y0.clone().requires_grad_(True)
    stats = ode.ODEStats(grad=kwargs.get("grad", "interpolated"), method="dopri5")
    saved = _SavedBytes([y0, *func.parameters()])
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
        ys = ode.odeint(func, y0, t, stats=stats, **kwargs)
    loss = ys[-1].square().sum() + ys[-1].sum()
    t1 = time.perf_counter()
    grads = torch.autograd.grad(loss, [y0, *func.parameters()])
    t2 = time.perf_counter()
    flat = torch.cat([g.reshape(-1) for g in grads])
    return flat, stats, t1 - t0, t2 - t1, saved.total


def bench_problem(name: str, lam: float, T: float, variants, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    func = MLPDynamics(lam=lam).double()
    y0 = torch.randn(32, 64, dtype=torch.float64)
    t = torch.tensor([0.0, T], dtype=torch.float64)
    ref, *_ = _one_gradient(func, y0, t, grad="backprop", **REF_TOL)
    rows = []
    for label, kwargs in variants:
        fwd, bwd = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ode.InterpolationWarning)
            _one_gradient(func, y0, t, **kwargs, **TOL)  # warm-up, untimed
        for _ in range(repeats):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ode.InterpolationWarning)
                grad, stats, tf, tb, saved = _one_gradient(func, y0, t, **kwargs, **TOL)
            fwd.append(tf)
            bwd.append(tb)
        rows.append(dict(
            problem=name, method=label, fnfe=stats.forward_nfe, bnfe=stats.backward_nfe,
            t_fwd=statistics.median(fwd), t_bwd=statistics.median(bwd),
            err=float((grad - ref).norm() / ref.norm()), saved=saved,
            est=stats.interp_error, warned=bool(caught)))
    adjoint = next(r for r in rows if r["method"] == "adjoint")
    for r in rows:
        r["nfe_ratio"] = r["bnfe"] / adjoint["bnfe"]
        r["time_ratio"] = r["t_bwd"] / adjoint["t_bwd"]
    return rows


def print_rows(rows):
    head = (f"{'problem':<26}{'method':<24}{'fwd NFE':>8}{'bwd NFE':>8}{'bwd NFE/adj':>12}"
            f"{'fwd ms':>8}{'bwd ms':>9}{'bwd t/adj':>10}{'grad err':>10}{'stored':>11}"
            f"{'estimate':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        est = "" if r["est"] is None else f"{r['est']:.1e}" + ("!" if r["warned"] else "")
        print(f"{r['problem']:<26}{r['method']:<24}{r['fnfe']:>8}{r['bnfe']:>8}"
              f"{r['nfe_ratio']:>12.2f}{1e3 * r['t_fwd']:>8.1f}{1e3 * r['t_bwd']:>9.1f}"
              f"{r['time_ratio']:>10.2f}{r['err']:>10.1e}{r['saved'] / 2**20:>9.2f}Mi"
              f"{est:>10}")


def part_synthetic(repeats: int) -> None:
    print("Part 1: one gradient, rtol=1e-6 atol=1e-8, reference backprop at rtol=1e-10 "
          "(float64, dim 64, hidden 128, batch 32)\n")
    variants = [
        ("backprop", dict(grad="backprop")),
        ("adjoint", dict(grad="adjoint")),
        ("interpolated n=17", dict(grad="interpolated", n_nodes=17)),
        ("interpolated n=33", dict(grad="interpolated", n_nodes=33)),
        ("interpolated n=17 refine", dict(grad="interpolated", n_nodes=17,
                                          on_interp_error="refine")),
    ]
    rows = bench_problem("benign (lam=0, T=1)", 0.0, 1.0, variants, repeats)
    rows += bench_problem("contracting (lam=20, T=2)", 20.0, 2.0, variants, repeats)
    print_rows(rows)
    print("\n'!' after the estimate: the nested-grid estimate exceeded interp_tol (rtol**(1/3) = "
          "0.01) and a warning was issued.")
    contracting = [r for r in rows if r["problem"].startswith("contracting")]
    adjoint = next(r for r in contracting if r["method"] == "adjoint")
    print("\nTarget on the contracting problem: interpolated backward NFE <= 0.7x adjoint's at "
          "equal or better gradient error")
    for r in contracting:
        if r["method"].startswith("interpolated"):
            ok = r["nfe_ratio"] <= 0.7 and r["err"] <= adjoint["err"]
            print(f"  {r['method']:<26} NFE ratio {r['nfe_ratio']:.2f}, error {r['err']:.1e} vs "
                  f"adjoint {adjoint['err']:.1e}: {'MET' if ok else 'MISSED'}")


# -- Part 2: digits -------------------------------------------------------------------------------

class DigitsODE(nn.Module):
    """Linear(64, 32) -> ODEBlock -> Linear(32, 10) on 8x8 digit images."""

    def __init__(self, *, grad: str, rtol: float, atol: float, n_nodes: int = 17):
        super().__init__()
        self.encoder = nn.Linear(64, 32)
        dyn = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        self.ode = ode.ODEBlock(_Autonomous(dyn), (0.0, 1.0), grad=grad, rtol=rtol, atol=atol,
                                n_nodes=n_nodes)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.ode(torch.tanh(self.encoder(x))))


class _Autonomous(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, t, y):
        return self.net(y)


def load_digits_split(seed: int = 0):
    """scikit-learn's bundled digits, scaled to [0, 1], 80/20 split (fixed seed)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            'the digits benchmark needs scikit-learn; pip install "hiremate[recipes]"') from e
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    return (x[perm[:split]], y[perm[:split]]), (x[perm[split:]], y[perm[split:]])


def train_digits(grad: str, *, epochs: int, seed: int, rtol: float, atol: float) -> dict:
    (xtr, ytr), (xte, yte) = load_digits_split()
    torch.manual_seed(seed)
    model = DigitsODE(grad=grad, rtol=rtol, atol=atol)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    bnfe, fnfe, t_bwd, iters = [], [], 0.0, 0
    for _ in range(epochs):
        for idx in torch.randperm(len(xtr), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            t0 = time.perf_counter()
            loss.backward()
            t_bwd += time.perf_counter() - t0
            opt.step()
            bnfe.append(model.ode.last_stats.backward_nfe)
            fnfe.append(model.ode.last_stats.forward_nfe)
            iters += 1
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return dict(grad=grad, acc=acc, bnfe=statistics.mean(bnfe), fnfe=statistics.mean(fnfe),
                t_bwd=t_bwd, iters=iters)


def part_digits(epochs: int, seeds: list[int]) -> None:
    rtol, atol = 1e-4, 1e-6
    print(f"\nPart 2: digits classifier, {epochs} epochs, Adam lr 3e-3, batch 64, rtol={rtol:g} "
          f"atol={atol:g}, interpolated n_nodes=17, seeds {seeds}\n")
    print(f"{'seed':<6}{'method':<14}{'test acc':>9}{'fwd NFE/it':>11}{'bwd NFE/it':>11}"
          f"{'bwd s':>8}{'bwd t/adj':>10}")
    results = {"adjoint": [], "interpolated": []}
    for seed in seeds:
        runs = {g: train_digits(g, epochs=epochs, seed=seed, rtol=rtol, atol=atol)
                for g in ("adjoint", "interpolated")}
        for g, r in runs.items():
            results[g].append(r)
            ratio = r["t_bwd"] / runs["adjoint"]["t_bwd"]
            print(f"{seed:<6}{g:<14}{100 * r['acc']:>8.2f}%{r['fnfe']:>11.1f}{r['bnfe']:>11.1f}"
                  f"{r['t_bwd']:>8.2f}{ratio:>10.2f}")
    for g, rs in results.items():
        accs = [100 * r["acc"] for r in rs]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"mean  {g:<14}{statistics.mean(accs):>8.2f}% +- {spread:.2f}  "
              f"bwd NFE/it {statistics.mean(r['bnfe'] for r in rs):.1f}")
    ratio = sum(r["t_bwd"] for r in results["interpolated"]) / sum(
        r["t_bwd"] for r in results["adjoint"])
    print(f"backward time interpolated / adjoint (all seeds): {ratio:.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and epochs")
    parser.add_argument("--part", choices=["all", "synthetic", "digits"], default="all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)\n")
    if args.part in ("all", "synthetic"):
        part_synthetic(repeats=2 if args.quick else 5)
    if args.part in ("all", "digits"):
        epochs = args.epochs or (3 if args.quick else 10)
        seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
        part_digits(epochs, seeds)


if __name__ == "__main__":
    main()
