"""Time per op: measured on the real batch, or modelled from FLOPs and bytes.

NOTE [ Measuring op times ]
We run the joint graph node by node on the real inputs (an FX interpreter), time each node and
take the fastest of a few repeats (the first run warms caches and is discarded; NOTE [ The
fastest sample is the op's price ]), pooled over
every op that does the same work (NOTE [ Ops that do the same work cost the same ]), leaving
out the samples that paid page faults (NOTE [ Page faults are not an op's cost ]). Values are
freed after their last use so profiling needs no more memory than the unmodified step. The run
happens inside ``torch.random.fork_rng`` and under ``no_grad``, never writes to an input, and
returns nothing, so it changes no user state (parameters, buffers, RNG streams).
When real inputs are not available we fall back to a roofline model: FLOPs from
``torch.utils.flop_counter``'s formulas over the fake-tensor shapes, and bytes read + written.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

import torch
import torch.fx as fx

from .lowering import Lowered
from .symbolic import hint

__all__ = ["OpCosts", "machine_tag", "measure_op_times", "model_op_times"]

log = logging.getLogger(__name__)

# Roofline constants for the modelled fallback (a laptop-class CPU core pair). Only the ratios
# between ops matter to the solvers; absolute times only scale `predicted_overhead`'s seconds.
_FLOPS_PER_S = 5.0e10
_BYTES_PER_S = 1.0e10
_OP_OVERHEAD_S = 5.0e-6


def _materialize(val: object) -> object:
    """A real value for a fake one: ones (floats) or zeros (integers, which index anything),
    with the fake tensor's strides, so an op reads it as it reads the real one."""
    if isinstance(val, torch.Tensor):
        shape = [hint(d) for d in val.shape]
        try:
            stride = [hint(d) for d in val.stride()]
            out = torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
        except (RuntimeError, TypeError):  # a layout without strides
            out = torch.empty(shape, dtype=val.dtype, device=val.device)
        return out.fill_(1) if val.is_floating_point() else out.zero_()
    if isinstance(val, torch.SymInt):
        return hint(val)
    return val


class OpCosts(NamedTuple):
    """What profiling measured, per op of the lowered graph."""

    times: list[float]  # seconds, as the unmodified step runs it
    workspaces: list[int]  # scratch bytes beyond its outputs
    rerun_times: list[float]  # seconds when run again at once (NOTE [ What a recomputation costs ])
    # False when scratch memory could not be measured (NOTE [ Capturing inside a profiler ]) or
    # only memory was (``repeats=0``): such costs are not kept for another run (NOTE [ Costs
    # measured once ] in :mod:`remat.cache`).
    complete: bool = True


def machine_tag(tensors: Sequence[object]) -> str:
    """What measured costs depend on beyond the graph: the device (its model), the threads and
    the PyTorch build (NOTE [ Costs measured once ] in :mod:`remat.cache`)."""
    cuda = _cuda_device(tensors)
    if cuda is not None:
        where = f"cuda:{torch.cuda.get_device_name(cuda)}"
    else:
        where = f"cpu:{_cpu_model()}|threads={torch.get_num_threads()}"
    return f"{where}|torch={torch.__version__}"


def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_op_times(
    lowered: Lowered, joint: fx.GraphModule, primals: Sequence[torch.Tensor], *, repeats: int = 2,
    alone: bool = False,
) -> OpCosts:
    """Wall time (the fastest sample) and scratch memory of every op of ``lowered.graph`` on the real inputs.

    Args:
        lowered: The lowered joint graph.
        joint: The joint graph module.
        primals: Real tensors for the joint graph's ``primals_*`` placeholders, in order.
        repeats: Timed runs (0: scratch memory only, every time 0); the fastest is kept,
            over the samples of every op doing the same
            work (NOTE [ Ops that do the same work cost the same ]). A first, untimed run under
            the memory profiler warms caches and measures each op's workspace (bytes it
            allocates beyond its outputs, freed before it returns: see NOTE [ Measuring memory
            on CPU ]).
        alone: Run each op on its own, on inputs made for it, instead of the unmodified step
            (NOTE [ Measuring ops one at a time ]).

    Returns:
        Seconds, workspace bytes and seconds when re-run of every op, indexed like
        ``lowered.graph.ops``.
    """
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    nodes = list(joint.graph.nodes)
    primal_nodes = [n for n in nodes if n.op == "placeholder" and n.name.startswith("primals")]
    if len(primal_nodes) != len(primals):
        raise ValueError(f"expected {len(primal_nodes)} primal tensors, got {len(primals)}")
    primal_index = {n: k for k, n in enumerate(primal_nodes)}
    last_use: dict[fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = index
    op_index = {node: i for i, node in enumerate(lowered.op_nodes)}
    samples: list[list[float]] = [[] for _ in lowered.op_nodes]
    faults: list[list[int]] = [[] for _ in lowered.op_nodes]  # page faults during each sample
    reruns: list[list[float]] = [[] for _ in lowered.op_nodes]  # NOTE [ What a recomputation costs ]
    rerun_faults: list[list[int]] = [[] for _ in lowered.op_nodes]
    keys: list[object] = [None] * len(lowered.op_nodes)
    workspaces = [0] * len(lowered.op_nodes)

    def run_graph(on_node) -> None:
        env: dict[fx.Node, object] = {}
        for index, node in enumerate(nodes):
            if node.op == "placeholder":
                env[node] = primals[primal_index[node]] if node in primal_index \
                    else _materialize(node.meta.get("val"))
            elif node.op == "get_attr":
                env[node] = getattr(joint, str(node.target))
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = on_node(node, args, kwargs)
            for arg in node.all_input_nodes:
                if last_use.get(arg) == index and arg.op != "placeholder":
                    env.pop(arg, None)

    def run_alone(on_node) -> None:
        # NOTE [ Measuring ops one at a time ]
        for node in lowered.op_nodes:
            def value(n: fx.Node) -> object:
                if n in primal_index:
                    return primals[primal_index[n]]
                if n.op == "get_attr":
                    return getattr(joint, str(n.target))
                return _materialize(n.meta.get("val"))

            args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
            on_node(node, args, kwargs)
            del args, kwargs

    run = run_alone if alone else run_graph

    # NOTE [ Timing outside the tracer's dispatch ]: we are called while AOTAutograd traces,
    # with its fake mode and the Python dispatcher on. Left on, the dispatcher added ~18 us to
    # every op (a ``select`` timed 23 us, 4 us in a training step): a Mamba-style scan's 6,477
    # tiny ops summed to 150-250 ms for a 47 ms eager step, and views, free at run time, looked
    # as costly as multiplications to the solvers. Ops are timed as the step will run them.
    with unset_fake_temporarily(), no_python_dispatcher(), torch.no_grad(), \
            torch.random.fork_rng(devices=[]):
        cuda = _cuda_device(primals)
        names = {node.name: i for node, i in op_index.items()}
        complete = repeats > 0
        if cuda is not None:  # NOTE [ Measuring ops on CUDA ]
            workspaces = _cuda_workspaces(run, names, len(workspaces), cuda)
        elif torch._C._autograd._profiler_enabled():
            # NOTE [ Capturing inside a profiler ]: a second profiler session would end the one
            # running (``track_memory`` around a capture would read 0): scratch memory is not
            # measured then, only the outputs nobody reads (counted at lowering).
            log.warning("remat: a torch.profiler session is running (e.g. track_memory around "
                        "the capture): op scratch memory is not measured; the predicted peak may "
                        "be a little low. Capture outside the profiler for exact predictions.")
            run(lambda node, args, kwargs: node.target(*args, **kwargs))  # warm-up
            complete = False
        else:
            workspaces = _cpu_workspaces(run, names, len(workspaces))

        # On CUDA kernels are asynchronous: CUDA events instead of the wall clock.
        if cuda is None:
            values = lowered.graph.values
            may_fault = [sum(values[v].nbytes for v in op.outputs) >= _FAULT_BYTES
                         for op in lowered.graph.ops]
            rerun = [k < lowered.graph.num_forward and op.recomputable
                     for k, op in enumerate(lowered.graph.ops)]
            timed = _wall_timer(op_index, samples, faults, may_fault, rerun, reruns, rerun_faults)
        else:
            timed = _cuda_timer(op_index, samples)
        for repeat in range(repeats):
            wanted = None if repeat == 0 else _undersampled(keys, (samples, faults),
                                                            (reruns, rerun_faults))
            if wanted is not None and not any(wanted):
                break  # NOTE [ Enough samples ]
            run(_keying(op_index, keys, timed if wanted is None else
                        _timing_only(op_index, wanted, timed)))
    times = _pooled_prices(samples, keys, faults)
    rerun_times = _pooled_prices(reruns, keys, rerun_faults)
    # an op never re-run (backward, random, on CUDA) costs its own time if it ever is
    return OpCosts(times, workspaces, [r if ran else t for r, t, ran in
                                       zip(rerun_times, times, map(bool, reruns))], complete)


# NOTE [ Measuring ops one at a time ]
# Measuring runs the unmodified step, whose peak is the memory the budget is there to avoid. At
# setup that is the user's example; inside a training step it was the out-of-memory error the
# user came to avoid: a batch of size 1 (dynamo's own graph) of a 4-layer GPT-2 peaked at
# 91.6 MiB under a 48 MiB budget, over the eager step's 84.6 MiB, and a Lightning run whose first
# batch ran eagerly peaked at 1.48-1.57x its "3MiB"/"4MiB" budget in the step that captured the
# next one. There each op runs on its own instead (``alone=True``): on the call's own inputs and
# parameters, and on ones (floats) or zeros (integers) with the fake value's shape and strides
# for everything computed, freed after the op. That needs one op's inputs, outputs and scratch at
# a time, and measures what the step needs, at its sizes: the times, and the scratch memory that
# the roofline model cannot know (SDPA's backward on CPU: 190 KiB of a 4.5 MiB step; without
# it a schedule planned on modelled costs measured 1.007-1.022x its budget). Pricing from the
# ops of an earlier size family was tried first: right for time, but no help to a first capture.


# NOTE [ Ops that do the same work cost the same ]
# On a shared machine one op's few samples vary by tens of percent (a 6-layer GPT's ops summed
# to 210 ms in one capture and 296 ms in the next), so identical layers got different prices,
# and two captures of one model gave two plans (24-layer GPT at 33%: 547 or 723 ops
# recomputed, +11.5% / +11.3% predicted). An op's time is a function of what it computes: its
# target, its arguments' shapes, strides and dtypes, and its constants. So ops with the same
# such key share one price, the fastest of all their samples: 72 samples for each op of a
# 24-layer GPT's layers instead of 3, the same price for every layer, and the same answer to
# "recompute this op here or in the next layer". Strides are part of the key (a matmul reading
# a transposed operand is another kernel); an argument of any other type makes the op its own.


def _work_key(target: object, args: tuple, kwargs: dict) -> object:
    """What an op's time depends on (NOTE [ Ops that do the same work cost the same ])."""
    def describe(a: object) -> object:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.stride(), a.dtype, a.device.type)
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device,
                                       torch.layout, torch.memory_format)):
            return a
        return ("object", id(a))  # unknown: never pooled with another op

    return (target, describe(args), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _keying(op_index: dict, keys: list[object], timed):
    """``timed``, first noting each op's work key from its real arguments."""

    def run(node, args, kwargs):
        k = op_index.get(node)
        if k is not None and keys[k] is None:
            keys[k] = _work_key(node.target, args, kwargs)
        return timed(node, args, kwargs)

    return run


# NOTE [ Page faults are not an op's cost ]
# On CPU an op that writes its output to memory the process has not touched before pays a page
# fault per 4 KiB page (the kernel maps and zeroes it): glibc hands big blocks back to the system
# when they are freed (``munmap``, or trimming the heap's top), so the next step faults them in
# again. Whether an op's sample paid that depends on the allocator's state, not on the op: a
# 12-layer MLP's ``gelu`` on 2 MiB took 262 us without faults and 780 us with its 512 faults,
# and more than half of its profile's samples faulted in one process and fewer in the next, so
# the same model's ops summed to 65-78 ms and its plans predicted +8% or +15% step time from one
# run to the next. A schedule does not choose these faults either: its lower peak usually
# reuses memory instead (the MLP's remat step faulted 0 times where the eager step faulted
# ~5,000 times, 512 per 2 MiB tensor). So an op's price is the fastest of its work key's samples
# that paid no fault; the faulting ones count only when no sample ran fault-free. Measured with
# glibc told to keep its memory (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``: no fault
# in any step, as with CUDA's caching allocator), the MLP's predicted recomputation is then
# within 2 points of the measured one. On CUDA there is nothing to count (the caching allocator).
# Only ops with large outputs are watched (``_FAULT_BYTES``).


# NOTE [ What a recomputation costs ]
# An op's profiled time is what it costs in the unmodified step, where its inputs were written
# a while before and its output goes to memory nothing touched lately. A recomputation in
# backward runs in cache: its output lands in memory backward has just freed, and its inputs
# are often values recomputed just before. There it costs less. On a 12-layer GPT at 50%
# (2 cores) the ops recomputed summed to 14.0 ms of profiled time, +7.8% of the step, but the
# step ran 6-7 ms (+3.3-3.9%) longer than the same captured graph without recomputation
# (``solver="none"``): 35 ``_to_copy``s of dropout masks to float, 59 us each as profiled,
# added 0.3 ms in all under the profiler; the same ``bmm`` took 144 us cold and 92 us re-run.
# So each recomputable forward op also runs a second time right after the first (the first
# result freed first, so the second lands in its memory), and that time is its
# ``Op.rerun_time``: the recomputation's price, for the simulator and the solvers, while
# ``Op.time`` stays the op's share of the unmodified step. The GPT-12's prediction became
# 9.6 ms (+5.4%) for 7.4 ms (+3.9%) measured. On CUDA, where kernels stream from device memory
# and nothing is re-run, the two are the same.


# Faults are counted around ops whose outputs take at least this many bytes: reading the
# counter is a system call, which made the next op slower (a Mamba-style scan's 6,477 small ops
# summed to 57-60 ms with a count around each, 53-54 ms without), and an output smaller than
# this lands on few fresh pages (64 here, ~64 us at most) even when it does.
_FAULT_BYTES = 256 * 1024


# NOTE [ The fastest sample is the op's price ]
# A busy neighbour only ever adds time to a sample (the op waits for a core, or one of its two
# intra-op threads does), never takes any away, so the fastest sample of an op's work key is
# what the op costs, and it moves far less with the load than the median: three fresh captures
# of a 4-layer GPT-2 at 50% beside two busy processes predicted +15.3%, +16.8% and +35.3%
# overhead with medians (three schedules), +10.9%, +10.6% and +6.1% with the fastest samples
# (two of the three the same schedule). Pooling (NOTE [ Ops that do the same work cost the
# same ]) gives most ops dozens of samples to take it from. What is left of the noise is
# absorbed by the plan cache (NOTE [ The same plan every run ] in ``remat/cache.py``).


# NOTE [ Enough samples ]
# Every repeat ran the whole step op by op, each recomputable forward op twice (NOTE [ What a
# recomputation costs ]): three repeats of a 4-layer GPT took 2.7 s of a 12 s setup whose step
# runs in 0.3 s. Pooling gives an op of a repeated layer one sample per layer and repeat, so
# after a repeat or two its work key has the samples its fastest one needs; only the ops short
# of ``_ENOUGH_SAMPLES`` clean samples (the embedding and the loss head, in a single copy) are
# timed again, the others just run to compute what the next ops read. Repeats stop once every
# key has enough, and after two at most: the third gave only the single-copy ops a third sample,
# for 0.65 s of the GPT's 2.7 s of measuring, and its plans predicted +5.8-6.6% recomputation
# with two repeats as with three (three fresh captures each, one graph).
_ENOUGH_SAMPLES = 8


def _undersampled(keys: list[object], *measured: tuple[list[list[float]], list[list[int]]]
                  ) -> list[bool]:
    """Per op: whether its work key has fewer than ``_ENOUGH_SAMPLES`` fault-free samples in
    any of ``measured`` (times, page faults) pairs that time it at all."""
    groups = [key if key is not None else ("op", k) for k, key in enumerate(keys)]
    short: set[object] = set()
    for samples, faults in measured:
        count: dict[object, int] = {}
        timed: set[object] = set()
        for k, group in enumerate(groups):
            if samples[k]:
                timed.add(group)
            counts = faults[k] or [0] * len(samples[k])  # none counted on CUDA
            count[group] = count.get(group, 0) + sum(1 for f in counts if f == 0)
        short.update(g for g in timed if count[g] < _ENOUGH_SAMPLES)
    return [group in short for group in groups]


def _timing_only(op_index: dict, wanted: list[bool], timed):
    """``timed`` for the ops ``wanted``; the others run untimed (NOTE [ Enough samples ])."""

    def run(node, args, kwargs):
        k = op_index.get(node)
        if k is not None and wanted[k]:
            return timed(node, args, kwargs)
        return node.target(*args, **kwargs)

    return run


def _pooled_prices(samples: list[list[float]], keys: list[object],
                   faults: list[list[int]] | None = None) -> list[float]:
    """Per op, the fastest sample of every op with its work key (NOTE [ The fastest sample is
    the op's price ]), of those that paid no page fault where any did not (NOTE [ Page faults
    are not an op's cost ])."""
    groups = [key if key is not None else ("op", k) for k, key in enumerate(keys)]
    clean: dict[object, list[float]] = {}
    every: dict[object, list[float]] = {}
    for k, group in enumerate(groups):
        every.setdefault(group, []).extend(samples[k])
        counts = faults[k] if faults is not None and faults[k] else [0] * len(samples[k])
        clean.setdefault(group, []).extend(s for s, f in zip(samples[k], counts) if f == 0)
    chosen = [clean[group] or every[group] for group in groups]
    return [min(c) if c else 0.0 for c in chosen]


def _cpu_workspaces(run_graph, op_index: dict[str, int], count: int) -> list[int]:
    """Run the graph once under the memory profiler; per op, the peak of bytes it allocated
    above what it returns (freed scratch), from the allocator events inside its time window."""
    from .memory import _cpu_allocation_events, _memory_profile, _quiet_unknown_frees

    # Each op runs inside a named record_function scope; its allocation events are those whose
    # timestamps fall inside the scope's window (both on the profiler's clock). The session's
    # frees of blocks older than it are not ours to report: NOTE [ Frees the profiler cannot size ].
    with _quiet_unknown_frees(), _memory_profile() as prof:
        run_graph(_scoped)
    windows = _record_windows(prof)
    events = _cpu_allocation_events(prof)
    result = [0] * count
    cursor = 0
    for name, begin, end in windows:
        node_op = op_index.get(name)
        live: dict[int, int] = {}
        current = peak = 0
        while cursor < len(events) and events[cursor][0] < begin:
            cursor += 1
        k = cursor
        while k < len(events) and events[k][0] <= end:
            _, ptr, size = events[k]
            if size > 0:
                live[ptr] = size
                current += size
                peak = max(peak, current)
            elif ptr in live:
                current -= live.pop(ptr)
            k += 1
        if node_op is not None:
            result[node_op] = max(0, peak - current)
    return result


_SCOPE = "remat::"


def _scoped(node: fx.Node, args, kwargs):
    with torch.profiler.record_function(_SCOPE + node.name):
        return node.target(*args, **kwargs)


def _record_windows(prof) -> list[tuple[object, int, int]]:
    results = prof.profiler.kineto_results
    windows = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name.startswith(_SCOPE):
            windows.append((node.name[len(_SCOPE):], node.start_time_ns, node.end_time_ns))
    windows.sort(key=lambda w: w[1])
    return windows


# NOTE [ Measuring ops on CUDA ]
# Kernels run asynchronously, so wall time around a call measures the launch. Each op is timed
# with a pair of CUDA events on the current stream (synchronised before the next op, so ops do not
# overlap as they would not in the simulator). Scratch memory comes from the caching allocator's
# counters: the peak is reset before the op (``memory.reset_cuda_peak``, which an open
# ``track_memory`` block survives) and the op's workspace is its peak minus what it leaves
# allocated, its outputs (exact: the counters count tensor bytes, not cached blocks).


def _cuda_device(tensors: Sequence[object]) -> torch.device | None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device if t.device.index is not None else \
                torch.device("cuda", torch.cuda.current_device())
    return None


def _cuda_workspaces(run_graph, op_index: dict[str, int], count: int,
                     device: torch.device) -> list[int]:
    """One warm-up run of the graph, measuring each op's scratch bytes on the allocator."""
    from .memory import reset_cuda_peak

    result = [0] * count

    def measured(node, args, kwargs):
        torch.cuda.synchronize(device)
        reset_cuda_peak(device)
        out = node.target(*args, **kwargs)
        torch.cuda.synchronize(device)
        k = op_index.get(node.name)
        if k is not None:
            peak = torch.cuda.max_memory_allocated(device)
            result[k] = max(0, peak - torch.cuda.memory_allocated(device))
        return out

    run_graph(measured)
    return result


def _wall_timer(op_index: dict, samples: list[list[float]], faults: list[list[int]],
                may_fault: list[bool], rerun: list[bool], reruns: list[list[float]],
                rerun_faults: list[list[int]]):
    """An FX-node callback timing each op with the wall clock (CPU ops run synchronously), and
    counting the page faults during the ops that ``may_fault`` (NOTE [ Page faults are not an
    op's cost ]; the others count none). The ops marked ``rerun`` run a second time at once,
    timed into ``reruns`` (NOTE [ What a recomputation costs ])."""
    page_faults = _page_fault_counter()

    def call(node, args, kwargs, counted):
        before = page_faults() if counted else 0
        start = time.perf_counter()
        out = node.target(*args, **kwargs)
        elapsed = time.perf_counter() - start
        return out, elapsed, (page_faults() - before if counted else 0)

    def timed(node, args, kwargs):
        k = op_index.get(node)
        counted = k is not None and may_fault[k]
        out, elapsed, faulted = call(node, args, kwargs, counted)
        if k is not None:
            samples[k].append(elapsed)
            faults[k].append(faulted)
            if rerun[k]:
                # the first result freed first: the second lands in its (hot) memory, as a
                # recomputation's output lands in memory backward has just freed
                del out
                out, elapsed, faulted = call(node, args, kwargs, counted)
                reruns[k].append(elapsed)
                rerun_faults[k].append(faulted)
        return out

    return timed


def _page_fault_counter():
    """The process's minor page faults so far (all threads: an op's intra-op workers fault
    too), or a constant 0 where ``getrusage`` does not exist (Windows)."""
    try:
        import resource
    except ImportError:
        return lambda: 0
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cuda_timer(op_index: dict, samples: list[list[float]]):
    """An FX-node callback timing each op with CUDA events (NOTE [ Measuring ops on CUDA ])."""

    def timed(node, args, kwargs):
        if node not in op_index:
            return node.target(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = node.target(*args, **kwargs)
        end.record()
        end.synchronize()
        samples[op_index[node]].append(start.elapsed_time(end) / 1000.0)
        return out

    return timed


def model_op_times(lowered: Lowered) -> list[float]:
    """Roofline estimate of every op's time from fake-tensor shapes (no execution)."""
    from torch.utils.flop_counter import flop_registry

    times = []
    for node in lowered.op_nodes:
        flops = 0
        target = getattr(node.target, "overloadpacket", None)
        formula = flop_registry.get(target)
        if formula is not None:
            try:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
                out = node.meta.get("val")
                flops = hint(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula that cannot read fake args: bytes only
                log.debug("no FLOP count for %s", node.name)
        nbytes = 0
        for n in [*node.all_input_nodes, node]:
            val = n.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else [val]
            nbytes += sum(hint(v.numel()) * v.element_size() for v in vals if isinstance(v, torch.Tensor))
        times.append(max(flops / _FLOPS_PER_S, nbytes / _BYTES_PER_S) + _OP_OVERHEAD_S)
    return times
