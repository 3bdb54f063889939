"""Few-bit activations vs torch's, side by side: fwd+bwd time and saved-activation memory.

    python benchmarks/bench_fewbit.py                 # ~1 min on 2 CPU cores
    python benchmarks/bench_fewbit.py --repeats 31 --threads 2

Time: one forward + backward of each activation on a 4M-element float32 tensor (4096 x 1024),
torch module and few-bit module interleaved in the same loop, median of ``--repeats``. Two clocks:
the CPU time of the (single) compute thread, which the other jobs of a shared machine do not
inflate, and wall time with ``--threads`` intra-op threads. Ratios are few-bit / torch.

Memory: bytes saved for backward (storage-deduplicated, parameters excluded) by one training
forward of a pre-LN transformer FFN block (LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual)
and of a full ``nn.TransformerEncoderLayer`` (pre-LN, GELU module), exact vs few-bit at 1-4 bits.

# NOTE [ What a fused kernel would change ]
Pure PyTorch pays one memory pass per elementary op. The 2-bit forward here is: the torch
activation (read x, write y), then x -> float16 -> int32 pattern -> code table lookup -> pack
(five more passes, ~3x the activation's own traffic); backward decodes each plane with a 256-entry
table and multiplies (two passes over the gradient). A fused kernel computes y and the packed
code in the one pass that reads x (the codes are 1/16 of x's bytes) and computes ``dx = dy * q``
in one pass reading dy and the codes -- less traffic than torch's own backward, which reads dy
*and* x. Its time ratio would be ~1.0-1.4x (fewbit's CUDA kernel measured ~1.37x, see
shared/notes/quant-ode-prior-art.md); the memory saving is the same.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from quant.fewbit import FEWBIT_MODULES, SavedTensorsMeter, replace_activations

ACTIVATIONS = [("GELU", "gelu"), ("SiLU", "silu"), ("Tanh", "tanh"), ("ELU", "elu"),
               ("ReLU", "relu"), ("LeakyReLU", "leaky_relu")]


def _step(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    leaf = x.requires_grad_()
    module(leaf).backward(g)
    leaf.grad = None


def _time(modules: dict[str, nn.Module], x, g, repeats: int, clock) -> dict[str, float]:
    for m in modules.values():  # warm up allocator and caches
        _step(m, x, g)
    samples: dict[str, list[float]] = {k: [] for k in modules}
    for _ in range(repeats):
        for name, m in modules.items():  # interleaved: load changes hit every candidate alike
            t0 = clock()
            _step(m, x, g)
            samples[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_time(repeats: int, threads: int) -> None:
    x = torch.randn(4096, 1024)
    g = torch.randn_like(x)
    print(f"fwd+bwd on a {x.numel() / 2**20:.0f}M-element float32 tensor, median of {repeats}")
    header = "activation   torch ms   " + "   ".join(f"{b}-bit ratio" for b in (1, 2, 3, 4))
    for label, n_threads, clock in (
        ("CPU time, 1 thread", 1, time.thread_time),
        (f"wall time, {threads} threads", threads, time.perf_counter),
    ):
        torch.set_num_threads(n_threads)
        print(f"\n[{label}]\n{header}")
        for torch_name, name in ACTIVATIONS:
            cls = FEWBIT_MODULES[name]
            exact = cls._activation in ("relu", "leaky_relu")
            modules = {"torch": getattr(nn, torch_name)()}
            for bits in ((1,) if exact else (1, 2, 3, 4)):
                modules[f"{bits}"] = cls() if exact else cls(bits=bits)
            t = _time(modules, x, g, repeats, clock)
            ratios = [
                f"{t[str(b)] / t['torch']:11.2f}" if str(b) in t else f"{'-':>11s}"
                for b in (1, 2, 3, 4)
            ]
            print(f"{torch_name:10s} {t['torch'] * 1e3:9.2f}   " + "   ".join(ratios))
    torch.set_num_threads(threads)


class FFN(nn.Module):
    """Pre-LN transformer feed-forward block: x + W2 GELU(W1 LN(x))."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    with SavedTensorsMeter(exclude=[*model.parameters(), *model.buffers()]) as meter:
        out = model(x)
    del out
    return meter.bytes


def bench_memory(d: int, batch: int, seq: int) -> None:
    x = torch.randn(batch, seq, d, requires_grad=True)
    builders = {
        f"FFN block (d={d})": lambda: FFN(d),
        f"TransformerEncoderLayer (d={d}, 12 heads)": lambda: nn.TransformerEncoderLayer(
            d, 12, 4 * d, dropout=0.0, activation=nn.GELU(), batch_first=True, norm_first=True
        ),
    }
    print(f"\nsaved for backward, input {batch}x{seq}x{d} float32 (parameters excluded)")
    print(f"{'model':44s} {'exact MiB':>10s} " + " ".join(f"{b}-bit MiB (saving)" for b in (1, 2, 3, 4)))
    for name, build in builders.items():
        torch.manual_seed(0)
        exact = _saved_bytes(build(), x)
        cells = []
        for bits in (1, 2, 3, 4):
            model = build()
            replace_activations(model, bits=bits)
            saved = _saved_bytes(model, x)
            cells.append(f"{saved / 2**20:8.2f} ({1 - saved / exact:6.1%})")
        print(f"{name:44s} {exact / 2**20:10.2f} " + " ".join(f"{c:>19s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    bench_time(args.repeats, args.threads)
    bench_memory(args.d, args.batch, args.seq)


if __name__ == "__main__":
    main()
