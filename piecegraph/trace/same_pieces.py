"""Pieces that are the same program: compiled once, shared.

A decoder's pieces between its split ops are the same code layer after layer; only the weights (graph inputs)
differ. Inductor's FX graph cache would find the second piece's code, but only after AOTAutograd has traced it
again and the cache key was hashed, which on the 0.5B shape cost most of the 13.7 s its 25 pieces took to
compile. Two pieces share one compiled callable when their graphs match node for node (ops, targets, constant
arguments, wiring, placeholders by position, not by Dynamo's per-layer names) and their inputs have the same
fake metadata (dtype, device, symbolic sizes and strides). Anything the key cannot describe by value (a
``get_attr`` constant, a submodule, a tensor inside a node's arguments) makes the piece its own.

Nor are a twin's fake values propagated again (each middle layer's fake run cost ~40 ms on CPU, a second per
pass of the 0.5B shape): the first piece's fake outputs are copied as fresh fake tensors of the same metadata
(:func:`fresh_outputs`), where that is exact: the piece writes none of its inputs, no output aliases an input or
another output, and no size is a symbol the piece itself made (data-dependent).
"""

from __future__ import annotations

from typing import Any

import torch


def piece_key(gm: torch.fx.GraphModule, fake_args: list[Any]) -> tuple | None:
    """What decides ``gm``'s compiled code for ``fake_args``, as a hashable value; ``None`` when part of it is
    state the key cannot compare by value (then the piece is compiled on its own)."""
    inputs = tuple(input_key(a) for a in fake_args)
    if any(k is None for k in inputs):
        return None
    nodes = graph_key(gm)
    return None if nodes is None else (inputs, nodes)


def graph_key(gm: torch.fx.GraphModule) -> tuple | None:
    """``gm``'s graph node for node (ops, targets by identity, constant arguments, wiring, placeholders by
    position), as a hashable value; ``None`` when it holds state the key cannot compare by value (a ``get_attr``
    constant, a submodule, a tensor inside a node's arguments)."""
    index: dict[torch.fx.Node, int] = {}
    nodes = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = len(index)
        if node.op == "placeholder":
            nodes.append(("placeholder",))
            continue
        args = _arg_key((node.args, node.kwargs), index)
        if args is None:
            return None
        nodes.append((node.op, _target_key(node.target), args))
    return tuple(nodes)


def input_key(value: Any) -> tuple | None:
    """A graph input's part of a key: a tensor's dtype, device, sizes and strides (symbols by name) and kind; a
    number by value; ``None`` for anything else (not comparable by value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, str(value.device), tuple(str(s) for s in value.shape),
                tuple(str(s) for s in value.stride()), value.requires_grad, type(value).__name__)
    if isinstance(value, (torch.SymInt, int, float, bool)) or value is None:
        return (type(value).__name__, str(value))
    return None


def _target_key(target: Any) -> Any:
    # The same function object for both pieces (a torch op, a builtin, a module-level function): compared by
    # identity, which the key's tuple equality does for objects without __eq__ of their own.
    return target if isinstance(target, str) else ("target", id(target), getattr(target, "__qualname__", None))


def _arg_key(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return ("node", index[value])
    if isinstance(value, (tuple, list)):
        items = [_arg_key(v, index) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = [(k, _arg_key(v, index)) for k, v in value.items()]
        return None if any(i is None for _, i in items) else ("dict", tuple(items))
    if isinstance(value, slice):
        inner = _arg_key((value.start, value.stop, value.step), index)
        return None if inner is None else ("slice", inner)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, repr(value))
    if isinstance(value, torch.Tensor):
        return None  # a tensor constant: its values would have to be compared
    return ("object", id(value), type(value).__qualname__)  # an enum member, an op overload: by identity


def fresh_outputs(outputs: Any, inputs: list[Any]) -> Any:
    """New fake tensors with ``outputs``' metadata (dtype, device, symbolic sizes and strides, requires_grad), in
    the same structure (a tensor, or a tuple / list of tensors, numbers and ``None``), made under the active fake
    mode; ``None`` when they would not stand for what running the piece again makes: an output that aliases an
    input or another output (fresh tensors would not), a size or stride with a symbol the inputs do not have
    (data-dependent), or a value of another kind."""
    many = isinstance(outputs, (tuple, list))
    values = list(outputs) if many else [outputs]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if any(v is not None and not isinstance(v, (torch.Tensor, int, float, bool)) for v in values):
        return None
    known = {sym for a in inputs if isinstance(a, torch.Tensor) for n in (*a.shape, *a.stride())
             if isinstance(n, torch.SymInt) for sym in n.node.expr.free_symbols}
    storages = [t.untyped_storage()._cdata for t in tensors]
    if len(set(storages)) < len(storages) or set(storages) & {
            a.untyped_storage()._cdata for a in inputs if isinstance(a, torch.Tensor)}:
        return None
    for t in tensors:
        for n in (*t.shape, *t.stride()):
            if isinstance(n, torch.SymInt) and not n.node.expr.free_symbols <= known:
                return None
    made = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                requires_grad=v.requires_grad) if isinstance(v, torch.Tensor) else v
            for v in values]
    return type(outputs)(made) if many else made[0]
