"""Measure the memory a piece of code allocates: ``with track_memory() as m: ...; m.peak_bytes``.

NOTE [ Measuring memory on CPU ]
PyTorch has no allocator statistics for CPU. A ``TorchDispatchMode`` that tracks live storages
is exact for eager code, but it does not see the kernels that run inside a compiled/AOT region
(and an active non-infra mode makes dynamo skip frames), so it cannot verify what remat does.
The CPU allocator's own events, recorded by ``torch.profiler`` with ``profile_memory=True``,
see every allocation and free (one event per storage, compiled graphs included). We replay
those events in time order and keep the running maximum of the live total. On CUDA we use the
caching allocator's exact counters (``torch.cuda.max_memory_allocated``).

The peak is relative to the memory that was live when the context was entered: storages that
existed before are not counted, storages allocated inside and still alive at exit are.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["MemoryTracker", "open_tracker", "track_memory"]


@dataclass
class MemoryTracker:
    """Result of :func:`track_memory`; the fields are filled when the context exits.

    Attributes:
        device: ``"cpu"`` or a CUDA device string.
        peak_bytes: Peak of live bytes allocated inside the context (above the level at entry).
        end_bytes: Bytes allocated inside and still live at exit.
        num_events: Allocation and free events seen (CPU only; 0 on CUDA).
        marks: Live bytes (above the level at entry) at each :meth:`mark`, in call order.
        peaks: The peak (above the level at entry) of each stretch the marks cut the block
            into: before the first mark, between each mark and the next, after the last (one
            more than ``marks``; ``[peak_bytes]`` without marks). Their maximum is
            ``peak_bytes``.
    """

    device: str
    peak_bytes: int = 0
    end_bytes: int = 0
    num_events: int = 0
    marks: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    _done: bool = field(default=False, repr=False)
    _start: int = field(default=0, repr=False)
    _cuda_floor: int = field(default=0, repr=False)
    _cuda_stretch_floor: int = field(default=0, repr=False)
    _cuda_device: torch.device | None = field(default=None, repr=False)
    _sentinels: list[torch.Tensor] = field(default_factory=list, repr=False)

    def mark(self) -> int:
        """Note the live bytes at this point of the block and end a stretch of ``peaks`` here
        (read both after the block exits); returns this mark's index in ``marks``.

        On CPU the point is a one-element sentinel storage kept alive to the end of the block,
        found again among the allocator's events; it is left out of every figure.
        """
        if self._done:
            raise RuntimeError("MemoryTracker.mark(): the track_memory() block has already exited")
        index = len(self._sentinels) + len(self.marks)  # one of them is empty until the exit
        if self.device.startswith("cuda"):
            device = self._cuda_device
            self.marks.append(torch.cuda.memory_allocated(device) - self._start)
            self.peaks.append(self._cuda_stretch_peak(device))
            reset_cuda_peak(device)  # the next stretch starts here; the block's peak is kept
            self._cuda_stretch_floor = 0
        else:
            self._sentinels.append(torch.empty(1))
        return index

    def _cuda_stretch_peak(self, device: torch.device) -> int:
        return max(torch.cuda.max_memory_allocated(device), self._cuda_stretch_floor) - self._start


def open_tracker() -> MemoryTracker | None:
    """The innermost :func:`track_memory` block open now (``None``: none is): code that runs
    inside a measured block without holding its tracker (a hook) marks it through this."""
    return _OPEN[-1] if _OPEN else None


@contextlib.contextmanager
def track_memory(device: str | torch.device = "cpu") -> Iterator[MemoryTracker]:
    """Measure the peak of live tensor-storage bytes allocated inside the ``with`` block.

    Each storage is counted once (views share their base's bytes), compiled and AOT-generated
    graphs included. See NOTE [ Measuring memory on CPU ].

    Args:
        device: ``"cpu"`` (default) or a CUDA device. On CUDA the caching allocator's peak is
            used, measured relative to the allocated bytes at entry.

    Yields:
        A :class:`MemoryTracker` whose ``peak_bytes`` / ``end_bytes`` are set on exit.

    Raises:
        RuntimeError: on CPU, when a ``torch.profiler`` session is already active, or when one
            started inside the block ended the measuring session (the result would be 0).
            A ``remat`` capture inside the block is fine (it does not start a profiler then).

    Example:
        >>> with track_memory() as mem:
        ...     y = torch.ones(1024, 1024)
        >>> mem.peak_bytes
        4194304
    """
    dev = torch.device(device)
    tracker = MemoryTracker(device=str(dev))
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(dev)
        start = tracker._start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        tracker._cuda_device = dev
        _OPEN.append(tracker)
        try:
            yield tracker
        finally:
            _OPEN.remove(tracker)
            torch.cuda.synchronize(dev)
            tracker.peaks.append(tracker._cuda_stretch_peak(dev))
            peak = max(torch.cuda.max_memory_allocated(dev), tracker._cuda_floor)
            tracker.peak_bytes = peak - start
            tracker.end_bytes = torch.cuda.memory_allocated(dev) - start
            tracker._done = True
        return
    if dev.type != "cpu":
        raise ValueError(
            f"track_memory(device={device!r}): only 'cpu' and CUDA devices are supported; "
            "pass device='cpu' or device='cuda'"
        )
    if torch._C._autograd._profiler_enabled():
        raise RuntimeError(
            "track_memory() on CPU needs the PyTorch profiler, and another torch.profiler session "
            "is already running (nested sessions record nothing). Measure outside that session, "
            "or on CUDA use track_memory('cuda')."
        )
    with _quiet_unknown_frees():  # NOTE [ Frees the profiler cannot size ]
        prof = _memory_profile()
        prof.__enter__()
        _OPEN.append(tracker)
        try:
            yield tracker
        finally:
            _OPEN.remove(tracker)
            still_ours = torch._C._autograd._profiler_enabled()
            if still_ours:
                prof.__exit__(None, None, None)
            events = _cpu_allocation_events(prof) if still_ours else []
            if not still_ours:
                # Never a silent 0: someone ended our session (a profiler started and stopped
                # inside the block), so the allocations are unknown.
                raise RuntimeError(
                    "track_memory(): another torch.profiler session was started and stopped "
                    "inside the block, which ended the one measuring memory, so nothing was "
                    "recorded. Start other profilers outside track_memory(), or measure on CUDA.")
            # Each sentinel is alive to the end, so its allocation is the last at its address.
            sentinel_at, sentinels = {}, {t.data_ptr() for t in tracker._sentinels}
            for i, (_, ptr, size) in enumerate(events):
                if size > 0 and ptr in sentinels:
                    sentinel_at[ptr] = i
            at_index = {i: ptr for ptr, i in sentinel_at.items()}
            mark_bytes: dict[int, tuple[int, int]] = {}  # sentinel -> (live, stretch's peak)
            live: dict[int, int] = {}
            current = peak = stretch = 0
            for i, (_, ptr, size) in enumerate(events):
                if i in at_index:
                    mark_bytes[ptr] = current, stretch
                    stretch = current
                    continue
                if size > 0:
                    live[ptr] = size
                    current += size
                    peak, stretch = max(peak, current), max(stretch, current)
                elif ptr in live:  # frees of storages allocated before entry do not count
                    current -= live.pop(ptr)
            tracker.peak_bytes, tracker.end_bytes = peak, current
            found = [mark_bytes.get(t.data_ptr(), (0, 0)) for t in tracker._sentinels]
            tracker.marks = [at for at, _ in found]
            tracker.peaks = [before for _, before in found] + [stretch]
            tracker._sentinels.clear()
            tracker.num_events = len(events)
            tracker._done = True


# Every tracker open now, innermost last: see :func:`open_tracker` and :func:`reset_cuda_peak`.
_OPEN: list[MemoryTracker] = []


def reset_cuda_peak(device: torch.device) -> None:
    """``torch.cuda.reset_peak_memory_stats`` that open :func:`track_memory` blocks survive.

    The caching allocator has one peak counter per device; a reset inside a ``track_memory``
    block (remat's op profiling resets it around every op) would lose the block's peak. The
    peak so far is kept as each open tracker's floor first.
    """
    peak = torch.cuda.max_memory_allocated(device)
    for tracker in _OPEN:
        if tracker._cuda_device == device:
            tracker._cuda_floor = max(tracker._cuda_floor, peak)
            tracker._cuda_stretch_floor = max(tracker._cuda_stretch_floor, peak)
    torch.cuda.reset_peak_memory_stats(device)


# NOTE [ Frees the profiler cannot size ]
# With ``profile_memory=True`` the CPU allocator notes each block's size when it is allocated, to
# report its free. A block allocated before the session started and freed inside it (the previous
# step's gradients, freed by ``zero_grad``; a batch the loop lets go of: every measured training
# step frees some) has no size there, and c10 logs, at the first such free in the process and
# every 1000th after, ``[W... CPUAllocator.cpp:245] Memory block of unknown size was allocated
# before the profiling started, profiler results will not include the deallocation event``.
# For us the line says nothing: those frees are what ``track_memory`` leaves out by design
# (storages live at entry are not counted). No profiler option turns the check off, and nothing
# can keep a free out of the session. ``TORCH_CPP_LOG_LEVEL=ERROR`` hides it, but torch reads it
# once, when it loads, and it then hides every C++ warning of the process for its whole life.
# So while one of our sessions runs, and only then, c10's log threshold (``FLAGS_caffe2_log_level``,
# the variable that ``TORCH_CPP_LOG_LEVEL`` sets) goes from WARNING to ERROR and back after: C++
# ``LOG(WARNING)`` lines logged by any thread inside a measured block are not shown (``TORCH_WARN``
# reaches Python's ``warnings`` and is unaffected). A level the user chose (``TORCH_CPP_LOG_LEVEL``)
# is left alone, and where the c10 library does not export the variable nothing changes.
_C10_WARNING, _C10_ERROR = 1, 2


@functools.lru_cache(maxsize=1)
def _c10_log_level() -> ctypes.c_int | None:
    """c10's ``FLAGS_caffe2_log_level`` (NOTE [ Frees the profiler cannot size ]), or ``None``."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            try:
                return ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
            except (OSError, ValueError):  # not exported by this build
                return None
    return None


@contextlib.contextmanager
def _quiet_unknown_frees() -> Iterator[None]:
    """c10's warnings off while a memory-profiling session of ours runs; see
    NOTE [ Frees the profiler cannot size ]."""
    level = _c10_log_level()
    if level is None or level.value != _C10_WARNING:
        yield
        return
    level.value = _C10_ERROR
    try:
        yield
    finally:
        level.value = _C10_WARNING


def _memory_profile() -> "torch.profiler.profile":
    """A CPU ``torch.profiler`` session that records allocator events, without Kineto's
    ``USDT: ... profiler_start`` / ``profiler_stop`` lines on stderr for every session (its log
    level is read when the first session starts; a level the user set is kept)."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above USDT, Kineto's loudest level
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)


# NOTE [ Frees in other threads ]
# The profiler records the allocator's events of the threads it profiles: the calling thread and
# those that carry its state (autograd's, a gloo worker while it runs a collective). A storage
# whose last reference is dropped by another thread has no free in the record and would count
# as alive to the end of the block. torch.distributed's gloo backend does this on every
# synchronous reduce-scatter: ``c10d::_reduce_scatter_base_`` clones the input in the calling
# thread, the worker all-reduces the clone, and the clone goes with the work object, which the
# worker drops after marking it complete, in a race with the caller: in 11-16% of the calls
# (2 ranks, 2 cores) the worker drops it last. Under FSDP2 every unit's backward
# reduce-scatters its unsharded gradients, so identical steps measured 0 to 2 such clones
# (0.79 MB each on a 4-layer Llama) above their true peak. Two facts put those frees back:
# an address the allocator hands out again was freed before (exact), and a block allocated
# inside a ``c10d::`` op and never freed in the record was released once its collective
# completed, at the end of the worker's run of that collective (``gloo:...``, the first one
# to start after the allocation). The calling thread's copy-out after the worker's run
# (gloo's reduce-scatter: views and a copy into the caller's output) allocates nothing.
_WORKER_PREFIXES = ("gloo:",)


def _cpu_allocation_events(prof: "torch.profiler.profile") -> list[tuple[int, int, int]]:
    """``(time_ns, address, signed bytes)`` of the CPU allocator's events, in time order, with
    the frees the profiler could not record put back (NOTE [ Frees in other threads ])."""
    from torch._C._profiler import _EventType

    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        return []
    events: list[tuple[int, int, int]] = []
    in_collective: set[int] = set()  # indices in ``events`` of allocations inside a c10d op
    workers: list[tuple[int, int]] = []  # (start, end) of the collectives' worker-thread runs
    stack = [(node, False) for node in results.experimental_event_tree()]
    while stack:
        node, collective = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                if collective and fields.alloc_size > 0:
                    in_collective.add(len(events))
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
            continue
        if node.name.startswith(_WORKER_PREFIXES):
            workers.append((node.start_time_ns, node.end_time_ns))
        inside = collective or node.name.startswith("c10d::")
        stack.extend((child, inside) for child in node.children)
    order = sorted(range(len(events)), key=lambda i: events[i][0])
    workers.sort()

    def freed(i: int, reused_at: int | None) -> tuple[int, int, int] | None:
        """The free the record lacks of allocation ``i``, or ``None`` (alive to the end)."""
        at, ptr, size = events[i]
        if i in in_collective:  # released by the collective's worker once it completed
            k = bisect.bisect_left(workers, (at, -1))
            if k < len(workers) and (reused_at is None or workers[k][1] < reused_at):
                return workers[k][1], ptr, -size
        return None if reused_at is None else (reused_at, ptr, -size)

    frees: list[tuple[int, int, int] | None] = []
    live: dict[int, int] = {}  # address -> index of the allocation there
    for i in order:
        at, ptr, size = events[i]
        if size > 0:
            if ptr in live:  # the allocator handed the address out again: it was freed
                frees.append(freed(live[ptr], at))
            live[ptr] = i
        else:
            live.pop(ptr, None)
    frees.extend(freed(i, None) for i in live.values())
    # at one instant a free goes before an allocation (the reuse above frees first)
    return sorted([*events, *(f for f in frees if f is not None)],
                  key=lambda e: (e[0], e[2] > 0))
