"""Side-by-side under FSDP2: HiRemate's per-unit plans vs the alternatives, on 2 ranks, in one run.

    python -m benchmarks.remat_fsdp                       # HF Llama and HF GPT-2, 50 30 ckpt
    python -m benchmarks.remat_fsdp --model hf-llama --budgets 50 --steps 6
    python -m benchmarks.remat_fsdp --model hf-llama --layers 12 --budgets 50 30   # 30% reachable
    python -m benchmarks.remat_fsdp --device cuda         # 2 GPUs, NCCL
    python -m benchmarks.remat_fsdp --quick               # Llama only, budget 50, 3 steps
    python -m benchmarks.remat_fsdp --device cuda --ranks 1 --quick   # one GPU (gpu_check.sh)

The command re-launches itself under ``torch.distributed.run --standalone --nproc_per_node 2``
(``--ranks``)
(gloo on CPU with ``OMP_NUM_THREADS=1``, NCCL on CUDA). On each rank, every method builds the
same model from a config (``torch.manual_seed(0)``: the same weights for all, nothing
downloaded), shards each decoder layer and then the root with ``fully_shard`` and trains a few
steps (SGD, lr 0.1) on batches of its own rank (``input_ids`` (4, 64), seeds ``100 * rank + k``,
``labels=input_ids``). Methods:

* ``fsdp2 eager``                    — plain FSDP2;
* ``fsdp2 + checkpoint_wrapper(units)`` — every decoder layer wrapped in
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (non-reentrant) before
  ``fully_shard``, as torchtitan does: full activation checkpointing per unit;
* ``fsdp2 + compile(units, budget=B)`` — every decoder layer
  ``layer.compile(backend="aot_eager")`` before ``fully_shard``, with
  ``torch._functorch.config.activation_memory_budget = B``;
* ``ours B%``                        — ``integrations._fsdp.rematerialize_fsdp2`` (what the
  Lightning callback and the Accelerate plugin run) with ``budget="B%"`` of the whole step;
* ``ours at checkpoint_wrapper's peak`` (``--budgets ckpt``) — the same with a byte budget that
  lets its trial step measure up to the peak ``checkpoint_wrapper`` measured on that rank in
  this run: the two side by side at equal peak.

Each rank prints one ``RESULT {json}`` line; this process prints one table with a column per
rank for what differs between ranks, and a legend under it defining every column. Peaks and
step times are ratios to ``fsdp2 eager`` on the same rank in the same run. Not a test: it never
fails on times; the numbers go in the issue notes.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
WORLD = 2  # ranks unless --ranks says otherwise
COMPILE_BUDGET = 0.5
CKPT = "ckpt"  # --budgets: checkpoint_wrapper's measured peak on each rank
CHECKPOINTED = "fsdp2 + checkpoint_wrapper(units)"
MODELS = ("hf-llama", "hf-gpt2")


@dataclass
class Row:
    """One (model, method): lists hold one value per rank (index = rank)."""

    model: str
    method: str
    peak: list[int]                 # bytes, max over the measured steps
    peak_ratio: list[float]         # over fsdp2 eager's, same rank
    time_ratio: list[float]         # median step time over fsdp2 eager's, same rank
    grad_diff: float                # max abs over every parameter's first-step gradient, ranks
    same_losses: list[bool]         # every measured step's loss bitwise eager's
    setup_s: list[float]
    note: str = ""
    plan_s: list[float] = field(default_factory=list)  # ours: the driver's seconds
    peaks: list[list[int]] = field(default_factory=list)  # per rank, every measured step


# ---- one rank --------------------------------------------------------------------------------


def build(name: str, device: torch.device, layers: int = 4) -> tuple[nn.Module, nn.ModuleList]:
    """The model from its config (the same weights for every method) and its ``layers``
    decoder layers."""
    import transformers

    torch.manual_seed(0)
    if name == "hf-llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=128,
                                       num_attention_heads=4, num_key_value_heads=4,
                                       intermediate_size=344, vocab_size=1000,
                                       max_position_embeddings=128, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg).to(device)
        return model, model.model.layers
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=1000,
                                  n_positions=128, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    return model, model.transformer.h


def shard(model: nn.Module, layers: nn.ModuleList, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def collectives() -> Any:
    """:class:`Collectives` on ``torch.distributed`` (the default group)."""
    import torch.distributed as dist

    from integrations._remat_shared import Collectives

    def gathered(obj: Any) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return Collectives(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       broadcast=broadcast, all_true=lambda flag: all(gathered(bool(flag))),
                       all_max=lambda number: max(gathered(number)))


@dataclass
class Method:
    """One method on this rank: its model, optimizer, and what was measured."""

    name: str
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    context: Callable[[], Any] = contextlib.nullcontext
    peaks: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None
    setup_s: float = math.nan
    plan_s: float = math.nan
    step_s: float = math.nan
    note: str = ""


class Rank:
    """What every method shares on this rank: device, mesh, batches, the measured step."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.args = args
        if args.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            dist.init_process_group("nccl")
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(self.device.type, (self.world,))
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        # batch k of this rank (a rank of its own: different losses and gradients per rank)
        self.batches = [torch.randint(1000, (4, 64),
                                      generator=torch.Generator().manual_seed(100 * self.rank + k)
                                      ).to(self.device)
                        for k in range(args.steps)]

    def say(self, message: str) -> None:
        if self.rank == 0:
            print(f"remat_fsdp: {message}", file=sys.stderr, flush=True)

    def loss(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def measured_steps(self, m: Method, start: float) -> None:
        """``args.steps`` training steps, each forward + backward measured by
        ``remat.track_memory``; the first step's gradients kept (full tensors); ``setup_s``
        ends with the first step."""
        import remat

        opt = m.opt
        for k, ids in enumerate(self.batches):
            torch.manual_seed(1000 + k)  # the same dropout masks for every method at step k
            gc.collect()
            with m.context(), remat.track_memory(self.device) as mem:
                loss = self.loss(m.model, ids)
                loss.backward()
            if k == 0:
                self.sync()
                m.setup_s = time.perf_counter() - start
                m.grads = [p.grad.full_tensor().detach().clone() for p in m.model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.peaks.append(mem.peak_bytes)
            m.losses.append(loss.item())

    def run(self, model_name: str) -> list[dict]:
        """Every method on ``model_name``: set up and measured one after the other, then timed
        taking turns."""
        args = self.args
        methods: list[Method] = []

        def add(name: str, setup: Callable[[Method], None]) -> None:
            m = Method(name)
            methods.append(m)
            self.say(f"{model_name}: {name} ...")
            start = time.perf_counter()
            try:
                setup(m)
                m.opt = torch.optim.SGD(m.model.parameters(), lr=0.1)
                self.measured_steps(m, start)
            except Exception as e:  # noqa: BLE001 - printed in the note column instead
                if self.rank == 0:
                    traceback.print_exc()
                m.note = (f"{m.note}; " if m.note else "") + \
                    f"failed: {type(e).__name__}: {e}".replace("\n", " ")[:300]
                m.model = m.opt = None
                m.peaks, m.losses, m.grads = [], [], None

        def eager(m: Method) -> None:
            m.model = shard(*build(model_name, self.device, args.layers), self.mesh)

        def checkpointed(m: Method) -> None:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)

            model, layers = build(model_name, self.device, args.layers)
            for i in range(len(layers)):
                layers[i] = checkpoint_wrapper(layers[i],
                                               checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            m.model = shard(model, layers, self.mesh)

        def compiled(m: Method) -> None:
            model, layers = build(model_name, self.device, args.layers)
            for layer in layers:
                layer.compile(backend="aot_eager")
            m.context = lambda: torch._functorch.config.patch(
                activation_memory_budget=COMPILE_BUDGET)
            m.model = shard(model, layers, self.mesh)

        def ours(budget: str) -> Callable[[Method], None]:
            def setup(m: Method) -> None:
                m.model = shard(*build(model_name, self.device, args.layers), self.mesh)
                start = time.perf_counter()
                m.note = self.plan(m.model, at_checkpoint_peak(m.model) if budget == CKPT
                                   else f"{budget}%")
                m.plan_s = time.perf_counter() - start
            return setup

        def at_checkpoint_peak(model: nn.Module) -> str:
            # the trial step must leave the headroom for gloo's late buffers under the budget
            # (NOTE [ Buffers gloo's workers release late ]): given on top, the plans measure
            # at most checkpoint_wrapper's peak
            from integrations._fsdp import late_release_bytes

            peaks = next(m.peaks for m in methods if m.name == CHECKPOINTED)
            if not peaks:
                raise RuntimeError("checkpoint_wrapper did not run, so it has no peak to match")
            return f"{max(peaks) + late_release_bytes(model)}B"

        add("fsdp2 eager", eager)
        add(CHECKPOINTED, checkpointed)
        add(f"fsdp2 + compile(units, budget={COMPILE_BUDGET:g})", compiled)
        for b in args.budgets:
            add(method_name(b), ours(b))

        self.say(f"{model_name}: timing {args.time_steps} steps of each method, taking turns ...")
        self.time_steps([m for m in methods if m.model is not None])
        ref = methods[0]
        rows = []
        for m in methods:
            diff = math.nan
            if m.grads is not None and ref.grads is not None:
                diff = max(float((a - b).abs().max()) for a, b in zip(m.grads, ref.grads))
            rows.append({"model": model_name, "method": m.name, "peaks": m.peaks,
                         "losses": m.losses, "same_losses": bool(m.losses) and
                         m.losses == ref.losses, "grad_diff": diff, "setup_s": m.setup_s,
                         "step_s": m.step_s, "plan_s": m.plan_s, "note": m.note})
        for m in methods:  # FSDP state, compiled graphs, plans: not kept for the next model
            m.model = m.opt = m.grads = None
        torch._dynamo.reset()
        gc.collect()
        return rows

    def plan(self, model: nn.Module, budget: str) -> str:
        """Our driver on ``model`` for ``budget`` (of the step, or bytes), as the Accelerate
        plugin calls it on a model sharded by hand; returns the note (what it planned, or why it
        misses)."""
        import remat
        from integrations._fsdp import fsdp2_line, fsdp2_miss, rematerialize_fsdp2
        from integrations._remat_shared import check_settings
        from integrations._warmup import isolated_rng, preserved_state

        settings = check_settings(budget=budget, solver=self.args.solver,
                                  time_limit=self.args.time_limit, module=None, cache_dir=None,
                                  strict=True, verbose=False)
        ids = self.batches[0]

        def step(warmup: bool) -> int:
            with preserved_state(model), remat.track_memory(self.device) as mem:
                self.loss(model, ids).backward()
            return mem.peak_bytes

        with isolated_rng():  # NOTE [ A warmup step that leaves no trace ]
            planned, eager, _ = rematerialize_fsdp2(
                model, step, settings, remat.PlanCache(),  # in memory: the cache off
                comm=collectives(), owner="remat_fsdp")
        if self.rank == 0:
            print(fsdp2_line(planned, eager, owner="remat_fsdp"), file=sys.stderr, flush=True)
        share = planned.share
        note = (f"{share.checkpointed}/{len(planned.modules)} units "
                f"checkpointed, units at {100 * share.fraction:.0f}% of their step, trial "
                f"{planned.measured_step_bytes / max(eager, 1):.3f} of warmup, "
                f"{planned.rounds} round{'s' if planned.rounds > 1 else ''}")
        if not planned.fits:
            note += "; " + fsdp2_miss(planned, eager, owner="remat_fsdp")
        return note

    def time_steps(self, methods: list[Method]) -> None:
        """Median seconds of a training step (forward, backward, optimizer step) of each method,
        untracked, the methods taking turns step by step (the same machine load for all); the
        garbage collector off while timing, as in ``timeit``."""
        times: list[list[float]] = [[] for _ in methods]
        gc.collect()
        gc.disable()
        try:
            for k in range(self.args.time_steps):
                ids = self.batches[k % len(self.batches)]
                for m, t in zip(methods, times):
                    self.sync()
                    start = time.perf_counter()
                    with m.context():
                        self.loss(m.model, ids).backward()
                    m.opt.step()
                    m.opt.zero_grad(set_to_none=True)
                    self.sync()
                    t.append(time.perf_counter() - start)
        finally:
            gc.enable()
        for m, t in zip(methods, times):
            m.step_s = statistics.median(t)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if args.device == "cpu":
        torch.set_num_threads(1)
    rank = Rank(args)
    rows = []
    for model_name in args.models:
        rows += rank.run(model_name)
    result = {"rank": rank.rank, "world": rank.world, "torch": torch.__version__,
              "device": (torch.cuda.get_device_name(rank.device) if rank.device.type == "cuda"
                         else f"cpu threads={torch.get_num_threads()}"),
              "rows": rows}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: one line per rank
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


# ---- the launching process -------------------------------------------------------------------


def launch(argv: list[str], device: str, world: int = WORLD) -> dict[int, dict]:
    """This module under ``torchrun`` on ``world`` processes; each rank's ``RESULT`` by rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(world), "-m", "benchmarks.remat_fsdp", "--worker", *argv]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"remat_fsdp: the ranks failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}")
    # each rank writes its line at once, but torchrun's relay may join two on one line
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]]
    by_rank = {r["rank"]: r for r in results}
    if sorted(by_rank) != list(range(world)):
        raise RuntimeError(f"remat_fsdp: expected a RESULT from each of {world} ranks, got "
                           f"{sorted(by_rank)}:\n{proc.stdout[-4000:]}")
    return by_rank


def combine(by_rank: dict[int, dict]) -> list[Row]:
    """One row per (model, method), per-rank values side by side, ratios to the same rank's
    ``fsdp2 eager``."""
    ranks = sorted(by_rank)
    rows = []
    for k, first in enumerate(by_rank[ranks[0]]["rows"]):
        per = [by_rank[r]["rows"][k] for r in ranks]
        eager = [next(x for x in by_rank[r]["rows"]
                      if x["model"] == first["model"] and x["method"] == "fsdp2 eager")
                 for r in ranks]
        peak = [max(p["peaks"]) if p["peaks"] else 0 for p in per]
        eager_peak = [max(e["peaks"]) if e["peaks"] else 0 for e in eager]
        notes = [p["note"] for p in per]
        note = notes[0] if all(n == notes[0] for n in notes) else \
            " | ".join(f"rank {r}: {n}" for r, n in zip(ranks, notes) if n)
        plan_s = [p["plan_s"] for p in per]
        if not any(math.isnan(s) for s in plan_s):
            note = f"planning {max(plan_s):.1f} s; {note}"
        rows.append(Row(
            model=first["model"], method=first["method"], peak=peak,
            peak_ratio=[p / e if p and e else math.nan for p, e in zip(peak, eager_peak)],
            time_ratio=[p["step_s"] / e["step_s"] for p, e in zip(per, eager)],
            grad_diff=max(p["grad_diff"] for p in per), same_losses=[p["same_losses"]
                                                                     for p in per],
            setup_s=[p["setup_s"] for p in per], note=note, plan_s=plan_s,
            peaks=[p["peaks"] for p in per]))
    return rows


def method_name(budget: str) -> str:
    return "ours at checkpoint_wrapper's peak" if budget == CKPT else f"ours {budget}%"


def report(rows: list[Row], budgets: list[str]) -> str:
    """The table, then a legend that defines each column."""
    def num(x: float, spec: str) -> str:
        return "-" if math.isnan(x) else format(x, spec)

    width = max(len(r.method) for r in rows) + 2
    lines = [f"{'model':<10}{'method':<{width}}{'peak MiB r0/r1':>16}{'peak/eager r0/r1':>18}"
             f"{'time/eager r0/r1':>18}{'grad diff':>11}{'same loss':>11}{'setup s':>9}  note"]
    for r in rows:
        peaks = "/".join(f"{p / 2**20:.2f}" if p else "-" for p in r.peak)
        peak_ratio = "/".join(num(x, ".3f") for x in r.peak_ratio)
        time_ratio = "/".join(num(x, ".2f") for x in r.time_ratio)
        same = "/".join("yes" if s else "no" for s in r.same_losses)
        setup = num(max(r.setup_s), ".1f")
        lines.append(f"{r.model:<10}{r.method:<{width}}{peaks:>16}{peak_ratio:>18}"
                     f"{time_ratio:>18}{num(r.grad_diff, '.2e'):>11}{same:>11}{setup:>9}"
                     f"  {r.note}")
    ours = ", ".join(method_name(b) for b in budgets if b != CKPT) or "ours B%"
    lines += [
        "",
        "legend: r0/r1: rank 0's value / rank 1's (each rank trains on batches of its own, so "
        "peaks and times differ by rank)",
        "peak MiB:    max over the measured steps of the peak bytes one step allocates "
        "(forward + loss + backward, above",
        "             what was live before it: remat.track_memory, the CPU allocator's events "
        "or the CUDA allocator)",
        "peak/eager:  that peak over fsdp2 eager's on the same rank, this run",
        "time/eager:  median seconds of a training step (forward, backward, SGD step) over "
        "fsdp2 eager's on the same rank;",
        "             timed in untracked steps after the measured ones (the CPU profiler behind "
        "track_memory slows",
        "             steps), the methods taking turns step by step, so the first step after "
        "setup is never timed",
        "grad diff:   largest absolute difference of any parameter's gradient (full tensor: "
        "p.grad.full_tensor()) from",
        "             fsdp2 eager's on the first measured step, max over ranks",
        "same loss:   every measured step's loss bitwise equal to fsdp2 eager's on that rank "
        "(dropout: step k seeds 1000+k)",
        "setup s:     seconds from the unsharded model built until its first measured step "
        "ended, max over ranks (ours:",
        "             the driver's warmup step, unit captures, solves and trial steps; "
        "compile: the first call compiles)",
        "fsdp2 eager: fully_shard(each decoder layer), then fully_shard(model), unmodified",
        "fsdp2 + checkpoint_wrapper(units): each decoder layer wrapped by torch.distributed."
        "algorithms._checkpoint.",
        "             checkpoint_wrapper (CheckpointImpl.NO_REENTRANT) before fully_shard: "
        "full recompute per unit",
        f"fsdp2 + compile(units, budget={COMPILE_BUDGET:g}): each decoder layer "
        "layer.compile(backend='aot_eager') before fully_shard,",
        "             torch._functorch.config.activation_memory_budget="
        f"{COMPILE_BUDGET:g} around every step (its partitioner's budget)",
        f"{ours}: integrations._fsdp.rematerialize_fsdp2 (as the Lightning callback and the "
        "Accelerate plugin run it),",
        "             budget B% of the whole step on each rank as its warmup step measures it; "
        "the note says how the units",
        "             were planned (planning: the driver's seconds, max over ranks; units "
        "checkpointed: keep only their",
        "             inputs and run again in backward; units at F%: each unit's schedule at F% "
        "of its own step; trial:",
        "             the driver's last trial step over its warmup step; rounds: times it "
        "planned) or why it missed",
    ]
    if CKPT in budgets:
        lines += [
            "ours at checkpoint_wrapper's peak: the same, with a byte budget that lets its trial "
            "step measure up to the peak",
            "             checkpoint_wrapper measured on that rank in this run (on CPU plus the "
            "headroom it keeps for gloo)",
        ]
    if any(r.model == "hf-gpt2" for r in rows):
        lines.append("hf-gpt2 has dropout 0.1 (GPT2Config's default): a method that draws new "
                     "masks when it recomputes has other losses and gradients")
    return "\n".join(lines)


def _budget(text: str) -> str:
    """A percent of the step (checked as ``budget=`` checks it) or ``ckpt``."""
    if text == CKPT:
        return text
    from remat.budget import parse_budget

    percent = text.rstrip("%")
    try:
        parse_budget(f"{percent}%")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (or {CKPT!r}: checkpoint_wrapper's peak)")
    return f"{float(percent):g}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--budgets", type=_budget, nargs="+", default=["50", "30", CKPT],
                        help="ours: percent of the whole step, or 'ckpt': checkpoint_wrapper's "
                             "measured peak")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers (FSDP units); with more, lower budgets are reachable")
    parser.add_argument("--steps", type=int, default=4, help="measured steps of each method")
    parser.add_argument("--time-steps", type=int, default=8,
                        help="timed steps of each method (taking turns)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--solver", default=None, help="ours: the solver (default remat's)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="hf-llama, budget 50, 3 steps")
    parser.add_argument("--ranks", type=int, default=WORLD,
                        help="ranks (default 2; 1 shards over one process, e.g. one GPU)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks {args.ranks}: expected a number of ranks >= 1, e.g. --ranks 1 on "
                     "one GPU")
    if args.quick:
        args.model, args.budgets, args.steps, args.time_steps = "hf-llama", ["50"], 3, 3
    args.models = list(MODELS) if args.model == "both" else [args.model]
    if args.solver is None:
        import remat

        args.solver = remat.DEFAULT_SOLVER
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        worker(args)
        return []
    start = time.perf_counter()
    by_rank = launch([a for a in argv if a != "--worker"], args.device, args.ranks)
    rows = combine(by_rank)
    info = by_rank[0]
    print(f"remat_fsdp: models={','.join(args.models)} FSDP2 on {info['world']} ranks "
          f"({'NCCL' if args.device == 'cuda' else 'gloo'}) torch={info['torch']} "
          f"{args.device} {info['device']} layers={args.layers} batch=(4, 64) "
          f"measured steps={args.steps} timed steps={args.time_steps} solver={args.solver} "
          f"(wall {time.perf_counter() - start:.0f} s)")
    print(report(rows, args.budgets))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
