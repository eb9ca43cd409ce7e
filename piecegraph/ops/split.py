"""Split ops: the custom ops the FX graph is cut at, which then run eagerly between captured pieces."""

from __future__ import annotations

from typing import Any, Iterable

import torch

# The op registry: qualified names ("namespace::name") of the ops declared with split_op().
_SPLIT_OPS: set[str] = set()


def op_name(op: Any) -> str:
    """``"namespace::name"`` of an op object, an overload, a packet or a name string."""
    if isinstance(op, str):
        if "::" not in op:
            raise ValueError(f"split op {op!r} must be written 'namespace::name', e.g. 'mylib::attention'")
        return op.split(".")[0]
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    name = getattr(op, "_qualname", None)  # torch.library.custom_op objects
    if isinstance(name, str):
        return name
    raise TypeError(
        f"cannot name split op {op!r}: pass 'namespace::name', torch.ops.namespace.name or an op overload"
    )


def split_op(op: Any) -> Any:
    """Declare ``op`` a split op for every model compiled afterwards and return it unchanged.

    A split op is a custom op (``torch.library``) whose node the graph is cut at. It runs eagerly between the
    captured pieces, so it may read host data and change shape with the batch (attention with its metadata).
    In ``mode="piecewise"`` its tensor outputs must be written into buffers it was given (mutated arguments)
    rather than fresh tensors, so the next piece finds them where it was captured.
    Usable as ``split_op("ns::name")`` or ``split_op(torch.ops.ns.name)``.
    """
    _SPLIT_OPS.add(op_name(op))
    return op


def split_op_names(extra: Iterable[Any] = ()) -> frozenset[str]:
    """The registered split ops plus ``extra`` (a config's ``split_ops``).

    Raises ``ValueError`` for a name in ``extra`` that is no torch op: a misspelt split op would otherwise split
    nothing, silently.
    """
    names = {op_name(op) for op in extra}
    for name in sorted(names):
        namespace, _, op = name.partition("::")
        try:
            getattr(getattr(torch.ops, namespace), op)
        except (AttributeError, RuntimeError):
            raise ValueError(f"split_ops names {name!r}, which is no registered torch op (torch.ops.{namespace}."
                             f"{op} does not exist): check the spelling, or import the module that defines it "
                             "before the first call") from None
    return frozenset(_SPLIT_OPS) | names


def node_op_name(node: torch.fx.Node) -> str | None:
    """The qualified op name of an FX ``call_function`` node calling a registered torch op, else ``None``."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op_name(target)
    return None
