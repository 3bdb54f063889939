"""``RematGraph``: the joint forward+backward graph as plain data.

Solvers see only this: ops with their input and output values, byte sizes, times and flags.
No ``torch.fx`` object ever reaches a solver (see :mod:`remat.lowering` for the translation).

NOTE [ Values, storages and aliases ]
A *value* is one tensor an op produces. Several values may share one storage: a view
(``view``, ``t``, ``permute``, ``detach``, ``getitem`` of ``split`` ...) aliases the storage of
one of its inputs. Memory is charged per storage: the value that allocates a storage carries its
``nbytes``; an aliasing value has ``nbytes == 0`` and ``alias_of`` naming the input value whose
storage it shares. While any alias is alive, the whole storage is alive (a saved view keeps its
entire base alive). Graph inputs (parameters, buffers, user inputs) existed before the step and
cost nothing; tangents (the incoming output gradients) are allocated when backward starts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

__all__ = ["Phase", "ValueKind", "Value", "Op", "RematGraph", "FlatGraph"]


class Phase(str, enum.Enum):
    """Where an op belongs in the unmodified step."""

    FORWARD = "fwd"
    BACKWARD = "bwd"


class ValueKind(str, enum.Enum):
    """What a value is, for memory accounting."""

    INPUT = "input"  # parameters, buffers and user inputs: exist before the step
    TANGENT = "tangent"  # gradient of a forward output: allocated when backward starts
    ACTIVATION = "activation"  # produced by a forward op
    GRADIENT = "gradient"  # produced by a backward op


@dataclass(frozen=True)
class Value:
    """One tensor of the graph.

    Attributes:
        name: Stable name (the fx node's name), for messages and codegen.
        kind: See :class:`ValueKind`.
        producer: Index of the op producing it, ``-1`` for graph inputs and tangents.
        nbytes: Bytes of the storage this value allocates (0 for aliases and graph inputs).
        alias_of: Index of the input value whose storage this value shares, or ``None``.
        scalar: A size or other scalar (a ``SymInt`` of a dynamic-shape graph), not a tensor:
            it costs no memory and is always kept rather than recomputed.
    """

    name: str
    kind: ValueKind
    producer: int
    nbytes: int
    alias_of: int | None = None
    scalar: bool = False


@dataclass(frozen=True)
class Op:
    """One operation of the joint graph.

    Attributes:
        name: Stable name (the fx node's name).
        phase: Forward or backward op of the unmodified step.
        inputs: Indices of the values it reads (each once, in argument order).
        outputs: Indices of the values it produces.
        time: Measured or modelled run time in seconds.
        recomputable: ``False`` for random or impure ops, which must run exactly once.
        module: Dotted path of the innermost ``nn.Module`` the op belongs to (``""`` for the
            root). Backward ops carry the module of the forward op they differentiate.
        signature: Structural description (target, shapes, dtypes, constant args): two ops
            with the same signature do the same work.
        workspace: Extra bytes the op allocates temporarily while it runs (scratch buffers
            the graph does not show), measured when profiling.
        rerun_time: Seconds it takes when it runs again in backward (its inputs and output
            memory in cache), ``None`` for :attr:`time` (NOTE [ What a recomputation costs ]
            in :mod:`remat.costs`).
    """

    name: str
    phase: Phase
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    time: float = 0.0
    recomputable: bool = True
    module: str = ""
    signature: str = ""
    workspace: int = 0
    rerun_time: float | None = None

    @property
    def recompute_cost(self) -> float:
        """Seconds one recomputation of this op adds to the step."""
        return self.time if self.rerun_time is None else self.rerun_time


class FlatGraph(NamedTuple):
    """A graph's fields as flat tuples indexed by op or value, for tight loops (the simulator
    runs a few thousand times per solve): no attribute lookups, no ``None``."""

    inputs: tuple[tuple[int, ...], ...]  # per op
    outputs: tuple[tuple[int, ...], ...]  # per op
    times: tuple[float, ...]  # per op
    recompute_costs: tuple[float, ...]  # per op: Op.recompute_cost
    workspaces: tuple[int, ...]  # per op
    recomputable: tuple[bool, ...]  # per op
    alias_of: tuple[int, ...]  # per value: the value whose storage it shares, or -1
    nbytes: tuple[int, ...]  # per value
    tangents: tuple[int, ...]  # the tangent values
    forward_views: tuple[tuple[int, ...], ...]  # per value: views of it (or of its views)
    # that forward ops make, which go stale when it is recomputed


@dataclass(frozen=True)
class RematGraph:
    """The joint graph of one training step as plain data.

    Ops are stored forward ops first (in forward order), then backward ops (in the order the
    unmodified backward runs them); ``ops[:num_forward]`` are the forward ops.

    Attributes:
        ops: All ops.
        values: All values; ``Op.inputs``/``Op.outputs`` index into it.
        num_forward: Number of forward ops.
        forward_outputs: Values the forward must hand back (model outputs, updated buffers).
        backward_outputs: Values the backward must hand back (parameter and input gradients).
        user_outputs: The subset of ``forward_outputs`` the caller receives (the others are
            updated buffers, written back right after forward).
    """

    ops: tuple[Op, ...]
    values: tuple[Value, ...]
    num_forward: int
    forward_outputs: tuple[int, ...]
    backward_outputs: tuple[int, ...]
    user_outputs: tuple[int, ...] = ()

    # ---- derived structure (computed once; the dataclass is frozen) ----------------------
    @cached_property
    def forward_ops(self) -> range:
        return range(self.num_forward)

    @cached_property
    def backward_ops(self) -> range:
        return range(self.num_forward, len(self.ops))

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each value, the ops that read it (in op order)."""
        users: list[list[int]] = [[] for _ in self.values]
        for index, op in enumerate(self.ops):
            for v in op.inputs:
                users[v].append(index)
        return tuple(tuple(u) for u in users)

    @cached_property
    def storage_root(self) -> tuple[int, ...]:
        """For each value, the value that owns its storage (itself unless it is an alias)."""
        root = list(range(len(self.values)))
        for index, value in enumerate(self.values):
            if value.alias_of is not None:
                root[index] = root[value.alias_of]
        return tuple(root)

    @cached_property
    def storage_bytes(self) -> tuple[int, ...]:
        """For each value, the bytes of the storage it keeps alive (its root's)."""
        return tuple(self.values[r].nbytes for r in self.storage_root)

    @cached_property
    def always_available(self) -> frozenset[int]:
        """Values every op may read at any time: the graph inputs."""
        return frozenset(i for i, v in enumerate(self.values) if v.kind is ValueKind.INPUT)

    @cached_property
    def forward_values(self) -> tuple[int, ...]:
        """Values produced by forward ops."""
        return tuple(v for i in self.forward_ops for v in self.ops[i].outputs)

    @cached_property
    def flat(self) -> FlatGraph:
        """The graph as flat tuples (see :class:`FlatGraph`)."""
        views: list[list[int]] = [[] for _ in self.values]
        chain: dict[int, set[int]] = {}  # a view -> the values it is (transitively) a view of
        for v, value in enumerate(self.values):
            if value.alias_of is not None:
                chain[v] = {value.alias_of} | chain.get(value.alias_of, set())
                if value.producer < self.num_forward:
                    for u in chain[v]:
                        views[u].append(v)
        return FlatGraph(
            inputs=tuple(op.inputs for op in self.ops),
            outputs=tuple(op.outputs for op in self.ops),
            times=tuple(op.time for op in self.ops),
            recompute_costs=tuple(op.recompute_cost for op in self.ops),
            workspaces=tuple(op.workspace for op in self.ops),
            recomputable=tuple(op.recomputable for op in self.ops),
            alias_of=tuple(-1 if v.alias_of is None else v.alias_of for v in self.values),
            nbytes=tuple(v.nbytes for v in self.values),
            tangents=tuple(i for i, v in enumerate(self.values) if v.kind is ValueKind.TANGENT),
            forward_views=tuple(tuple(u) for u in views),
        )

    @cached_property
    def baseline_time(self) -> float:
        """Time of the unmodified step (every op once)."""
        return sum(op.time for op in self.ops)

    def with_times(self, times: list[float], workspaces: list[int] | None = None,
                   rerun_times: list[float] | None = None) -> "RematGraph":
        """A copy with measured times (and extra measured workspace bytes, and the times of
        ops run again) filled in."""
        ops = tuple(
            replace(op, time=float(t),
                    workspace=op.workspace + (int(workspaces[i]) if workspaces else 0),
                    rerun_time=float(rerun_times[i]) if rerun_times is not None else None)
            for i, (op, t) in enumerate(zip(self.ops, times))
        )
        return replace(self, ops=ops)

    def summary(self) -> str:
        """One line: op and value counts and activation bytes."""
        act = sum(self.values[v].nbytes for v in self.forward_values)
        return (
            f"RematGraph({self.num_forward} forward ops, {len(self.ops) - self.num_forward} "
            f"backward ops, {len(self.values)} values, {act} forward bytes)"
        )
