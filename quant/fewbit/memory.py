"""Measure what autograd keeps for backward, and what few-bit activations save.

:class:`SavedTensorsMeter` counts the bytes of every tensor saved for backward inside its context
(``torch.autograd.graph.saved_tensors_hooks``), each storage once, so a view and its base, or one
tensor saved by two ops, count once. Parameters and buffers can be excluded: they live anyway.

:class:`FewBitMemoryMeter` measures a training forward of a model with few-bit activations and also
what the exact torch activations would have saved in the same step: for each few-bit call it replays
the torch function on a meta tensor shaped like the input and sees which tensors torch saves (the
input, the output, or fresh intermediates), then counts those not already kept by another op.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from quant.fewbit.activations import ACTIVATIONS
from quant.fewbit.packing import packed_bytes

__all__ = ["FewBitMemoryMeter", "FewBitMemoryReport", "SavedTensorsMeter"]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, bytes)`` of ``t``'s storage."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


class SavedTensorsMeter:
    """Context manager counting the bytes of tensors saved for backward, each storage once.

    A storage saved twice (a tensor and its view, or one tensor saved by two ops) counts once; a
    new storage that reuses the address of a freed one counts again (a ``StorageWeakRef`` tells
    them apart).

    Args:
        exclude: Tensors whose storages are not counted (e.g. ``model.parameters()``).

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> with SavedTensorsMeter(exclude=lin.parameters()) as meter:
        ...     y = torch.nn.functional.gelu(lin(torch.randn(2, 4)))
        >>> meter.bytes  # Linear's input (for the weight gradient) and GELU's: 2 * 2 * 4 float32
        64
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t)[0] for t in exclude}
        self._entries: dict[int, list[list]] = {}  # address -> [[bytes, weak ref], ...]
        self._context: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr in self._exclude:
            return t
        entries = self._entries.setdefault(ptr, [])
        if entries and not _expired(entries[-1][1]):
            entries[-1][0] = max(entries[-1][0], nbytes)
        else:
            entries.append([nbytes, _weak_ref(t)])
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def storages(self) -> dict[int, int]:
        """Bytes of the latest storage saved at each address."""
        return {ptr: entries[-1][0] for ptr, entries in self._entries.items()}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage has been saved and is still alive."""
        entries = self._entries.get(_storage_key(t)[0])
        return bool(entries) and not _expired(entries[-1][1])

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(nbytes for entries in self._entries.values() for nbytes, _ in entries)

    def __enter__(self) -> "SavedTensorsMeter":
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None


def _weak_ref(t: torch.Tensor) -> Optional[StorageWeakRef]:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _expired(ref: Optional[StorageWeakRef]) -> bool:
    return ref is not None and ref.expired()


@dataclasses.dataclass(frozen=True)
class FewBitMemoryReport:
    """Saved-for-backward bytes of one measured forward.

    Attributes:
        saved_bytes: Measured, with the few-bit activations (parameters and buffers excluded).
        exact_bytes: What the same forward saves with the exact torch activations.
        calls: Few-bit activation calls measured.
        codes_bytes: Bytes of packed codes among ``saved_bytes``.
    """

    saved_bytes: int
    exact_bytes: int
    calls: int
    codes_bytes: int

    @property
    def reduction(self) -> float:
        """Fraction of the exact version's saved bytes that few-bit removes."""
        return 1.0 - self.saved_bytes / self.exact_bytes if self.exact_bytes else 0.0

    def __str__(self) -> str:
        return (
            f"saved for backward: {_human(self.saved_bytes)} with few-bit activations vs "
            f"{_human(self.exact_bytes)} with exact ones ({self.reduction:.1%} less; "
            f"{self.calls} few-bit calls keeping {_human(self.codes_bytes)} of codes)"
        )


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _torch_saves(plan, x: torch.Tensor) -> list[tuple[str, int]]:
    """What the exact torch function of ``plan`` saves for backward on an input like ``x``:
    ``("input" | "output" | "fresh", bytes)`` per storage.

    NOTE [ Replaying on meta ]
    The replay runs on a ``meta`` tensor of ``x``'s shape, strides and dtype: autograd saves the
    same tensors there as on ``x``'s device, and nothing is allocated, so a measurement taken
    inside another one (``HiRemateCallback``'s warmup step, whose measured peak is what a budget
    is a fraction of) does not change it. Storages are told apart by identity, as meta tensors
    have no addresses. Where an op has no meta kernel, the replay runs on a detached copy of
    ``x`` instead (allocating a few tensors of its size for the moment it runs).
    """
    spec = ACTIVATIONS[plan.activation]
    try:
        return _replay(spec, plan, torch.empty_strided(
            x.shape, x.stride(), dtype=x.dtype, device="meta"))
    except (NotImplementedError, RuntimeError):
        return _replay(spec, plan, x.detach())


def _replay(spec, plan, x: torch.Tensor) -> list[tuple[str, int]]:
    storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        storages.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        leaf = x.detach().requires_grad_()
        xin = leaf.clone()  # non-leaf, so an in-place replay is allowed
        out = spec.call(xin, dict(plan.params), plan.inplace)
    x_ref = StorageWeakRef(xin.untyped_storage())
    out_ref = StorageWeakRef(out.untyped_storage())
    return [("input" if ref == x_ref else "output" if ref == out_ref else "fresh", nbytes)
            for ref, nbytes in storages.values()]


@dataclasses.dataclass
class _Call:
    """One few-bit call under a :class:`FewBitMemoryMeter`."""

    saved: list[tuple[str, int]]  # what torch would save: ("input" | "output" | "fresh", bytes)
    codes: int
    inplace: bool
    x: tuple[int, int]
    x_ref: StorageWeakRef
    x_kept: bool  # saved by another op while alive
    x_shared: bool  # the input or output of an earlier call, still alive: counted there
    module: nn.Module
    y: Optional[tuple[int, int]] = None
    y_ref: Optional[StorageWeakRef] = None
    y_kept: bool = False


class FewBitMemoryMeter:
    """Measure one forward of ``model`` and what exact activations would have saved.

    # NOTE [ Exact-activation counterfactual ]
    For each few-bit call the pre-hook replays the torch function on a meta tensor like the input
    (NOTE [ Replaying on meta ]) and classifies what torch saves: the input, the output, or fresh
    intermediates. The exact version's extra bytes are the fresh ones plus the input/output
    storages that no other op keeps anyway. "Kept by another op" is decided when that op saves
    the tensor, comparing storage addresses *while the call's tensor is alive* (a
    ``StorageWeakRef`` tells), because a freed address is soon reused by an unrelated tensor.

    Args:
        model: The model containing few-bit modules (from :func:`replace_activations`).

    Example:
        >>> with FewBitMemoryMeter(model) as meter:   # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> print(meter.report())                      # doctest: +SKIP
    """

    def __init__(self, model: nn.Module) -> None:
        from quant.fewbit.modules import _FewBitActivation

        self._modules = [m for m in model.modules() if isinstance(m, _FewBitActivation)]
        self._meter = SavedTensorsMeter(
            exclude=[*model.parameters(), *(b for b in model.buffers() if b is not None)]
        )
        self._meter_pack = self._meter._pack
        self._meter._pack = self._pack  # observe every save of the measured forward
        self._handles: list = []
        self._calls: list[_Call] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = _storage_key(t)[0]
        for call in self._calls:
            if call.x[0] == ptr and not call.x_ref.expired():
                call.x_kept = True
            if call.y is not None and call.y[0] == ptr and not call.y_ref.expired():
                call.y_kept = True
        return self._meter_pack(t)

    def _pre_hook(self, module, args):
        x = args[0] if args else None
        if not (
            isinstance(x, torch.Tensor) and module.training and torch.is_grad_enabled()
            and x.requires_grad
        ):
            return
        plan = module._fewbit_plan
        saved = _torch_saves(plan, x)
        key = _storage_key(x)
        shared = any(
            (c.x[0] == key[0] and not c.x_ref.expired())
            or (c.y is not None and c.y[0] == key[0] and not c.y_ref.expired())
            for c in self._calls
        )
        self._calls.append(_Call(
            saved=saved, codes=packed_bytes(x.numel(), plan.bits), inplace=plan.inplace, x=key,
            x_ref=StorageWeakRef(x.untyped_storage()),
            x_kept=self._meter.holds(x),  # saved earlier and still alive: the same storage
            x_shared=shared, module=module,
        ))

    def _post_hook(self, module, args, output):
        if self._calls and self._calls[-1].module is module and self._calls[-1].y is None:
            self._calls[-1].y = _storage_key(output)
            self._calls[-1].y_ref = StorageWeakRef(output.untyped_storage())

    def __enter__(self) -> "FewBitMemoryMeter":
        for m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_hook))
            self._handles.append(m.register_forward_hook(self._post_hook))
        self._meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._meter.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def report(self) -> FewBitMemoryReport:
        """The measured bytes and the exact-activation counterfactual (NOTE above)."""
        codes = sum(c.codes for c in self._calls)
        extra = 0
        for call in self._calls:
            for kind, nbytes in call.saved:
                if kind == "fresh":
                    extra += nbytes
                elif kind == "input" or call.inplace:  # in place: the input is the output
                    if not (call.x_kept or call.x_shared):
                        extra += call.x[1]
                elif not call.y_kept:
                    extra += call.y[1]
        total = self._meter.bytes
        return FewBitMemoryReport(
            saved_bytes=total, exact_bytes=total - codes + extra, calls=len(self._calls),
            codes_bytes=codes,
        )
