"""A restored graph's pieces compiled for the fakes of one propagation, not of a second one.

:func:`~piecegraph.trace.snapshot.restore_graph` propagates fakes through the whole graph (splitting, the
token-mixing check and the memory estimate read them). Compiling the split graph's pieces then needs each piece's
input fakes, which :func:`~piecegraph.trace.backend.build_program` got by running the split graph on fakes once
more, under the same fake mode and the Python dispatcher: on the 0.5B shape (24 layers, CPU) that second run cost
0.8-0.9 s of every warm start, for fakes the first run had already made.

:func:`propagate` is that first run, under the Python dispatcher as Dynamo and the split graph's run use it, and it
keeps on each node (``meta[LIVE]``) the value the op returned: the very object an interpreter passes on (views,
aliasing between inputs, ``requires_grad``, a fake's constant), not FakeTensorProp's detached copy in
``meta["val"]``. :func:`piece_inputs` reads them off the pieces' placeholders (``split_module`` copies each
placeholder's meta from the node it stands for). One thing could make a kept value differ from what the second
run passes a piece: a node that changes a tensor's metadata in place (``x.unsqueeze_(0)``, ``set_``,
``requires_grad_``) after the value was made. :func:`propagate` checks every node's tensor arguments against
their metadata when they were made and, on any change, keeps nothing: ``piece_inputs`` then says ``None``, and
the pieces are compiled from a second run as before. A graph that did not come from a snapshot (no cache) has no
kept values either.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.utils._pytree import tree_leaves

LIVE = "piecegraph_live"  # node meta: the fake value the op returned in :func:`propagate`


def propagate(gm: torch.fx.GraphModule, mode: Any, fakes: list[Any], keep: bool) -> bool:
    """Propagate ``fakes`` through ``gm`` as FakeTensorProp does (``meta["val"]`` on every node). ``keep``: for a
    graph whose pieces will be compiled, under the Python dispatcher (as their compiles' fakes always were made;
    it costs ~20% more here, so a graph compiled whole is propagated without it, as before), keeping each node's
    value in ``meta[LIVE]`` unless a node changed a tensor's metadata in place (then none is kept). Returns
    whether values were kept."""
    if not keep:
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        return False
    prop = _keeping_prop()(gm, mode)
    with enable_python_dispatcher():
        prop.propagate_dont_convert_inputs(*fakes)
    if prop.changed:
        return False
    for node, value in prop.values.items():
        node.meta[LIVE] = value
    return True


def piece_inputs(split_gm: torch.fx.GraphModule, names: set[str]) -> dict[str, list[Any]] | None:
    """``{piece: its input fakes}`` for the pieces of ``split_gm`` named in ``names``, in call order, as
    :func:`propagate` kept them; ``None`` when any is missing (the caller runs the split graph on fakes)."""
    out: dict[str, list[Any]] = {}
    for node in split_gm.graph.nodes:
        if node.op != "call_module" or node.target not in names:
            continue
        placeholders = [n for n in getattr(split_gm, node.target).graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(node.args) or any(LIVE not in p.meta for p in placeholders):
            return None
        out[node.target] = [p.meta[LIVE] for p in placeholders]
    return out


@functools.cache
def _keeping_prop() -> type:
    """FakeTensorProp that keeps each node's returned value and notices in-place metadata changes: after each
    node runs, its tensor arguments must have the sizes, strides, offset, storage, dtype and ``requires_grad``
    they were made with. Made on first use: ``import piecegraph`` does not import FakeTensorProp."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class KeepingProp(FakeTensorProp):
        def __init__(self, gm: torch.fx.GraphModule, mode: Any):
            super().__init__(gm, mode)
            self.values: dict[torch.fx.Node, Any] = {}
            self.made: dict[torch.fx.Node, tuple] = {}
            self.changed = False

        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if not self.changed:
                self.changed = any(arg in self.env and _metadata(self.env[arg]) != self.made.get(arg)
                                   for arg in n.all_input_nodes)
                self.values[n] = result
                self.made[n] = _metadata(result)
            return result

    return KeepingProp


def _metadata(value: Any) -> tuple:
    """What a tensor's in-place metadata change would alter, for every tensor in ``value``; symbolic sizes as
    their expressions (compared structurally: no guard is added to the shape env)."""
    return tuple((t.dtype, t.device, t.requires_grad, _exprs(t.shape), _exprs(t.stride()),
                  _expr(t.storage_offset()), t.untyped_storage()._cdata)
                 for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _exprs(sizes: Any) -> tuple:
    return tuple(_expr(s) for s in sizes)


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size
