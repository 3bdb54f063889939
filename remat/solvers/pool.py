"""Threads for MIPs solved at once (NOTE [ Independent MIPs at once ]): per-process pools that
survive a fork, and submitting and waiting in a way that Ctrl-C cancels.
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import os
import threading

from .mip import CANCEL_MIPS

__all__ = ["submit_cancellable", "thread_pool", "wait_cancellable", "workers"]


def workers() -> int:
    """How many MIPs this process solves at once (NOTE [ Independent MIPs at once ])."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


# NOTE [ Independent MIPs at once ]: a block's options are up to a dozen independent MIPs (one
# per limit of its grid); HiGHS runs each in one thread without the GIL, so they run side by
# side on the cores this process may use (at most 4: the solve happens once, before training,
# and a DDP rank's siblings may be solving too). Each MIP is deterministic and bounded in
# nodes, so running them at once changes when they finish, never what they find.
_POOLS: dict[tuple[str, int], tuple[int, concurrent.futures.ThreadPoolExecutor]] = {}
_POOLS_LOCK = threading.Lock()


def thread_pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of ``workers`` threads called ``name``, made on first use.

    A forked child (a DDP rank started by fork, a DataLoader worker) makes its own: its copy of
    the parent's pool has no threads, yet counts the parent's idle ones, so what it was given
    would wait forever.
    """
    key, pid = (name, workers), os.getpid()
    with _POOLS_LOCK:
        owner, pool = _POOLS.get(key, (None, None))
        if owner != pid:
            pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
            _POOLS[key] = (pid, pool)
        return pool


if hasattr(os, "register_at_fork"):  # the lock may have been held by a thread that is gone
    os.register_at_fork(after_in_child=lambda: globals().update(_POOLS_LOCK=threading.Lock()))


def submit_cancellable(pool: concurrent.futures.Executor, cancel: threading.Event, fn, *args
                       ) -> concurrent.futures.Future:
    """``pool.submit(fn, *args)`` in a copy of this context (its time-cut record) in which
    setting ``cancel`` stops the MIPs ``fn`` runs."""
    context = contextvars.copy_context()
    context.run(CANCEL_MIPS.set, cancel)
    return pool.submit(context.run, fn, *args)


def wait_cancellable(futures: list[concurrent.futures.Future], cancel: threading.Event) -> None:
    """Wait for ``futures`` in slices, so that Ctrl-C reaches this thread; on any exception
    (Ctrl-C included) cancel their MIPs, let them stop, and raise it."""
    try:
        while concurrent.futures.wait(futures, timeout=0.05).not_done:
            pass
    except BaseException:
        cancel.set()
        concurrent.futures.wait(futures, timeout=5.0)
        raise
