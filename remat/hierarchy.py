"""The module hierarchy of a joint graph: which forward ops belong to which ``nn.Module``.

Forward ops carry the path of the innermost module that ran them (from dynamo's
``nn_module_stack``); backward ops carry the path of the forward op they differentiate. This
module turns those paths into blocks for the solvers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import RematGraph

__all__ = ["Block", "child_blocks", "checkpoint_blocks"]

# Descend into a module that holds at least this share of its parent's forward ops: a model
# that is one big child (``GPT2LMHeadModel.transformer``) is split at the level below it.
_DOMINANT_SHARE = 0.8


@dataclass(frozen=True)
class Block:
    """A module and the forward ops it ran (in forward order)."""

    path: str
    ops: tuple[int, ...]


def _child_name(path: str, prefix: str) -> str | None:
    """The next path component below ``prefix`` (``None`` if ``path`` is not below it)."""
    if prefix:
        if path == prefix or not path.startswith(prefix + "."):
            return None
        rest = path[len(prefix) + 1:]
    else:
        rest = path
    if not rest:
        return None
    head, _, tail = rest.partition(".")
    # A numeric component belongs with its container: "layers.0" is one child of the root.
    if tail and not head.isdigit() and tail.split(".", 1)[0].isdigit():
        head = head + "." + tail.split(".", 1)[0]
    return f"{prefix}.{head}" if prefix else head


def child_blocks(graph: RematGraph, prefix: str, ops: tuple[int, ...] | None = None) -> list[Block]:
    """Blocks one module level below ``prefix``, in order of their first forward op.

    Forward ops that belong to ``prefix`` itself (not to a child) are not in any block.
    """
    candidates = graph.forward_ops if ops is None else ops
    members: dict[str, list[int]] = {}
    for i in candidates:
        child = _child_name(graph.ops[i].module, prefix)
        if child is not None:
            members.setdefault(child, []).append(i)
    blocks = [Block(path, tuple(m)) for path, m in members.items()]
    blocks.sort(key=lambda b: b.ops[0])
    return blocks


def checkpoint_blocks(graph: RematGraph) -> list[Block]:
    """The blocks a person would wrap in ``torch.utils.checkpoint``.

    Starting at the root, descend while a single child module holds most of the forward ops
    (``_DOMINANT_SHARE``); the children at the first level with a real split are the blocks.
    """
    prefix = ""
    ops: tuple[int, ...] = tuple(graph.forward_ops)

    def weight(op_indices: tuple[int, ...]) -> float:
        # Op counts, not measured times: a single noisy timing must not change the structure.
        return float(len(op_indices))

    while True:
        blocks = child_blocks(graph, prefix, ops)
        if not blocks:
            return []
        top = max(blocks, key=lambda b: weight(b.ops))
        if weight(top.ops) >= _DOMINANT_SHARE * weight(ops) and child_blocks(graph, top.path, top.ops):
            prefix, ops = top.path, top.ops
            continue
        return blocks
