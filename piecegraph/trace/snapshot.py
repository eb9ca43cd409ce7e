"""A traced graph as bytes, and back, so a warm start skips Dynamo.

Dynamo's graph pickles as Python code (FX's own ``GraphModule`` pickling), but its node metadata does not: the
fake values with the symbolic token count, which splitting, the token-mixing check, the memory estimate and
Inductor all read. So the snapshot also records each placeholder's fake as data (dtype, device, shape with the
token symbols by name, contiguous), what :func:`~piecegraph.trace.backend.build_program` reads off Dynamo's
placeholder metadata (source name, module state), and each node's module stack and stack trace (the
token-mixing check reads a module's ``piecegraph_padding_safe`` there, and names the model's line from the
trace). :func:`restore_graph` rebuilds the fakes in a fresh shape env and propagates them through the graph. A
cold start that can snapshot builds its program from the restored graph too, so a warm start compiles exactly
what the cold one did (same code, same symbol names: Inductor's caches hit).

A warm start runs no Dynamo, so none of Dynamo's guards either: what the trace specialised on must be checked
some other way. The cache key covers the model's classes' code, its config, parameter shapes and versions; on top,
the snapshot keeps a sha256 of every source file a node's stack trace names (a helper or a module-level constant
edited in any file that produced graph ops; :func:`check_fresh`), and the trace's snapshot a digest of the
model's plain attributes (``layer.scale = 2.0`` set after construction) and of the global state a trace bakes in
(:func:`attribute_digest`, compared by
:func:`piecegraph.graphed.build.load_trace`). Not seen: a constant imported from a
file that made no graph op into one that did; clear the cache (``piecegraph cache clear``) after editing such.

Only what the snapshot can state exactly is snapshotted: a dynamic trace whose placeholders are SymInts that
are token symbols, or contiguous tensors whose sizes are integers or token symbols, and no ``get_attr`` state.
Anything else returns ``None`` (the start traces with Dynamo, as without a cache).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import operator
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .values import ValueBuilder, value_specs

FORMAT = 1
log = logging.getLogger("piecegraph")
_KEPT_META = ("nn_module_stack", "stack_trace")  # what later stages read of Dynamo's per-node metadata


@dataclass
class Placeholder:
    """What a placeholder's fake was: a token symbol (``symbol``), or a tensor (``shape`` of ints and symbol
    names), with the metadata :func:`build_program` reads (``source``: Dynamo's source name; ``module_state``)."""

    name: str
    source: str
    symbol: str | None = None
    shape: tuple[int | str, ...] | None = None
    dtype: torch.dtype | None = None
    device: str | None = None
    requires_grad: bool = False
    module_state: bool = False


@dataclass
class GraphSnapshot:
    """A graph and its placeholders' fakes; ``hints`` gives each token symbol the value it was traced with."""

    code: bytes  # the pickled GraphModule (FX regenerates it from its code)
    placeholders: list[Placeholder]
    hints: dict[str, int]
    node_meta: bytes = b""  # per node in order: (op, target, {"nn_module_stack": ..., "stack_trace": ...}), pickled
    files: dict[str, str] = field(default_factory=dict)  # each source file the stack traces name: its sha256
    values: bytes = b""  # the nodes' fake values as specs (trace/values.py), pickled; empty: propagate fakes
    format: int = FORMAT


def snapshot_graph(gm: torch.fx.GraphModule, fakes: list[Any], sources: list[str], module_state: list[bool]
                   ) -> GraphSnapshot | None:
    """``gm`` (a Dynamo graph, before splitting or compiling) as a :class:`GraphSnapshot`, or ``None`` when its
    placeholders or state are not what the snapshot can state exactly (see the module docstring)."""
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes) or list(gm.named_buffers()) or \
            list(gm.named_parameters()):
        return None
    from torch._subclasses.fake_tensor import FakeTensor

    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders, hints = [], {}
    for node, fake, source, state in zip(nodes, fakes, sources, module_state):
        entry = Placeholder(node.name, source, module_state=state)
        if isinstance(fake, torch.SymInt):
            if not fake.node.expr.is_Symbol:
                return None
            entry.symbol = str(fake.node.expr)
            hints[entry.symbol] = int(fake.node.hint)
        elif isinstance(fake, FakeTensor):
            shape = []
            for size in fake.shape:
                if isinstance(size, torch.SymInt):
                    if not size.node.expr.is_Symbol:
                        return None
                    shape.append(str(size.node.expr))
                    hints[str(size.node.expr)] = int(size.node.hint)
                else:
                    shape.append(int(size))
            if not fake.is_contiguous():
                return None
            entry.shape, entry.dtype, entry.device = tuple(shape), fake.dtype, str(fake.device)
            entry.requires_grad = fake.requires_grad
        else:
            return None
        placeholders.append(entry)
    if not hints:  # a static trace: its token count is read off Dynamo's sources, which a snapshot does not keep
        return None
    graph = _live_copy(gm.graph)
    kept = [(n.op, _target(n), _kept_meta(n)) for n in graph.nodes]
    try:
        code = pickle.dumps(torch.fx.GraphModule(torch.nn.Module(), graph, class_name=type(gm).__name__))
        node_meta = pickle.dumps(kept)
    except Exception as err:  # noqa: BLE001  (a target or module class pickle cannot name: trace with Dynamo instead)
        log.warning("piecegraph: the traced program cannot be kept for reuse (%s: %s); a warm start, or a second "
                    "module sharing this trace, traces the model again", type(err).__name__, err)
        return None
    specs = value_specs(list(graph.nodes), set(hints))
    values = b"" if specs is None else pickle.dumps(specs)
    paths = {path for _, _, meta in kept for path in _FILE.findall(meta.get("stack_trace") or "")}
    return GraphSnapshot(code, placeholders, hints, node_meta, {path: _file_digest(path) for path in sorted(paths)},
                         values)


def _kept_meta(node: torch.fx.Node) -> dict[str, Any]:
    """The node's :data:`_KEPT_META`, each module stack entry's class kept as is unless pickle cannot name it."""
    meta = {k: node.meta[k] for k in _KEPT_META if k in node.meta}
    if meta.get("nn_module_stack"):
        meta["nn_module_stack"] = {key: _nameable(entry) for key, entry in meta["nn_module_stack"].items()}
    return meta


def _nameable(entry: Any) -> Any:
    """A module stack entry ``(path, class)`` whose class was defined inside a function (pickle cannot import it:
    transformers 5.25, through the ``kernels`` package it now requires, wraps functions such as
    ``apply_rotary_pos_emb`` in such classes) with the class's qualified name instead. Only a class can declare
    ``piecegraph_padding_safe``, so its nodes are checked for token mixing as any other's after a restore:
    stricter, never looser."""
    if isinstance(entry, tuple) and len(entry) > 1 and isinstance(entry[1], type) \
            and "<locals>" in entry[1].__qualname__:
        return (entry[0], f"{entry[1].__module__}.{entry[1].__qualname__}", *entry[2:])
    return entry


_FILE = re.compile(r'File "([^"]+)", line \d+')


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


def attribute_digest(model: torch.nn.Module) -> str:
    """sha256 of every module's plain attributes (numbers, strings, flags, dtypes and containers of them) and of
    the global state a trace bakes in (default dtype, autocast): what Dynamo would have guarded on, set on the
    instances or the process rather than in the code or config."""
    h = hashlib.sha256()
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")] \
        if hasattr(torch, "get_autocast_dtype") else [torch.is_autocast_enabled()]
    h.update(repr((torch.get_default_dtype(), autocast)).encode())
    for name, module in model.named_modules():
        skip = getattr(type(module), "piecegraph_not_traced", ())  # a class's bookkeeping no forward reads
        for key, value in sorted(vars(module).items()):
            text = None if key in skip else _plain(value)
            if text is not None:
                h.update(f"{name}.{key}={text}\n".encode())
    return h.hexdigest()


def _plain(value: object) -> str | None:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, enum.Enum)):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_plain(v) for v in value]
        if any(i is None for i in items):
            return None
        return f"{type(value).__name__}({', '.join(sorted(items) if isinstance(value, (set, frozenset)) else items)})"
    return None


def check_fresh(snapshot: GraphSnapshot) -> None:
    """``LookupError`` naming a source file the trace came from that changed since (or is gone)."""
    for path, digest in snapshot.files.items():
        if _file_digest(path) != digest:
            raise LookupError(f"{path} changed since the program was traced")


def _live_copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    """``graph`` without its dead pure nodes (Dynamo keeps some, e.g. an unused ``torch.zeros``): FX re-tracing
    the pickled code would evaluate such a call on constants and drop it, and nodes are matched by position.
    A node that writes in place is never dead, though nothing uses its result (see :func:`_writes`)."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    copy.eliminate_dead_code(is_impure_node=_writes)
    return copy


# x += y on a tensor: Dynamo records the in-place operator (whose result nobody may use when x is not read
# again); FX's re-trace of the pickled code records the plain one (a Proxy has no __iadd__), put back on restore.
_INPLACE_OPERATORS = {getattr(operator, f"i{name.rstrip('_')}"): getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift", "rshift")}


def _function_name(function: Any) -> str:
    return f"{function.__module__}.{function.__qualname__}"


_INPLACE_BY_NAME = {_function_name(f): f for f in _INPLACE_OPERATORS}


def _writes(node: torch.fx.Node) -> bool:
    """FX's own impurity, and every in-place write FX calls pure: Dynamo records ``y.add_(1)`` as a
    ``call_method`` and FX's dead-code pass drops such a node when its result is unused, which lost the write
    (a silently wrong program from the cache's first start on). Torch names in-place methods and functions with a
    trailing underscore (``add_``, ``index_copy_``, ``torch.Tensor.copy_``); ``out=`` writes too. A torch op is
    judged by its schema (:func:`_op_writes`), not by FX, whose verdict moved between torch versions."""
    if node.is_impure():
        return True
    if node.op not in ("call_method", "call_function"):
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _op_writes(target)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name == "__setitem__" or target in _INPLACE_OPERATORS:
        return True
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def _op_writes(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> bool:
    """Whether a torch op may write: a schema with a mutable argument (``Tensor(a!)``), or one that returns
    nothing (called for its effect alone). A packet counts when any of its overloads does: Dynamo records
    ``torch.ops.ns.op(...)`` as the packet, and torch 2.11's FX called such a node pure, so a cached start's
    graph lost every attention op (``piecegraph_models::attention`` writes its output buffer and the KV cache)
    and gave wrong tokens from the first one, on the GPU machine's torch only."""
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, name) for name in op.overloads()]
    return any(o._schema.is_mutable or not o._schema.returns for o in overloads)


def op_writes_count(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many times ``gm`` calls each torch op that may write (:func:`_op_writes`: split ops such as attention,
    custom ops writing an argument): a restored graph must call them exactly as Dynamo's did, whatever FX's
    dead-code pass thought of them on the torch at hand (:func:`piecegraph.graphed.build` refuses the snapshot else)."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                and _op_writes(target):
            name = str(target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target)
            counts[name] = counts.get(name, 0) + 1
    return counts


def restore_graph(snapshot: GraphSnapshot) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph of ``snapshot`` with fresh fakes on its nodes (``meta["example_value"]``, symbolic token
    counts in a new shape env: rebuilt from the snapshot's value specs, or propagated through the graph where it
    has none) and the placeholders' fakes, in order. Raises ``ValueError`` on a snapshot of
    another format."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if snapshot.format != FORMAT:
        raise ValueError(f"a graph snapshot of format {snapshot.format}, not {FORMAT}")
    gm = pickle.loads(snapshot.code)
    # FX names the regenerated nodes anew (after their targets, not Dynamo's variables): match them by position,
    # and refuse a graph that did not come back node for node (before any fake is propagated through it).
    kept = pickle.loads(snapshot.node_meta)
    nodes = list(gm.graph.nodes)
    if len(kept) != len(nodes):
        raise ValueError("the graph did not come back from its code node for node")
    for (op, target, _), node in zip(kept, nodes):
        if (op, target) == (node.op, _target(node)):
            continue
        inplace = _INPLACE_BY_NAME.get(target)
        if op != node.op or inplace is None or node.target is not _INPLACE_OPERATORS[inplace]:
            raise ValueError("the graph did not come back from its code node for node")
        node.target = inplace  # x += y stays in place (it may write a tensor others alias)
    gm.recompile()
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols: dict[str, Any] = {}
    for name in sorted(snapshot.hints):  # a fixed order: the same symbols on every start
        hint = snapshot.hints[name]
        symbol = env.create_symbol(hint, ConstantSource(f"piecegraph_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
        symbols[name] = env.create_symintnode(symbol, hint=hint)
    fakes: list[Any] = []
    with mode:
        for entry in snapshot.placeholders:
            if entry.symbol is not None:
                fakes.append(symbols[entry.symbol])
                continue
            shape = [symbols[s] if isinstance(s, str) else s for s in entry.shape]
            fakes.append(torch.empty(shape, dtype=entry.dtype, device=entry.device).requires_grad_(
                entry.requires_grad))
    if not _put_back_values(snapshot, nodes, env, mode, symbols):
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for node, entry, fake in zip(placeholders, snapshot.placeholders, fakes):
        node.meta["example_value"] = fake
        node.meta.setdefault("val", fake.detach() if isinstance(fake, torch.Tensor) else fake)  # as propagated
        node.meta["grapharg"] = _Arg(_Source(entry.source))
        if entry.module_state:
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    for node, (_, _, meta) in zip(nodes, kept):
        node.meta.update(meta)
        if node.op != "placeholder" and "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])
    return gm, fakes


def _put_back_values(snapshot: GraphSnapshot, nodes: list[torch.fx.Node], env: Any, mode: Any,
                     symbols: dict[str, Any]) -> bool:
    """The nodes' values as traced, from the snapshot's specs (no run of the graph on fakes); False when it has
    none that fit, or one could not be rebuilt: then the caller propagates fakes instead."""
    specs = pickle.loads(snapshot.values) if snapshot.values else None
    if specs is None or len(specs) != len(nodes):
        return False
    try:
        ValueBuilder(env, mode, symbols, snapshot.hints).put_back(nodes, specs)
    except Exception as err:  # noqa: BLE001  (the propagation that follows overwrites what was put back)
        log.info("piecegraph: the snapshot's values could not be rebuilt (%s: %s); propagating fakes",
                 type(err).__name__, err)
        return False
    return True


def _target(node: torch.fx.Node) -> str:
    """What a node calls, comparable across processes (a placeholder's target is its name: not compared)."""
    if node.op == "placeholder":
        return ""
    target = node.target
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


@dataclass
class _Source:
    name: str


@dataclass
class _Arg:
    """What :mod:`~piecegraph.trace.inputs` reads of Dynamo's ``GraphArg``: the source's name."""

    source: _Source
    example: Any = None
    fake_tensor: Any = None
