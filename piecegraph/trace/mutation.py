"""Which inputs of a traced graph the model writes in place: a buffer counter, BatchNorm's statistics, an input
updated with ``x.add_(1)``.

The runner executes a size's pieces more than once when it first meets it (warm-up runs, then the capture); the
graph's writes must land once, as in eager. It restores these inputs after the warm-up, and copies a written token
input back into the caller's tensor after the real run (the model wrote it; eager would have too).
"""

from __future__ import annotations

import operator

import torch

from .mixing import op_name

# Ops whose result shares its first argument's memory: writing the result writes the input.
_VIEWS = {"view", "view_as", "reshape", "transpose", "permute", "narrow", "select", "unsqueeze", "squeeze",
          "expand", "expand_as", "as_strided", "t", "T", "mT", "flatten", "unflatten", "diagonal", "unbind",
          "split", "chunk", "movedim", "getitem", "__getitem__", "detach", "contiguous"}
_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def mutated_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Indices (in placeholder order) of the inputs that ``gm`` writes, directly or through a view."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    written = set()
    for node in gm.graph.nodes:
        for target in _written_args(node):
            base = _base(target)
            if base in index:
                written.add(index[base])
    return sorted(written)


def _written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__") and first is not None:
            return [first]
        return []
    if node.op != "call_function":
        return []
    target = node.target
    if target in _INPLACE_FUNCTIONS and first is not None:
        return [first]
    if node.kwargs.get("inplace") is True and first is not None:  # F.relu(x, inplace=True)
        return [first]
    if getattr(target, "__name__", "") == "batch_norm":  # training updates running_mean and running_var
        args = list(node.args) + [None] * 6
        training = node.kwargs.get("training", args[5])
        stats = [node.kwargs.get("running_mean", args[1]), node.kwargs.get("running_var", args[2])]
        return [a for a in stats if isinstance(a, torch.fx.Node)] if training else []
    schema = _schema(target)
    if schema is not None:  # a custom op: its schema says which arguments it writes (Tensor(a!))
        written = []
        for i, arg in enumerate(schema.arguments):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node) and arg.alias_info is not None and arg.alias_info.is_write:
                written.append(value)
        return written
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.startswith("_") and first is not None:  # torch.relu_ and the like
        return [first]
    return []


def _schema(target: object) -> torch.FunctionSchema | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = target.overloads()
        return getattr(target, overloads[0])._schema if overloads else None
    return None


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node`` views (itself when it is no view)."""
    while node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], torch.fx.Node):
        if op_name(node) not in _VIEWS:
            break
        node = node.args[0]
    return node
