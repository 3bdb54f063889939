"""Dynamic padding: remat vs the alternatives on batches of many shapes, side by side in one run.

    python -m benchmarks.remat_shapes                  # GPT, 24 batches, lengths 32-256
    python -m benchmarks.remat_shapes --quick

Every method trains the same GPT on the same sequence of batches, each of its own length and
size (what ``DataCollatorWithPadding`` produces). Per method it prints:

* ``setup s``    — wall time of the whole run minus the sum of its steady step times (the time
  spent capturing, compiling and solving, whenever a new shape triggered it);
* ``run peak/eager`` — the run's peak (the largest step peak over all batches, measured with
  ``remat.track_memory``) over eager PyTorch's run peak: what a budget promises; then, per
  batch, the largest and the mean ratio of the step's peak to eager's on the same batch;
* ``time/eager`` — total steady step time over eager's total (each batch is run twice; the
  second run is timed).

Methods: eager; ``torch.utils.checkpoint`` around every block; ``torch.compile(budget=B)``:
``torch.compile(dynamic=True)`` with ``torch._functorch.config.activation_memory_budget = B``;
``remat.rematerialize`` (the example is the first batch).
Not a test: it never fails on times; the numbers go in the issue notes.
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

import remat
from benchmarks.models import GPT, GPTConfig
from benchmarks.remat_compare import with_block_checkpoints


@dataclass
class Result:
    method: str
    setup_s: float = 0.0
    ratios: list[float] = field(default_factory=list)
    step_s: float = 0.0
    exact: bool = True
    note: str = ""


def batches(count: int, max_batch: int, min_len: int, max_len: int, vocab: int,
            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        idx = torch.randint(vocab, (rng.randint(1, max_batch), rng.randint(min_len, max_len)),
                            generator=gen)
        out.append((idx, torch.roll(idx, -1, dims=1)))
    return out


def run(method: str, step, data, eager_peaks: list[int] | None, ref_grads, params,
        record: list | None = None) -> Result:
    """Each batch twice: once measured (peak, gradients), once timed. ``record`` receives each
    batch's gradients (the reference run); ``ref_grads`` are compared with.

    Each method gets its own copies of the batches: ``torch.compile`` stamps the tensors it
    sees with the dimensions it made dynamic, and the next method's capture read them (remat's
    captures kept the targets static after the ``torch.compile`` row: 9 solves instead of 2)."""
    data = [tuple(t.clone() for t in batch) for batch in data]
    result = Result(method)
    start = time.perf_counter()
    steady = 0.0
    peaks = []
    for k, batch in enumerate(data):
        for p in params:
            p.grad = None
        torch.manual_seed(k)
        with remat.track_memory() as mem:
            step(batch).backward()
        peaks.append(mem.peak_bytes)
        if record is not None:
            record.append([p.grad.detach().clone() for p in params])
        if ref_grads is not None:
            result.exact &= all(torch.equal(p.grad, g) for p, g in zip(params, ref_grads[k]))
        for p in params:
            p.grad = None
        torch.manual_seed(k)
        t0 = time.perf_counter()
        step(batch).backward()
        steady += time.perf_counter() - t0
    total = time.perf_counter() - start
    result.step_s = steady
    # Each batch ran twice: the steady run, and a first run that also did any setup (+ the
    # memory profiler's overhead, which the steady run has not: counted once more as steady).
    result.setup_s = max(0.0, total - 2 * steady)
    if eager_peaks is not None:
        result.ratios = [p / e for p, e in zip(peaks, eager_peaks)]
    result.peaks = peaks  # type: ignore[attr-defined]
    return result


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--budget", type=float, default=50.0, help="percent")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print remat's sizes and plans")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.batches, args.max_len = 2, 64, 10, 128
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.max_len, d_model=args.d_model,
                    n_layer=args.layers, n_head=args.heads, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    data = batches(args.batches, args.max_batch, args.min_len, args.max_len, args.vocab)
    frac = args.budget / 100.0

    ref_grads: list = []
    eager = run("eager", lambda b: model(*b), data, None, None, list(model.parameters()),
                record=ref_grads)
    eager_peaks = eager.peaks  # type: ignore[attr-defined]
    eager.ratios = [1.0] * len(data)
    results = [eager]

    ck = with_block_checkpoints(model)
    results.append(run(f"checkpoint({cfg.n_layer} blocks)", lambda b: ck(*b), data, eager_peaks,
                       ref_grads, list(ck.parameters())))

    torch._dynamo.reset()
    m = copy.deepcopy(model)
    with torch._functorch.config.patch(activation_memory_budget=frac):
        cm = torch.compile(m, backend="aot_eager", dynamic=True)
        results.append(run(f"torch.compile(budget={frac:g})", lambda b: cm(*b), data, eager_peaks,
                           ref_grads, list(m.parameters())))

    m = copy.deepcopy(model)
    t0 = time.perf_counter()
    example = [t.clone() for t in data[0]]  # without torch.compile's stamps (see run)
    rm = remat.rematerialize(m, *example, budget=f"{args.budget:g}%", time_limit=args.time_limit)
    first = time.perf_counter() - t0
    row = run(f"remat({args.budget:g}%)", lambda b: rm(*b), data, eager_peaks, ref_grads,
              list(m.parameters()))
    row.setup_s += first
    fits = sum(c.fits for c in rm.shapes.choices.values())
    row.note = (f"{len(rm.plans)} solves, {len(rm.shapes.choices)} sizes ({fits} within budget), "
                f"first setup {first:.1f}s")
    results.append(row)
    if args.verbose:
        print(rm.shapes.summary())
        for k, plan in enumerate(rm.plans):
            print(f"plan {k}: {plan.detail}")

    print(f"remat_shapes: GPT layers={cfg.n_layer} d={cfg.d_model} batches={len(data)} "
          f"(batch 1-{args.max_batch}, len {args.min_len}-{args.max_len}, "
          f"{len({tuple(b[0].shape) for b in data})} shapes) budget={args.budget:g}% "
          f"torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'method':<28}{'setup s':>9}{'run peak/eager':>16}{'per batch max':>15}{'mean':>7}"
          f"{'time/eager':>12}{'exact':>7}  notes")
    for r in results:
        print(f"{r.method:<28}{r.setup_s:>9.1f}{max(r.peaks) / max(eager_peaks):>16.3f}"
              f"{max(r.ratios):>15.3f}{statistics.mean(r.ratios):>7.3f}"
              f"{r.step_s / eager.step_s:>12.3f}{str(r.exact):>7}  {r.note}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
