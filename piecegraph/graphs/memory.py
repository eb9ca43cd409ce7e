"""Graph memory known before capture: an estimate of the shared pool per capture size, from the traced graph.

Sizes are captured largest first into one pool, and each size's intermediates are freed (the pieces keep only
weak aliases) before the next size captures, so the pool is the largest size's need; smaller sizes reuse it.
One size's need is simulated on the traced graph with the token count set to that size: in graph order each
op that allocates adds its output's bytes, and a value is freed after its last use (FX and Inductor both free
there); views allocate nothing and keep their base alive. Which ops allocate depends on the compiler: with
``"eager"`` every op that is not a view; with Inductor only what it materializes (outputs of kernels it calls
rather than generates: matmuls, convolutions, custom ops; values those read; values that cross a split op;
the graph's outputs), since pointwise chains and reductions fuse into one kernel without an intermediate.
Split ops run eagerly outside the graphs (``piecewise``): their own allocations are not in the pool; inside a
``full`` graph their workspaces are unknown here (not counted). Then the caching allocator's rounding: blocks of
512 bytes; blocks up to 1 MiB share 2 MiB segments, blocks under 10 MiB 20 MiB segments, larger blocks get
their own segment rounded to 2 MiB; a graph pool never returns a segment, so each kind needs its peak.

Library workspaces: torch keeps one cuBLAS workspace per (handle, stream), allocated through the caching
allocator on first use; the first matmul captured on the capture stream allocates it inside the pool
(``CUBLAS_WORKSPACE_CONFIG``, by default 32 MiB on Hopper and newer, ~8 MiB before): counted once, alive
throughout, when the graph has a matmul and CUDA is there (``workspace_bytes``). Not counted: other libraries'
workspaces and fragmentation. ``stats()["graph_memory"]`` puts the estimate next to the measured pool.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

MiB = 2**20
SMALL, MID = 1 * MiB, 10 * MiB  # the caching allocator's kSmallSize and kMinLargeAlloc
SMALL_SEGMENT, MID_SEGMENT, ROUND_LARGE = 2 * MiB, 20 * MiB, 2 * MiB

_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "unsqueeze",
    "squeeze", "flatten", "unflatten", "narrow", "split", "chunk", "unbind", "t", "__getitem__", "detach",
    "contiguous", "movedim", "select", "as_strided", "diagonal", "size", "dim", "stride", "numel",
})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
    torch.flatten, torch.narrow, torch.split, torch.chunk, torch.unbind, torch.t, torch.select, torch.movedim,
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.contiguous, torch.Tensor.expand,
})
_MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "tensordot"})
# Ops Inductor calls as external kernels: their outputs (and inputs) are real buffers.
_EXTERN = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d", "convolution", "einsum",
    "scaled_dot_product_attention", "_scaled_mm", "matmul_", "tensordot", "sort", "topk", "cumsum",
})


@dataclass
class GraphMemory:
    """Estimated bytes per capture size: ``live`` (tensors alive at the peak, exact bytes) and ``pool`` (what
    the caching allocator reserves for them); ``pool_bytes`` is the shared pool's estimate (the largest
    size's)."""

    live: dict[int, int] = field(default_factory=dict)
    pool: dict[int, int] = field(default_factory=dict)
    workspace_bytes: int = 0  # of pool: the cuBLAS workspace (see the module's docstring)

    @property
    def pool_bytes(self) -> int:
        return max(self.pool.values(), default=0)

    def fitting(self, limit: int) -> tuple[list[int], list[int]]:
        """``(sizes that fit under limit, sizes that do not)``, ascending. The pool of the sizes kept is the
        largest kept one's, so a size fits when its own pool does."""
        keep = sorted(s for s, b in self.pool.items() if b <= limit)
        return keep, sorted(set(self.pool) - set(keep))


def estimate_graph_memory(gm: torch.fx.GraphModule, token_symbols: Iterable[Any], sizes: Iterable[int],
                          split_names: frozenset[str], compiler: str, mode: str,
                          workspace: int | None = None) -> GraphMemory:
    """The :class:`GraphMemory` of ``gm`` (a Dynamo graph whose nodes carry fake values, the token count
    symbolic as ``token_symbols``) at each of ``sizes``. See the module's docstring for the model. ``workspace``:
    the cuBLAS workspace's bytes (default: :func:`cublas_workspace_bytes` when the graph has a matmul)."""
    from ..ops.split import node_op_name

    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    is_split = {n: node_op_name(n) in split_names for n in nodes}
    piece = _pieces(nodes, is_split)
    views = {n: _is_view(n) for n in nodes}
    allocates = {n: not views[n] and not (is_split[n] and mode != "full") for n in nodes}
    if compiler == "inductor":
        allocates = {n: a and _materialized(n, views, is_split, piece) for n, a in allocates.items()}
    last = _last_uses(gm, nodes, views)
    numel = _Numel(list(token_symbols))
    counts = {n: numel.counts(n.meta.get("example_value", n.meta.get("val"))) for n in nodes if allocates[n]}
    if workspace is None:
        workspace = cublas_workspace_bytes() if any(_name(n) in _MATMULS for n in nodes) else 0
    out = GraphMemory(workspace_bytes=workspace)
    for size in sorted(set(sizes)):
        blocks = {n: sum(numel.count(c, size) * item for c, item in parts) for n, parts in counts.items()}
        out.live[size], out.pool[size] = simulate(nodes, blocks, last, workspace)
    return out


def simulate(order: list[Any], blocks: dict[Any, int], last: dict[Any, int], resident: int = 0
             ) -> tuple[int, int]:
    """``(peak live bytes, pool bytes)`` of allocating ``blocks[n]`` at each ``n`` of ``order`` and freeing it
    after position ``last[n]``; ``resident`` bytes are held throughout (in the pool only: not live bytes)."""
    live = {"small": 0, "mid": 0, "large": 0}
    if resident:
        kind, size = block_kind(resident)
        live[kind] += size
    peak = dict(live)
    kind_of: dict[Any, tuple[str, int]] = {}
    peak_total = total = 0
    frees: dict[int, list[Any]] = {}
    for n in blocks:
        frees.setdefault(last.get(n, len(order)), []).append(n)
    for i, n in enumerate(order):
        if blocks.get(n):
            kind, size = block_kind(blocks[n])
            kind_of[n] = (kind, size)
            live[kind] += size
            peak[kind] = max(peak[kind], live[kind])
            total += blocks[n]
            peak_total = max(peak_total, total)
        for done in frees.get(i, ()):
            if done in kind_of:
                kind, size = kind_of.pop(done)
                live[kind] -= size
                total -= blocks[done]
    return peak_total, pool_for(peak)


def block_kind(nbytes: int) -> tuple[str, int]:
    """The allocator's class of a request and its rounded size (512-byte blocks; 2 MiB multiples above 10 MiB)."""
    rounded = max(512, math.ceil(nbytes / 512) * 512)
    if rounded <= SMALL:
        return "small", rounded
    if rounded < MID:
        return "mid", rounded
    return "large", math.ceil(rounded / ROUND_LARGE) * ROUND_LARGE


def pool_for(peak: dict[str, int]) -> int:
    """Segments reserved for the peak of each class: 2 MiB segments for small blocks, 20 MiB for mid ones,
    large blocks as rounded."""
    small = math.ceil(peak["small"] / SMALL_SEGMENT) * SMALL_SEGMENT
    mid = math.ceil(peak["mid"] / MID_SEGMENT) * MID_SEGMENT
    return small + mid + peak["large"]


def cublas_workspace_bytes() -> int:
    """torch's cuBLAS workspace per (handle, stream): ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` pairs,
    summed), else its default: 4096 KiB x 8 on compute capability 9.0 and newer, 4096 KiB x 2 + 16 KiB x 8
    before. 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    import os
    import re

    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(kib) * 1024 * int(count) for kib, count in pairs)
    major, _ = torch.cuda.get_device_capability()
    return 4096 * 1024 * 8 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def _pieces(nodes: list[Any], is_split: dict[Any, bool]) -> dict[Any, int]:
    """Each node's piece, numbered as trace/split.py cuts them (a split op alone between two pieces)."""
    out, current = {}, 0
    for n in nodes:
        if is_split[n]:
            out[n] = current + 1
            current += 2
        else:
            out[n] = current
    return out


def _name(node: Any) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    name = getattr(target, "__name__", None) or str(target)
    return name.split("::")[-1].split(".")[0]


def _is_view(node: Any) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS or (node.target in ("to", "type_as", "float", "half") and
                                                _same_dtype(node))
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS or (_name(node) == "to" and _same_dtype(node))
    return False


def _same_dtype(node: Any) -> bool:
    first = node.args[0] if node.args else None
    src = getattr(first, "meta", {}).get("example_value") if isinstance(first, torch.fx.Node) else None
    dst = node.meta.get("example_value")
    return isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dtype == dst.dtype


def _is_extern(node: Any) -> bool:
    return _name(node) in _EXTERN or (node.op == "call_function" and isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and "aten" not in str(node.target))


def _materialized(node: Any, views: dict[Any, bool], is_split: dict[Any, bool], piece: dict[Any, int]) -> bool:
    """Whether Inductor gives ``node`` a buffer: an extern kernel's output, a value an extern kernel or split op
    reads (through views), one used in another piece, or a graph output."""
    if _is_extern(node) or is_split.get(node):
        return True
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output" or user not in piece or piece[user] != piece[node]:
            return True
        if views.get(user):
            stack.extend(user.users)
        elif _is_extern(user) or is_split.get(user):
            return True
    return False


def _last_uses(gm: torch.fx.GraphModule, nodes: list[Any], views: dict[Any, bool]) -> dict[Any, int]:
    """Position after which each node's memory is free: its last use, or a view of it's last use; the graph's
    outputs are kept to the end."""
    pos = {n: i for i, n in enumerate(nodes)}
    base: dict[Any, Any] = {}
    for n in nodes:
        first = next((a for a in n.args if isinstance(a, torch.fx.Node)), None) if views[n] else None
        base[n] = base.get(first, first) if first is not None and first in pos else n
    last = {n: pos[n] for n in nodes}
    for n in nodes:
        root = base[n]
        for user in n.users:
            at = len(nodes) if user.op == "output" else pos.get(user, pos[n])
            last[root] = max(last[root], at)
    return last


class _Numel:
    """Bytes of a fake value at a token count. A graph has a few distinct symbolic element counts, repeated
    over its layers: each is numbered once and evaluated once per size (sympy is slow)."""

    def __init__(self, symbols: list[Any]):
        self.symbols = symbols
        self.index: dict[Any, int] = {}
        self.exprs: list[Any] = []
        self.values: dict[tuple[int, int], int] = {}

    def counts(self, value: Any) -> list[tuple[Any, int]]:
        """``(element count, bytes per element)`` of each tensor in a fake value, the count an int or the
        number of a symbolic expression (``("sym", i)``)."""
        if isinstance(value, (tuple, list)):
            return [c for v in value for c in self.counts(v)]
        if not isinstance(value, torch.Tensor):
            return []
        numel = value.numel()
        if not isinstance(numel, torch.SymInt):
            return [(int(numel), value.element_size())]
        expr = numel.node.expr
        if expr not in self.index:
            self.index[expr] = len(self.exprs)
            self.exprs.append(expr)
        return [(("sym", self.index[expr]), value.element_size())]

    def count(self, numel: Any, size: int) -> int:
        if isinstance(numel, int):
            return numel
        key = (numel[1], size)
        if key not in self.values:
            import sympy

            expr = self.exprs[numel[1]].xreplace({s: sympy.Integer(size) for s in self.symbols})
            self.values[key] = int(expr) if expr.is_Integer else 0  # another dynamic dim: not piecegraph's
        return self.values[key]


def measured_pool_bytes(run: Callable[[], Any]) -> int | None:
    """Bytes the caching allocator reserves for ``run()``'s allocations in a private pool of their own
    (``torch.cuda.MemPool``): the same allocator, rounding and block reuse as a graph pool, so an eager run of a
    capture size before its capture measures what the capture will take, whatever Inductor materializes (the
    estimate above models it, and missed an FP8 MoE's float32 buffers 2.3x). ``run``'s outputs are dropped; the
    pool is released (its segments go back at the allocator's next ``empty_cache`` or out-of-memory retry). Not
    in the pool: a cuBLAS workspace the run's stream already has (add the estimate's ``workspace_bytes``).
    ``None`` without CUDA, where this torch has no ``MemPool``, or where the allocator refuses one (another
    allocator backend): the capture then goes on unmeasured, as before (logged)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "use_mem_pool"):
        return None
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            out = run()
        del out
    except Exception as err:  # noqa: BLE001  (the same run just passed as a warm-up: this is the pool's failure)
        import logging

        logging.getLogger("piecegraph").info("piecegraph: graph memory not measured before capture (%s: %s)",
                                             type(err).__name__, err)
        return None
    from .capture import pool_bytes

    return pool_bytes(pool.id)


class GraphMemoryError(RuntimeError):
    """No capture size fits under ``Config.graph_memory_limit``."""


def fit_sizes(memory: GraphMemory, sizes: Iterable[int], limit: int) -> tuple[tuple[int, ...], str | None]:
    """The capture sizes whose estimated pool fits under ``limit`` (a warning names those left out, which run
    without graphs), and ``None``; or no size and the refusal's message, when even the smallest does not fit."""
    sizes = tuple(sorted(sizes))
    over = [s for s in sizes if memory.pool.get(s, 0) > limit]
    keep = tuple(s for s in sizes if s not in over)
    if not over:
        return keep, None
    needs = ", ".join(f"{s}: {_gib(memory.pool[s])}" for s in over[:6]) + (", ..." if len(over) > 6 else "")
    if not keep:
        return (), (f"piecegraph: Config(graph_memory_limit={limit} bytes, {_gib(limit)}): no capture size fits; "
                    f"the estimated graph pool per size is {needs}. Raise graph_memory_limit, or capture smaller "
                    "sizes (capture_sizes=... or a lower max_tokens); graphs/memory.py says how it is estimated")
    import warnings

    warnings.warn(f"piecegraph: Config(graph_memory_limit={_gib(limit)}): capture sizes {over} need an estimated "
                  f"graph pool over the limit ({needs}); they run without graphs. Kept sizes up to {keep[-1]} "
                  f"(pool ~{_gib(memory.pool[keep[-1]])}).", stacklevel=3)
    return keep, None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.1f} MiB"
