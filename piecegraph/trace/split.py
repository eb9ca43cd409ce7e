"""Cut a Dynamo FX graph at split ops (pure FX: no device, no compiler; tested on CPU)."""

from __future__ import annotations

import torch
from torch.fx.passes.split_module import split_module

from ..ops.split import node_op_name
from ..program import PieceInfo


def split_graph(
    gm: torch.fx.GraphModule, split_names: frozenset[str]
) -> tuple[torch.fx.GraphModule, list[PieceInfo]]:
    """Split ``gm`` so that every call of an op in ``split_names`` sits alone in its own submodule.

    Returns the split module (whose ``forward`` calls ``submod_0``, ``submod_1``, ... in the original order)
    and one :class:`PieceInfo` per submodule, in call order. ``gm`` itself is not modified. Consecutive split
    ops give consecutive split submodules; a graph with no split op gives a single piece.
    """
    partition: dict[torch.fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node_op_name(node) in split_names:
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    split_gm = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    pieces = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split_gm, node.target)
        calls = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        is_split = any(node_op_name(n) in split_names for n in calls)
        pieces.append(PieceInfo(node.target, is_split, len(calls)))
    return split_gm, pieces
