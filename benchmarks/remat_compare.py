"""Side-by-side: activation peak and step time of remat vs the alternatives, in one run.

    python -m benchmarks.remat_compare --model gpt --budgets 100 70 50 30
    python -m benchmarks.remat_compare --model unet --budgets 100 70 50 30
    python -m benchmarks.remat_compare --model vit --d-model 192 --budgets 50
    python -m benchmarks.remat_compare --quick          # a small, fast run

For each method it runs a few training steps (forward + backward) of the same model on the same
batch and prints the measured peak of bytes allocated by a step (``remat.track_memory``: the CPU
allocator's own events, or the CUDA allocator) and the median step time, both as ratios to eager
PyTorch measured in the same run. Methods:

* ``eager``                 — unmodified PyTorch;
* ``checkpoint(blocks)``    — ``torch.utils.checkpoint`` around every block (non-reentrant);
* ``torch.compile(budget=B)`` — ``torch.compile(backend="aot_eager")`` with
  ``torch._functorch.config.activation_memory_budget = B`` (PyTorch's own budgeted partitioner);
* ``torch.compile(inductor, budget=B)`` (``--inductor``) — the same partitioner under
  ``torch.compile``'s default backend, what a user who calls ``torch.compile`` gets: its setup
  is a first call with empty compile caches (``torch._inductor.utils.fresh_cache``), as on a new
  machine; its peak and time include Inductor's fused kernels, so they are not the partitioner's
  alone (that is the ``aot_eager`` row);
* ``remat(B)``              — ``remat.rematerialize(model, batch, budget=B)``.

Each method's setup (seconds until its first step ended: remat's measurement, capture,
profiling, solve and compile, ``torch.compile``'s first call) is printed beside it.

Gradients of every method are compared with eager's (max abs difference); a legend under the
table defines every column and explains any difference. Not a test: it never fails on times; the
numbers go in the issue notes.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

import remat
from remat.costs import _page_fault_counter
from remat.frames import own_step  # a frame of its own: NOTE [ Owning the compiled frames ]
from benchmarks.models import GPT, GPTConfig, ResNet, UNet, ViT, gpt_batch, image_batch


@dataclass
class Row:
    method: str
    peak: int
    step_s: float
    grad_diff: float
    note: str = ""
    setup_s: float = float("nan")  # until the first step ended: capture, solve, compile, step
    # remat: the same in a later run, whose op costs and schedule the plan cache kept
    setup_again_s: float = float("nan")


def build(args: argparse.Namespace) -> tuple[nn.Module, tuple, Callable, list[nn.Module]]:
    """Model, batch (on ``args.device``), loss function and the blocks a person would
    checkpoint; the caller moves the model."""
    dev = args.device
    torch.manual_seed(0)
    if args.model == "gpt":
        cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                        n_layer=args.layers, n_head=args.heads, dropout=args.dropout,
                        attention=args.attention)
        model = GPT(cfg)
        idx, tgt = gpt_batch(cfg, args.batch)
        return model, (idx.to(dev), tgt.to(dev)), lambda out: out, list(model.blocks)
    if args.model == "hf-gpt2":  # Hugging Face GPT-2 from a config (no weights), loss inside
        import transformers

        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads,
                                      vocab_size=args.vocab, n_positions=args.seq,
                                      resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                                      attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0)
        model = LabelledLM(transformers.GPT2LMHeadModel(cfg))
        ids = torch.randint(args.vocab, (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(0))
        return model, (ids.to(dev),), lambda out: out, list(model.lm.transformer.h)
    if args.model == "hf-llama":  # Llama-style (RMSNorm, rotary, SwiGLU) from a config
        import transformers

        cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.d_model,
                                       num_attention_heads=args.heads,
                                       num_key_value_heads=args.heads,
                                       intermediate_size=int(8 * args.d_model / 3) // 8 * 8,
                                       vocab_size=args.vocab, max_position_embeddings=args.seq,
                                       attention_dropout=args.dropout)
        model = LabelledLM(transformers.LlamaForCausalLM(cfg))
        ids = torch.randint(args.vocab, (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(0))
        return model, (ids.to(dev),), lambda out: out, list(model.lm.model.layers)
    if args.model == "vit":  # patches by a strided convolution, pre-norm blocks, no mask
        model = ViT(image=args.image, patch=4, d_model=args.d_model, depth=args.layers,
                    n_head=args.heads, dropout=args.dropout)
        x, y = (t.to(dev) for t in image_batch(args.batch, size=args.image))
        return model, (x, y), lambda out: out, list(model.blocks)
    if args.model == "unet":
        model = UNet(width=args.width or 16, depth=args.depth)
        x = image_batch(args.batch, size=args.image)[0].to(dev)
        loss = nn.MSELoss()  # reconstruct the input: a dense loss over the output map
        return model, (x,), lambda out: loss(out, x), [*model.down, *model.up]
    model = ResNet(width=args.width or 32, blocks=tuple([args.layers] * 3))
    x, y = (t.to(dev) for t in image_batch(args.batch, size=args.image))
    loss = nn.CrossEntropyLoss()
    return model, (x,), lambda out: loss(out, y), list(model.layers)


class LabelledLM(nn.Module):
    """A Hugging Face causal LM called with its inputs as labels: returns the loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return ckpt.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def with_block_checkpoints(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every block wrapped in ``torch.utils.checkpoint``."""
    model = copy.deepcopy(model)
    if isinstance(model, (GPT, ViT)):
        model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    elif isinstance(model, LabelledLM):  # Hugging Face's own per-layer checkpointing
        if hasattr(model.lm, "activation_checkpointing_enable"):
            model.lm.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif isinstance(model, UNet):
        model.down = nn.ModuleList(Checkpointed(b) for b in model.down)
        model.up = nn.ModuleList(Checkpointed(b) for b in model.up)
    else:
        model.layers = nn.Sequential(*(Checkpointed(b) for b in model.layers))
    return model


def measure(name: str, model: nn.Module, run: Callable[[], torch.Tensor], ref_grads: list | None,
            steps: int, note: str = "", device: str = "cpu") -> tuple[Row, list]:
    """One method's measured peak and gradients (after a warm-up step that compiles or solves),
    and the median time of ``steps`` more steps (``nan`` for ``steps=0``: time it beside the
    others with :func:`alternate_steps`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    start = time.perf_counter()
    run().backward()  # warm-up (compiles / solves)
    first_step = time.perf_counter() - start
    for p in params:
        p.grad = None
    gc.collect()
    torch.manual_seed(1)
    with remat.track_memory(device) as mem:
        run().backward()
    grads = [p.grad.detach().clone() for p in params]
    step_s = alternate_steps([(model, run)], steps, device)[0] if steps > 0 else float("nan")
    diff = 0.0
    if ref_grads is not None:
        diff = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads))
    return Row(name, mem.peak_bytes, step_s, diff, note, first_step), grads


# glibc's mallopt parameters (malloc.h): return freed memory to the system only above this much
# at the heap's top, and serve blocks up to this size from the heap (32 MiB: glibc's maximum).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_TRIM, _KEEP_MMAP = 2**31 - 1, 32 * 2**20


def add_inductor(add: Callable, model: nn.Module, batch: tuple, loss_of: Callable,
                 budget: float) -> None:
    """The ``torch.compile(inductor, budget=B)`` row: ``torch.compile``'s default backend with
    the budgeted partitioner, its first call made with fresh (empty) Inductor caches, as a user
    meets it on a new machine or after changing the model."""
    from torch._inductor.utils import fresh_cache

    frac = budget / 100.0
    m = copy.deepcopy(model)
    cm = torch.compile(own_step(f"compare_inductor_{budget:g}"), dynamic=False)

    def run() -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=frac):
            return loss_of(cm(m, batch, {}))

    with fresh_cache():
        add(f"torch.compile(inductor, budget={frac:g})", m, run, "first call from empty caches")


def setup_again(model: nn.Module, batch: tuple, loss_of: Callable, budget: float,
                args: argparse.Namespace, step_peak: int, cache_dir: str) -> float:
    """Seconds from ``rematerialize`` to the end of the first step in a later run on this
    machine: a new capture of ``model`` whose op costs and schedule are in ``cache_dir``
    (NOTE [ Costs measured once ] in remat/cache.py)."""
    m = copy.deepcopy(model)
    start = time.perf_counter()
    rm = remat.rematerialize(m, *batch, budget=f"{budget:g}%", solver=args.solver,
                             time_limit=args.time_limit, step_peak_bytes=step_peak,
                             cache=remat.PlanCache(cache_dir), dynamic=args.dynamic)
    loss_of(rm(*batch)).backward()
    took = time.perf_counter() - start
    if not rm.plan.cache_hit:
        print(f"remat({budget:g}%): the second capture did not hit the plan cache",
              file=sys.stderr)
    return took


def keep_freed_memory() -> bool:
    """Tell glibc to keep the memory a step frees for the next step, as CUDA's caching allocator
    does (what ``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_`` set at start-up); ``False``
    where the C library is not glibc. Otherwise glibc hands big freed blocks back to the system
    and the next step faults them in again, a page at a time, ~1 us each: how many depends on
    the allocator's state (in one run a 6-layer GPT's unmodified step paid 7,521 page faults a
    step and its rematerialized step none, which read as 7 points less recomputation; NOTE
    [ Page faults are not an op's cost ] in remat/costs.py)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM)) and bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_MMAP))


def alternate_steps(runs: list[tuple[nn.Module, Callable[[], torch.Tensor]]], steps: int,
                    device: str = "cpu", faults: list[float] | None = None) -> list[float]:
    """Median seconds of a training step of each ``(model, run)``, the models taking turns
    step by step so that all see the same machine load. ``faults``, if given, receives the
    median minor page faults of each one's steps (on CPU, glibc handing memory back to the
    system between steps: NOTE [ Page faults are not an op's cost ] in remat/costs.py).

    Timed one after the other, the same 24-layer GPT's eager step measured 2x slower than its
    checkpointed one (the load had changed between them). The garbage collector is off while
    timing (as in ``timeit``): after a capture the heap holds millions of tracing objects, and a
    full collection landing in one step added ~0.2 s to a few-millisecond step.
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    page_faults = _page_fault_counter()
    times: list[list[float]] = [[] for _ in runs]
    counts: list[list[int]] = [[] for _ in runs]
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            for k, (model, run) in enumerate(runs):
                for p in model.parameters():
                    p.grad = None
                sync()
                before = page_faults()
                start = time.perf_counter()
                run().backward()
                sync()
                times[k].append(time.perf_counter() - start)
                counts[k].append(page_faults() - before)
    finally:
        gc.enable()
    if faults is not None:
        faults[:] = [statistics.median(c) for c in counts]
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "resnet", "unet", "vit", "hf-gpt2", "hf-llama"],
                        default="gpt")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (peaks from the CUDA "
                        "allocator there)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention", choices=["manual", "sdpa"], default="manual")
    parser.add_argument("--width", type=int, default=None, help="CNN width (default: resnet 32, unet 16)")
    parser.add_argument("--depth", type=int, default=3, help="unet: encoder/decoder levels")
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budgets", type=float, nargs="+", default=[100, 70, 50, 30])
    parser.add_argument("--solver", default=remat.DEFAULT_SOLVER)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-amb", action="store_true", help="skip torch's activation_memory_budget")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile's default "
                        "backend (Inductor) with the budget, its setup from empty caches")
    parser.add_argument("--quick", action="store_true", help="small model, two budgets, fast")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dynamic", dest="dynamic", action="store_const", const=True,
                        default=None, help="remat captures with dynamic dimensions at once "
                        "(rematerialize(dynamic=True)) instead of the example's static shapes "
                        "first (the default: NOTE [ Static first ] in remat/module.py)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.layers, args.d_model, args.seq, args.vocab, args.batch = 2, 64, 64, 128, 4
        args.budgets, args.steps = [100, 50], 3

    model, batch, loss_of, blocks = build(args)
    model.to(args.device)
    torch.manual_seed(1)
    dev = args.device
    eager_row, ref = measure("eager", model, lambda: loss_of(model(*batch)), None, 0, device=dev)
    # Every method is built and checked first, then all are timed taking turns.
    contenders: list[tuple[Row, nn.Module, Callable[[], torch.Tensor]]] = [
        (eager_row, model, lambda: loss_of(model(*batch)))]

    def add(name, module, run, note=""):
        row, _ = measure(name, module, run, ref, 0, note, device=dev)
        contenders.append((row, module, run))
        return row

    ck = with_block_checkpoints(model)
    add(f"checkpoint({len(blocks)} blocks)", ck, lambda: loss_of(ck(*batch)))
    for b in args.budgets:
        frac = b / 100.0
        if not args.skip_amb:
            # Each contender compiles a frame of its own, keeping its graphs (compiled with its
            # budget) without torch._dynamo.reset(), which would drop the others' before timing.
            m = copy.deepcopy(model)
            cm = torch.compile(own_step(f"compare_budget_{b:g}"), backend="aot_eager",
                               dynamic=False)

            def run(m=m, cm=cm, frac=frac):
                with torch._functorch.config.patch(activation_memory_budget=frac):
                    return loss_of(cm(m, batch, {}))

            add(f"torch.compile(budget={frac:g})", m, run)
        if args.inductor:
            add_inductor(add, model, batch, loss_of, b)
        m = copy.deepcopy(model)
        kept = tempfile.TemporaryDirectory(prefix="remat_compare_")
        start = time.perf_counter()
        try:
            # The loss is outside the module: the budget is of the whole eager step measured
            # above (NOTE [ A budget is what the user measures ]). An empty plan cache of its
            # own: every budget measures and solves, so that the setup column is what a first
            # run costs; the second capture below is a later run's.
            rm = remat.rematerialize(m, *batch, budget=f"{b:g}%", solver=args.solver,
                                     time_limit=args.time_limit, step_peak_bytes=eager_row.peak,
                                     cache=remat.PlanCache(kept.name), dynamic=args.dynamic)
        except remat.RematError as e:
            contenders.append((Row(f"remat({b:g}%)", 0, float("nan"), float("nan"),
                                   f"error: {e}"[:90]), None, None))
            continue
        plan = rm.plan
        status = {"optimal": "proven optimal", "feasible": "fits, not proven optimal",
                  "time_limit": "fits; the time limit ended the search"}
        note = (f"predicted peak/eager {plan.predicted_step_ratio:.3f} (unmodified capture "
                f"{plan.baseline_bytes / max(plan.eager_bytes, 1):.3f}), predicted time "
                f"+{100 * plan.predicted_overhead:.0f}%, solved in {plan.solve_time_s:.1f} s "
                f"({status.get(plan.status, plan.status)})")
        setup = time.perf_counter() - start
        row = add(f"remat({b:g}%)", m, lambda rm=rm: loss_of(rm(*batch)), note)
        row.setup_s += setup
        row.setup_again_s = setup_again(model, batch, loss_of, b, args, eager_row.peak, kept.name)
        kept.cleanup()
        row.note += f"; measured/predicted peak {row.peak / max(plan.predicted_peak_bytes, 1):.3f}"
    timed = [(row, module, run) for row, module, run in contenders if run is not None]
    medians = alternate_steps([(module, run) for _, module, run in timed], args.steps, dev)
    for (row, _, _), step_s in zip(timed, medians):
        row.step_s = step_s
    rows = [row for row, _, _ in contenders]

    size = f"depth={args.depth}" if args.model == "unet" else f"layers={args.layers}"
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"threads={torch.get_num_threads()}")
    capture = "static first" if args.dynamic is None else "dynamic"
    print(f"remat_compare: model={args.model} {size} batch={args.batch} solver={args.solver} "
          f"capture={capture} torch={torch.__version__} {args.device} {where} "
          f"(median of {args.steps} steps, methods taking turns)")
    print(report(rows, eager_row, dropout=0.0 if args.model in ("unet", "resnet") else args.dropout))
    return rows


def report(rows: list[Row], eager: Row, *, dropout: float = 0.0) -> str:
    """The table, then a legend that defines each column and explains every difference."""
    width = max(28, *(len(r.method) + 2 for r in rows))
    lines = [f"{'method':<{width}}{'peak MiB':>10}{'peak/eager':>12}{'time/eager':>12}"
             f"{'setup s':>9}{'again s':>9}{'grad diff':>11}  notes"]
    for r in rows:
        again = "-" if math.isnan(r.setup_again_s) else f"{r.setup_again_s:.1f}"
        lines.append(f"{r.method:<{width}}{r.peak / 2**20:>10.2f}{r.peak / eager.peak:>12.3f}"
                     f"{r.step_s / eager.step_s:>12.3f}{r.setup_s:>9.1f}{again:>9}"
                     f"{r.grad_diff:>11.2e}  {r.note}")
    lines += [
        "",
        "peak MiB:   measured peak of the bytes one training step allocates (forward, loss, "
        "backward;",
        "            the CPU allocator's events or the CUDA allocator: remat.track_memory)",
        "peak/eager, time/eager: that peak and the median step time over eager PyTorch's, "
        "this run",
        "setup s:    seconds from handing the model to the method until its first training "
        "step ended",
        "            (remat: eager measurement, capture, profile, solve, compile; torch.compile: "
        "its first call)",
        "again s:    remat's setup s in a later run on this machine: the op costs and the "
        "schedule",
        "            come from the plan cache the first run filled (capture and eager "
        "measurement remain)",
        "grad diff:  largest absolute difference of any parameter gradient from eager's",
        "checkpoint(N blocks): torch.utils.checkpoint (non-reentrant) around each of N blocks",
        "torch.compile(budget=B): torch.compile(backend='aot_eager') with "
        "torch._functorch.config.activation_memory_budget=B",
        *(["torch.compile(inductor, budget=B): the same budget under torch.compile's default "
           "backend (what a user gets); its setup is a",
           "            first call with empty compile caches; peak and time include its fused "
           "kernels"] if any("inductor" in r.method for r in rows) else []),
        "remat(B%):  remat.rematerialize(model, *batch, budget='B%') (B% of eager's measured "
        "step peak)",
    ]
    if any(r.grad_diff > 0 for r in rows if r.method.startswith("torch.compile")) and dropout:
        lines.append(
            f"torch.compile's gradients differ: its partitioner recomputes dropout (p={dropout:g}) "
            "by drawing a new mask (random ops are not functionalized on CPU); remat never "
            "re-draws random ops")
    elif any(r.grad_diff > 0 for r in rows if r.method.startswith(("torch", "remat"))):
        lines.append("a nonzero grad diff means that method computes other gradients than eager")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
