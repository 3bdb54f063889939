"""``python -m integrations.accelerate``: rematerialize a plain Accelerate script, unedited.

::

    HIREMATE_BUDGET=50% python -m integrations.accelerate train.py --lr 1e-3       # one process
    HIREMATE_BUDGET=50% accelerate launch -m integrations.accelerate train.py --lr 1e-3
    HIREMATE_BUDGET=50% torchrun --nproc_per_node 2 -m integrations.accelerate train.py

The launcher reads the ``HIREMATE_*`` variables (:meth:`HiRematePlugin.from_env`), makes every
``accelerate.Accelerator`` rematerialize the models passed to its ``prepare`` while the script
runs, and runs the script as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` that
``python train.py ...`` would give it. ``accelerate launch -m`` (and ``torchrun -m``) start it once
per process; under several processes rank 0 solves and broadcasts its plans, as with
``HiRemateAccelerator``. Without ``HIREMATE_BUDGET`` the script runs as plain Accelerate.

NOTE [ Why a launcher module ]
    A script that builds a plain ``Accelerator`` imports nothing of ours, and Accelerate offers no
    hook a package can register (no plugin entry points; ``accelerate launch`` rejects unknown
    flags and config keys), so ``HIREMATE_BUDGET=50% accelerate launch train.py`` cannot reach its
    ``Accelerator``. Accelerate can, however, run a module per process (``accelerate launch -m``):
    this one patches the class, then runs the script. Starting Python with code of ours some other
    way (``sitecustomize``, ``.pth`` files) would act on every Python process of the environment;
    we do not. ``python train.py`` with ``HIREMATE_BUDGET`` set therefore stays plain Accelerate,
    and only a script that imports ``HiRemateAccelerator`` reads the variable by itself.

NOTE [ Patching Accelerator for the script's lifetime ]
    ``Accelerator.prepare`` and ``Accelerator.unwrap_model`` are replaced on the class object
    (``accelerate.Accelerator`` *is* ``accelerate.accelerator.Accelerator``), so instances created
    before or after, and subclasses, are covered; the originals are put back when the script
    ends. The wrapped ``prepare`` gives a plain accelerator the state ``HiRemateAccelerator``
    keeps (``hiremate_plugin``, ``hiremate_results``) and runs the same code on its arguments
    (NOTE [ One implementation, two ways in ] in :mod:`integrations.accelerate`); a
    ``HiRemateAccelerator`` is left to its own ``prepare``. ``unwrap_model`` returns the user's
    module behind a ``RematModule``. A script whose ``prepare`` never receives a model gets one
    warning at exit (main process only): the flag was set and did nothing.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import runpy
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from accelerate import Accelerator
from accelerate.utils import get_int_from_env
from torch import nn

from integrations.accelerate import (
    HiRemateAccelerator,
    HiRematePlugin,
    _attach,
    _original,
    _prepare,
)

__all__ = ["LaunchRecord", "main", "rematerialize_every_accelerator", "run_script"]

log = logging.getLogger("integrations.accelerate")

PROG = "python -m integrations.accelerate"
USAGE = (f"usage: {PROG} SCRIPT [ARGS ...]\n"
         f"       {PROG} -m MODULE [ARGS ...]\n"
         f"       accelerate launch [LAUNCH OPTIONS] -m integrations.accelerate SCRIPT [ARGS ...]")
HELP = f"""{USAGE}

Run a training script that builds a plain accelerate.Accelerator, with every Accelerator's
prepare() rematerializing the models it is given, as set by the HIREMATE_* variables:

  HIREMATE_BUDGET      turns rematerialization on; the budget (70%, 0.7, 6GiB)
  HIREMATE_SOLVER      solver name (hierarchical, dp, ilp, ...)
  HIREMATE_TIME_LIMIT  seconds per solve
  HIREMATE_MODULE      submodules to rematerialize in place, comma-separated
  HIREMATE_CACHE_DIR   on-disk plan cache
  HIREMATE_STRICT      raise instead of training unmodified (1/0)
  HIREMATE_VERBOSE     progress lines and the summary table on stderr (1/0)

Without HIREMATE_BUDGET the script runs as plain Accelerate.
example: HIREMATE_BUDGET=50% accelerate launch -m integrations.accelerate train.py --lr 1e-3"""

EXIT_USAGE = 2  # as Python's own command line and argparse
_OWNER = "integrations.accelerate"
_NO_LOADER_ADVICE = ("pass the training DataLoader in the same prepare() call (or prepare it "
                     "first), or build a HiRemateAccelerator and call "
                     "accelerator.rematerialize(model, batch)")


@dataclass
class LaunchRecord:
    """What the patched ``prepare`` saw while the script ran.

    Attributes:
        prepare_calls: ``Accelerator.prepare`` calls (any accelerator).
        model_calls: Those that were given at least one ``nn.Module``.
    """

    prepare_calls: int = 0
    model_calls: int = 0


@contextmanager
def rematerialize_every_accelerator(plugin: HiRematePlugin) -> Iterator[LaunchRecord]:
    """Inside the block, every ``Accelerator.prepare`` rematerializes the models it is given.

    See NOTE [ Patching Accelerator for the script's lifetime ]. ``HiRemateAccelerator``
    instances keep their own settings.

    Args:
        plugin: The settings for plain accelerators.

    Yields:
        A :class:`LaunchRecord`, filled as ``prepare`` is called.

    Raises:
        TypeError: ``plugin`` is not a :class:`HiRematePlugin`.

    Example:
        >>> with rematerialize_every_accelerator(HiRematePlugin(budget="50%")):  # doctest: +SKIP
        ...     train()  # builds an Accelerator and prepares its model
    """
    if not isinstance(plugin, HiRematePlugin):
        raise TypeError(f"plugin={plugin!r}: expected a HiRematePlugin")
    record = LaunchRecord()
    original_prepare = Accelerator.__dict__["prepare"]
    original_unwrap = Accelerator.__dict__["unwrap_model"]

    @functools.wraps(original_prepare)
    def prepare(self: Accelerator, *args: Any, device_placement: Optional[list] = None) -> Any:
        record.prepare_calls += 1
        record.model_calls += any(isinstance(obj, nn.Module) for obj in args)
        if isinstance(self, HiRemateAccelerator):  # that one rematerializes in its prepare
            return original_prepare(self, *args, device_placement=device_placement)
        if getattr(self, "hiremate_plugin", None) is not plugin:
            _attach(self, plugin)
        return _prepare(self, list(args), device_placement,
                        functools.partial(original_prepare, self), owner=_OWNER,
                        advice=_NO_LOADER_ADVICE)

    @functools.wraps(original_unwrap)
    def unwrap_model(self: Accelerator, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return _original(original_unwrap(self, model, *args, **kwargs))

    Accelerator.prepare = prepare
    Accelerator.unwrap_model = unwrap_model
    try:
        yield record
    finally:
        Accelerator.prepare = original_prepare
        Accelerator.unwrap_model = original_unwrap


def run_script(target: str, args: Sequence[str] = (), *, module: bool = False) -> None:
    """Run ``target`` as ``__main__``, as ``python target args...`` (``python -m`` if ``module``).

    ``sys.argv`` is ``[target, *args]`` (a module's file path first, as ``python -m`` gives),
    ``sys.path[0]`` the script's directory (the current directory for a module); both are put
    back afterwards.
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [target, *args]
    try:
        if module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.realpath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path


def _main_process() -> bool:
    # Launchers set the rank before the script builds any Accelerator (torchrun, accelerate
    # launch, MPI); a single process has none.
    return get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                             "MV2_COMM_WORLD_RANK"], 0) == 0


def _parse(argv: Sequence[str]) -> tuple[str, list[str], bool]:
    """``(target, args, is_module)``; raises ``ValueError`` with a usage message."""
    if not argv:
        raise ValueError("expected a script to run, e.g. train.py, or -m MODULE")
    first, rest = argv[0], list(argv[1:])
    if first == "-m":
        if not rest:
            raise ValueError("-m: expected a module name, e.g. -m mypackage.train")
        name, rest = rest[0], rest[1:]
        saved = sys.path[:]
        sys.path.insert(0, os.getcwd())  # where python -m looks first; run_script does the same
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:
                if importlib.util.find_spec(f"{name}.__main__") is None:
                    raise ValueError(f"-m {name}: {name!r} is a package without a __main__ "
                                     "module and cannot be run")
        except ImportError:
            spec = None
        finally:
            sys.path[:] = saved
        if spec is None:
            raise ValueError(f"-m {name}: no module named {name!r} (is its directory the current "
                             "one, or installed?)")
        return name, rest, True
    if first.startswith("-"):
        raise ValueError(f"unknown option {first!r}: options of the script go after it "
                         f"({PROG} train.py {first} ...); launcher options go to accelerate "
                         "launch / torchrun before -m integrations.accelerate")
    if not os.path.exists(first):
        raise ValueError(f"can't open file {first!r}: no such file")
    return first, rest, False


@contextmanager
def _progress_on_stderr(plugin: HiRematePlugin) -> Iterator[None]:
    """``HIREMATE_VERBOSE``'s progress lines and table on stderr (main process), unless the
    script configures logging itself (then they go where it sends them)."""
    if not (plugin.verbose and _main_process()):
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: not logging.getLogger().handlers)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (see the module docstring); returns the exit status.

    Args:
        argv: The arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        0 when the script ends normally, 2 for a usage error or a malformed ``HIREMATE_*``
        variable (``error: ...`` on stderr, naming the variable). An exception or ``SystemExit``
        raised by the script propagates as it would from ``python train.py``.

    Warns:
        UserWarning: on the main process, when ``HIREMATE_BUDGET`` is set and the script ended
            without passing a model to ``Accelerator.prepare``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    try:
        target, args, is_module = _parse(argv)
    except ValueError as e:
        print(f"{USAGE}\n{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        plugin = HiRematePlugin.from_env()
    except (ValueError, TypeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if plugin is None:
        run_script(target, args, module=is_module)
        return 0
    with warnings.catch_warnings():  # the script's own warning filters end with it
        with _progress_on_stderr(plugin), rematerialize_every_accelerator(plugin) as record:
            try:
                run_script(target, args, module=is_module)
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
                exit_ = e
            else:
                exit_ = None
    if record.model_calls == 0 and _main_process():
        warnings.warn(
            f"HIREMATE_BUDGET={plugin.budget} was set but {target} never passed a model to "
            "Accelerator.prepare; nothing was rematerialized. Pass the model with its DataLoader "
            "to accelerator.prepare(model, optimizer, loader) (prepare_model() alone is not "
            "covered), or unset HIREMATE_BUDGET.", stacklevel=2)
    if exit_ is not None:
        raise exit_
    return 0
