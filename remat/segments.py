"""Cut a joint graph into a chain of segments for the hierarchical solver.

NOTE [ Segments and regions ]
Segments are consecutive runs of forward ops, one per block of the module tree at the level
:func:`remat.hierarchy.checkpoint_blocks` picks (a transformer's layers, a ResNet's blocks, with
the ops between blocks joining the segment before them). A segment bigger than ``max_block_ops``
is split along its child modules, or, where there are none, at the forward positions whose
crossing values are smallest. A block whose ops are interleaved with another's is merged with
it, so segments are contiguous in forward order.

Each backward op belongs to the *region* of one segment. Two rules, and the hierarchical solver
tries both (neither wins on every model and budget): by *reads*, the latest segment whose
forward values it reads, else the segment of the module it differentiates (if that module lives
in one segment), else the earliest region its backward inputs allow, else its predecessor's; by
*module*, the module's segment first (unless it reads values of a later segment). A value
*shared* by later segments (read by forward ops two or more segments after its own: an attention
mask, a scan's parameters) does not hold an op back: an op reading one runs in the earliest
region where its backward inputs exist and all the forward values it reads are still visible.
Without these two, a Mamba-style scan's backward (each step reads the selected step gradient and
the shared ``A``) fell whole into the scan's first region, and 59% of the step's peak was memory
the chain model could not see. By reads, a conv's input-gradient, which reads only the conv's
input, joins the previous segment's region, and the gradient flowing between the two is
invisible to the chain model: at low budgets on a ResNet that costs half the recomputation. A
backward op may not run before a backward op it reads from, so it moves to a later region when
needed. Regions run in reverse segment order, each in the original backward order.

``cut_bytes[l]`` is what crosses into segment l: storages produced before it and read by forward
ops from l on. Forward values a region reads that are neither its segment's nor crossing into it
are *global*: the DP does not model them, their bytes are charged as fixed memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import RematGraph, ValueKind
from .hierarchy import child_blocks, checkpoint_blocks
from .liveness import liveness

__all__ = ["Chain", "chain_structure"]


@dataclass(frozen=True)
class Chain:
    """A chain of segments. See NOTE [ Segments and regions ].

    Attributes:
        segments: Forward ops of each segment, in order.
        regions: Backward ops of each segment, in original backward order.
        cut_bytes: Bytes crossing into each segment; the last entry is the size of the
            incoming output gradients.
        grad_bytes: Gradients each region leaves behind (parameter gradients).
        fixed_bytes: Bytes the chain model does not see (global values, model outputs).
    """

    segments: tuple[tuple[int, ...], ...]
    regions: tuple[tuple[int, ...], ...]
    cut_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    fixed_bytes: int


def _runs(graph: RematGraph, ops: list[int], block_of: dict[int, str]) -> list[list[int]]:
    """Contiguous segments: one per block; ops outside blocks join the segment before them
    (leading ones the first block); a block that reappears absorbs everything in between."""
    segs: list[tuple[set[str], list[int]]] = []
    for i in ops:
        key = block_of.get(i)
        if key is None:
            if segs:
                segs[-1][1].append(i)
            else:
                segs.append((set(), [i]))
            continue
        hit = next((k for k, (keys, _) in enumerate(segs) if key in keys), None)
        if hit is None:
            if segs and not segs[-1][0]:
                segs[-1][0].add(key)
                segs[-1][1].append(i)
            else:
                segs.append(({key}, [i]))
            continue
        keys, members = segs[hit]
        for more_keys, more in segs[hit + 1:]:
            keys |= more_keys
            members.extend(more)
        del segs[hit + 1:]
        members.append(i)
    return [members for _, members in segs]


def _split(graph: RematGraph, ops: list[int], max_ops: int, depth: int = 0) -> list[list[int]]:
    """Split a segment that is too big: along child modules, else at cheap cuts."""
    if len(ops) <= max_ops:
        return [ops]
    modules = {graph.ops[i].module for i in ops}
    prefix = _common_prefix(modules)
    children = child_blocks(graph, prefix, tuple(ops)) if depth < 8 else []
    if len(children) > 1:
        block_of = {i: b.path for b in children for i in b.ops}
        pieces = _runs(graph, ops, block_of)
        if len(pieces) > 1:
            return [p for piece in pieces for p in _split(graph, piece, max_ops, depth + 1)]
    return _cheap_cuts(graph, ops, max_ops)


def _common_prefix(paths: set[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    prefix = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        prefix.append(column[0])
    return ".".join(prefix)


def _cheap_cuts(graph: RematGraph, ops: list[int], max_ops: int) -> list[list[int]]:
    """Cut a run of forward ops into pieces of at most ``max_ops`` where little crosses."""
    position = {i: k for k, i in enumerate(ops)}
    delta = [0] * (len(ops) + 1)  # crossing[p]: bytes produced at or before p, read after p
    root = graph.storage_root
    for k, i in enumerate(ops):
        for v in graph.ops[i].outputs:
            last = max((position[u] for u in graph.users[v] if u in position), default=k)
            if last > k and root[v] == v:
                delta[k] += graph.values[v].nbytes
                delta[last] -= graph.values[v].nbytes
    crossing, running = [], 0
    for d in delta[:-1]:
        running += d
        crossing.append(running)
    pieces, start = [], 0
    while len(ops) - start > max_ops:
        lo, hi = start + max_ops // 2, start + max_ops - 1
        cut = min(range(lo, hi + 1), key=lambda p: (crossing[p], -p))
        pieces.append(ops[start:cut + 1])
        start = cut + 1
    pieces.append(ops[start:])
    return pieces


REGION_RULES = ("reads", "module")


def chain_structure(graph: RematGraph, *, max_block_ops: int = 120, regions: str = "reads"
                    ) -> Chain:
    """Segments, regions and sizes of ``graph``. See NOTE [ Segments and regions ].

    ``regions`` picks the rule for backward ops: ``"reads"`` (latest segment whose values it
    reads) or ``"module"`` (the segment of the module it differentiates, where possible).
    """
    if regions not in REGION_RULES:
        raise ValueError(f"regions={regions!r}: choose one of {REGION_RULES}")
    by_module = regions == "module"
    values, ops = graph.values, graph.ops
    nf = graph.num_forward
    fwd = list(graph.forward_ops)
    blocks = checkpoint_blocks(graph)
    block_of = {i: b.path for b in blocks for i in b.ops}
    segments = [p for run in _runs(graph, fwd, block_of) for p in _split(graph, run, max_block_ops)]
    seg_of = {i: k for k, seg in enumerate(segments) for i in seg}
    n = len(segments)

    # Regions: by the forward values read, else by module (when the module lives in one
    # segment only), else the earliest its backward inputs allow, else the previous op's.
    path_segs: dict[str, set[int]] = {}
    for i in fwd:
        path_segs.setdefault(ops[i].module, set()).add(seg_of[i])
    live = liveness(graph)
    root = graph.storage_root
    last_reader = {}
    for i in fwd:
        for v in ops[i].inputs:
            r = root[v]
            if values[r].kind is ValueKind.ACTIVATION:
                last_reader[r] = max(last_reader.get(r, -1), seg_of[i])

    def visible_until(r: int) -> int:  # the last region where the chain model sees value r
        return max(seg_of[values[r].producer], last_reader.get(r, -1))

    def shared(r: int) -> bool:  # read by forward ops two or more segments after its own
        return last_reader.get(r, -1) >= seg_of[values[r].producer] + 2

    region_of: dict[int, int] = {}
    previous = n - 1
    for k, b in enumerate(graph.backward_ops):
        op = ops[b]
        owners = {seg_of[values[v].producer] for v in live.needs[k]
                  if 0 <= values[v].producer < nf}
        # The earliest region its backward inputs allow: never before a backward op it reads.
        early = min((region_of[values[v].producer] for v in op.inputs
                     if values[v].producer >= nf), default=None)
        home = (next(iter(path_segs[op.module]))
                if op.module and len(path_segs.get(op.module, ())) == 1 else None)
        if home is not None and (home >= max(owners, default=-1) if by_module else not owners):
            # The segment of the module it differentiates: a conv's input-gradient reads
            # only the conv's input (the previous segment's value), yet runs with its block.
            region = home
        elif owners:
            region = max(owners)
            if early is not None and early > region:
                reads = {root[v] for v in live.needs[k] if 0 <= values[root[v]].producer < nf}
                if any(shared(r) for r in reads):
                    # It reads a value shared by later segments (an attention mask, a scan's
                    # parameters): that value's first segment must not hold it back. It runs
                    # in the earliest region where its backward inputs exist and every forward
                    # value it reads is still visible (NOTE [ Segments and regions ]).
                    region = max(region, min([early, *(visible_until(r) for r in reads)]))
        else:
            # Reads no forward value: as early as its backward inputs allow, else with the op
            # before it. A scan's backward starts by selecting every step's output gradient;
            # pinned to the op before them, those selects (and every step's backward, which
            # reads them) all fell into the scan's first region.
            region = previous if early is None else early
        if early is not None:
            region = min(region, early)
        region_of[b] = previous = region
    regions = [[] for _ in range(n)]
    for b in graph.backward_ops:
        regions[region_of[b]].append(b)

    # Cuts: storages produced before segment l and read by forward ops from l on.
    cut = [0] * (n + 1)
    for r, last in last_reader.items():
        born = seg_of[values[r].producer]
        for seg in range(born + 1, last + 1):
            cut[seg] += values[r].nbytes
    cut[n] = sum(v.nbytes for v in values if v.kind is ValueKind.TANGENT)

    # Global values: what a region reads that is neither its segment's nor crossing into it.
    fixed = set()
    for k, b in enumerate(graph.backward_ops):
        region = region_of[b]
        for v in live.needs[k]:
            r = root[v]
            if values[r].kind is not ValueKind.ACTIVATION:
                continue
            born = seg_of[values[r].producer]
            if born != region and not (born < region <= last_reader.get(r, -1)):
                fixed.add(r)
    fixed_bytes = sum(values[r].nbytes for r in fixed) + live.output_bytes

    out_roots = {root[v] for v in graph.backward_outputs}
    grads = [0] * n
    for b in graph.backward_ops:
        for v in ops[b].outputs:
            if v in out_roots and values[v].kind is ValueKind.GRADIENT:
                grads[region_of[b]] += values[v].nbytes
    return Chain(tuple(tuple(s) for s in segments), tuple(tuple(r) for r in regions),
                 tuple(cut), tuple(grads), fixed_bytes)
