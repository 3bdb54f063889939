"""quant.cp side by side: ADMM vs CP-then-quantize, the scale rule, and a compressed digits CNN.

Run: ``python -m benchmarks.bench_cp`` (all sections, ~1-2 min on 2 CPU cores) or
``python -m benchmarks.bench_cp --section errors|ridge|scale|model``.

Sections (every figure is measured in this run; ratios compare runs made side by side):

* ``errors`` -- relative reconstruction error ||W - W_hat|| / ||W|| at 8/4/2 bits of: float CP,
  plain CP-ALS then rounding (the naive baseline), norm-controlled CP then rounding
  (``cp_then_quantize``, the baseline the tests use) and ADMM (``quantized_cp``), on the two
  middle convs of a CNN trained on scikit-learn's digits and on a low-rank synthetic tensor; with
  the wall-time ratio ADMM / CP-then-quantize.
* ``ridge`` -- float error, error after 4-bit rounding, ADMM's error at 4 and 8 bits started
  from that float model, and the spread of the rank-one terms (sum of their norms / ||W||;
  large = degenerate, cancelling terms) against the CP-ALS ridge.
* ``scale`` -- ADMM with the grid scale fixed per sub-problem (ours) vs re-searched at every
  projection (the reference code's rule), error and time.
* ``model`` -- the recipe in plain PyTorch: the recipes' ``DigitsCNN`` (BatchNorm) trained on the
  digits, its middle convs compressed 2x at int8 and int4, then fine-tuned: held-out accuracy
  before / after compression / after fine-tuning, parameters, bytes and FLOPs before/after, and
  the eval forward time of the dense and compressed models measured side by side.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn
from torch.nn import functional as F

import quant.cp.admm as admm
from quant.cp import compress_model, cp_als, cp_then_quantize, quantized_cp, rank_for_rate
from quant.cp.grid import project, search_scale

SECTIONS = ("errors", "ridge", "scale", "model")


# ----------------------------------------------------------------------------------- inputs
def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    tr, va = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2, random_state=0,
                              stratify=y.numpy())
    return x[tr], y[tr], x[va], y[va]


def _train(net: nn.Module, x, y, *, steps: int, lr: float, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.1)
    net.train()
    step = 0
    while step < steps:
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(order) - 63, 64):
            idx = order[i:i + 64]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step == steps:
                break
    return net.eval()


def _accuracy(net: nn.Module, x, y) -> float:
    net.eval()
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def _trained_cnn():
    from recipes.models.cnn import DigitsCNN

    torch.manual_seed(0)
    x_tr, y_tr, x_va, y_va = _digits()
    net = _train(DigitsCNN(channels=(16, 32, 64), dropout=0.1), x_tr, y_tr, steps=200, lr=1e-2)
    return net, x_tr, y_tr, x_va, y_va


def _low_rank(shape=(40, 30, 9), rank=10, noise=0.01, seed=1):
    gen = torch.Generator().manual_seed(seed)
    fs = [torch.randn(d, rank, generator=gen, dtype=torch.float64) for d in shape]
    t = torch.einsum("ir,jr,kr->ijk", *fs)
    return (t + noise * t.norm() / t.numel() ** 0.5 * torch.randn(t.shape, generator=gen,
                                                                  dtype=torch.float64)).float()


def _tensors():
    net = _trained_cnn()[0]
    out = []
    for name in ("features.3", "features.7"):
        w = net.get_submodule(name).weight.detach()
        out.append((f"digits {name} {tuple(w.shape)}", w.reshape(w.shape[0], w.shape[1], -1),
                    rank_for_rate(tuple(w.shape), 2.0)))
    out.append(("low-rank 40x30x9 (rank 10, 1% noise)", _low_rank(), 10))
    return out


# ----------------------------------------------------------------------------------- sections
def section_errors() -> None:
    print("== errors: relative reconstruction error (lower is better) ==")
    print(f"{'tensor':44s} {'rank':>4s} {'bits':>4s} {'float CP':>8s} {'ALS->q':>8s} "
          f"{'CP->q':>8s} {'ADMM':>8s} {'ADMM/CP->q':>10s} {'time ratio':>10s}")
    for name, x, rank in _tensors():
        plain = cp_als(x, rank, ridge=0.0).factors
        for bits in (8, 4, 2):
            t0 = time.perf_counter()
            ptq = cp_then_quantize(x, rank, bits)
            t1 = time.perf_counter()
            res = quantized_cp(x, rank, bits)
            t2 = time.perf_counter()
            naive = cp_then_quantize(x, rank, bits, init=plain)
            print(f"{name:44s} {rank:4d} {bits:4d} {res.float_error:8.4f} {naive.error:8.4f} "
                  f"{ptq.error:8.4f} {res.error:8.4f} {res.error / ptq.error:10.3f} "
                  f"{(t2 - t1) / (t1 - t0):9.1f}x")


def section_ridge() -> None:
    print("== ridge: norm control of the float CP (300 sweeps) ==")
    print(f"{'tensor':44s} {'ridge':>7s} {'float':>8s} {'CP->q 4b':>8s} {'ADMM 4b':>8s} "
          f"{'ADMM 8b':>8s} {'spread':>8s}")
    for name, x, rank in _tensors():
        xd = x.double()
        for ridge in (0.0, 1e-3, 1e-2):
            res = cp_als(xd, rank, ridge=ridge)
            q4 = cp_then_quantize(xd, rank, 4, init=res.factors)
            a4 = quantized_cp(xd, rank, 4, init=res.factors)
            a8 = quantized_cp(xd, rank, 8, init=res.factors)
            spread = float(torch.stack([a.norm(dim=0) for a in res.factors]).prod(0).sum()
                           / xd.norm())
            print(f"{name:44s} {ridge:7.0e} {res.error:8.4f} {q4.error:8.4f} {a4.error:8.4f} "
                  f"{a8.error:8.4f} {spread:8.2f}")


def _solve_mode_every_projection(x, h, duals, rhos, scales, mode, bits, inner_iter):
    """The reference code's rule: re-run the clipping search at every projection."""
    rank = h[0].shape[1]
    eye = torch.eye(rank, dtype=x.dtype)
    g = admm.gram_hadamard([a.T @ a for a in h], mode)
    f = admm.mttkrp(x, h, mode)
    rho = float(torch.trace(g)) / rank
    u = duals[mode]
    if rhos[mode] is not None:
        u *= rhos[mode] / rho
    rhos[mode] = rho
    chol = torch.linalg.cholesky(g + rho * eye)
    hn = h[mode]
    for _ in range(inner_iter):
        h_ls = torch.cholesky_solve((f + rho * (hn + u)).T, chol).T
        s = search_scale(h_ls - u, bits)
        hn = project(h_ls - u, s, bits)
        u += hn - h_ls
    h[mode], scales[mode] = hn, s
    return g, f


def section_scale() -> None:
    print("== scale: grid scale fixed per sub-problem (ours) vs searched at every projection ==")
    print(f"{'tensor':44s} {'bits':>4s} {'fixed':>8s} {'every':>8s} {'time every/fixed':>16s}")
    ours = admm._solve_mode
    for name, x, rank in _tensors():
        for bits in (4, 2):
            t0 = time.perf_counter()
            fixed = quantized_cp(x, rank, bits)
            t1 = time.perf_counter()
            admm._solve_mode = _solve_mode_every_projection
            try:
                every = quantized_cp(x, rank, bits)
            finally:
                admm._solve_mode = ours
            t2 = time.perf_counter()
            print(f"{name:44s} {bits:4d} {fixed.error:8.4f} {every.error:8.4f} "
                  f"{(t2 - t1) / (t1 - t0):15.1f}x")


def _forward_ms(net: nn.Module, x: torch.Tensor, repeats: int = 30) -> float:
    """Median wall time of an eval forward pass, in ms."""
    times = []
    with torch.no_grad():
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            net(x)
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times[3:])[len(times[3:]) // 2]


def section_model(finetune_steps: int = 100) -> None:
    print("== model: DigitsCNN(16, 32, 64) on scikit-learn digits, convs features.3 and "
          "features.7 compressed 2x ==")
    net, x_tr, y_tr, x_va, y_va = _trained_cnn()
    base = _accuracy(net, x_va, y_va)
    print(f"dense: held-out accuracy {base:.4f} ({len(y_va)} images)")
    for bits in (8, 4):
        model = copy.deepcopy(net)
        t0 = time.perf_counter()
        report = compress_model(model, rate=2.0, bits=bits, include="features.*",
                                exclude="features.0", example_inputs=x_va[:1], trainable=True)
        solve = time.perf_counter() - t0
        after = _accuracy(model, x_va, y_va)
        _train(model, x_tr, y_tr, steps=finetune_steps, lr=1e-3, seed=1)
        tuned = _accuracy(model, x_va, y_va)
        print(f"\n-- int{bits}: accuracy {base:.4f} dense -> {after:.4f} compressed -> {tuned:.4f} "
              f"after {finetune_steps} fine-tuning steps (AdamW lr 1e-3, cosine); solve "
              f"{solve:.1f}s")
        print(report.summary())
        for m in model.modules():
            if hasattr(m, "freeze"):
                m.freeze()
        x = x_va[:64]
        dense_ms, cp_ms = _forward_ms(net, x), _forward_ms(model, x)
        print(f"eval forward, batch 64 of 8x8 images, CPU: dense {dense_ms:.2f} ms, compressed "
              f"(frozen int{bits}) {cp_ms:.2f} ms, ratio {cp_ms / dense_ms:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=SECTIONS, action="append")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.section or SECTIONS:
        globals()[f"section_{name}"]()
        print()


if __name__ == "__main__":
    main()
