"""Capture stage of the doctor: capture each piece alone; on failure, bisect its nodes to the op that breaks it.

Each graph Dynamo traced is split at split ops (as piecegraph does); every compute piece is run once eagerly
(warm-up) and then captured alone into a CUDA graph on the inputs it received in the probed forward. A piece that
fails is bisected: prefixes of its node list are captured until the shortest failing prefix is found, whose last
node is the culprit (assumes a prefix that contains a breaking op fails, which holds for capture errors). The
reason is named from the op and CUDA's text: device sync, ``.item()``/copy to host, pinned or host allocation,
allocation outside the pool, unjoined side stream, RNG state, else CUDA's own words.

Constraints: CUDA only (on CPU only the pieces are counted); the probe forward runs with
``torch._dynamo.config.capture_scalar_outputs = True`` so that ``.item()`` lands inside a piece, where capture
would meet it; a failed capture is ended cleanly by torch, but a kernel that corrupts memory cannot be probed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.split import split_op_names
from piecegraph.trace.split import split_graph

from ..graphs.capture import repair_rng_after_failed_capture
from .trace import quiet_recompile_limit

__all__ = ["CaptureFailure", "probe_graph", "probe_model", "count_pieces", "why_capture_fails"]

_SYNC = ("synchronize", "cudadevicesynchronize", "cudastreamsynchronize")
_HOST = ("item", "_local_scalar_dense", "tolist", "cpu", "numpy", "nonzero", "masked_select")
_RNG = ("rand", "randn", "randint", "dropout", "bernoulli", "normal", "multinomial", "uniform")


@dataclass
class CaptureFailure:
    """A piece that cannot be captured, and the node that breaks it (None when bisection found none)."""

    piece: str
    node: Optional[str]  # FX node name, e.g. "item" or "synchronize"
    target: str  # what the node calls, e.g. "torch.cuda.synchronize" or "Tensor.item"
    why: str
    error: str  # CUDA's / torch's own text, first lines
    location: str  # user file:line that produced the node ("?" when FX kept no stack)


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if isinstance(t, str):
        return t
    module = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    return f"{module}.{name}" if module and not module.startswith("torch._ops") else str(t)


def _location(node: torch.fx.Node) -> str:
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{found[-1][0]}:{found[-1][1]}" if found else "?"


def why_capture_fails(target: str, error: str, kwargs: Optional[dict] = None) -> str:
    """The named reason for a capture failure at an op calling ``target`` with CUDA's text ``error``."""
    low, err, kwargs = target.lower(), error.lower(), kwargs or {}
    leaf = low.rsplit(".", 1)[-1]
    if any(s in low for s in _SYNC) or "synchronize" in err:
        return "device sync (synchronize during capture)"
    if leaf in _HOST or "_local_scalar_dense" in low or (leaf in ("to", "copy_") and "cpu" in str(kwargs)):
        return ".item() / copy to host (waits for the device)"
    if "not permitted when stream is capturing" in err:  # cudaErrorStreamCaptureUnsupported: something waited
        return "device sync (an operation that waits for the device: synchronize, a host copy, an event query)"
    if "pin_memory" in low or kwargs.get("pin_memory") or str(kwargs.get("device", "")) == "cpu":
        return "pinned or host allocation"
    if "unjoined" in err or "isolation" in err:
        return "unjoined side stream (work on another stream not joined back before capture ended)"
    if leaf in _RNG or "generator" in err or "philox" in err or "rng" in err:
        return "RNG state (a generator not registered with the graph)"
    if "cudamalloc" in err or "out of memory" in err or "allocat" in err:
        return "allocation outside the pool"
    return "CUDA error: " + (error.strip().splitlines() or ["unknown"])[0][:200]


def _error_text(err: BaseException) -> str:
    parts, seen = [], set()
    while err is not None and id(err) not in seen:  # capture_end's error hides the op's own: keep both
        seen.add(id(err))
        parts.append(f"{type(err).__name__}: {str(err).strip()}")
        err = err.__context__ or err.__cause__
    return "\n".join(parts)[:2000]


def _try_capture(fn: Callable, args: list) -> Optional[str]:
    """None when ``fn(*args)`` runs and captures; else the error text (warm-up errors included)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph users must
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except Exception as err:
        return "warm-up: " + _error_text(err)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn(*args)
        return None
    except Exception as err:
        repair_rng_after_failed_capture()
        return _error_text(err)
    finally:
        del graph
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky error would show in the next attempt's text anyway
            pass


def _prefix(gm: torch.fx.GraphModule, k: int) -> torch.fx.GraphModule:
    """``gm`` cut after its ``k``-th compute node; the output is that node's value."""
    graph, env = torch.fx.Graph(), {}
    compute = 0
    last = None
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op not in ("placeholder", "get_attr"):
            if compute == k:
                break
            compute += 1
        env[node] = last = graph.node_copy(node, lambda n: env[n])
    graph.output(last)
    return torch.fx.GraphModule(gm, graph)


def _bisect(gm: torch.fx.GraphModule, args: list) -> tuple[Optional[torch.fx.Node], str]:
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    lo, hi, error = 1, len(nodes), ""
    while lo < hi:
        mid = (lo + hi) // 2
        err = _try_capture(_prefix(gm, mid), args)
        if err is None:
            lo = mid + 1
        else:
            hi, error = mid, err
    if not error:
        error = _try_capture(_prefix(gm, lo), args) or ""
    return (nodes[lo - 1] if nodes and error else None), error


def _piece_inputs(split_gm: torch.fx.GraphModule, args: list) -> dict[str, list]:
    seen: dict[str, list] = {}

    class _Recorder(torch.fx.Interpreter):
        def call_module(self, target: Any, a: Any, kw: Any) -> Any:
            seen.setdefault(target, list(a))
            return super().call_module(target, a, kw)

    with torch.no_grad():
        _Recorder(split_gm).run(*args)
    return seen


def count_pieces(gm: torch.fx.GraphModule) -> int:
    """Compute pieces (not split ops, not empty) after splitting ``gm`` at the registered split ops."""
    _, infos = split_graph(gm, split_op_names())
    return sum(1 for i in infos if i.compiled)


def probe_graph(gm: torch.fx.GraphModule, args: list) -> tuple[int, list[CaptureFailure]]:
    """Split ``gm``, capture each compute piece alone on CUDA; return (pieces, failures). See the module doc."""
    split_gm, infos = split_graph(gm, split_op_names())
    inputs = _piece_inputs(split_gm, args)
    failures = []
    for info in infos:
        if info.is_split or info.num_ops == 0 or info.name not in inputs:
            continue
        piece = getattr(split_gm, info.name)
        if _try_capture(piece, inputs[info.name]) is None:
            continue
        node, error = _bisect(piece, inputs[info.name])
        target = _target_name(node) if node is not None else info.name
        why = why_capture_fails(target, error, dict(node.kwargs) if node is not None else None)
        failures.append(CaptureFailure(info.name, node.name if node is not None else None, target, why,
                                       error[:500], _location(node) if node is not None else "?"))
    return sum(1 for i in infos if i.compiled), failures


def probe_model(model: Callable, args: tuple, kwargs: Optional[dict] = None, context: Any = None
                ) -> tuple[int, list[CaptureFailure]]:
    """Trace ``model`` (breaks allowed), then :func:`probe_graph` every graph on the inputs it really got."""
    from piecegraph.diagnose.trace import run_under

    runs: list[tuple[torch.fx.GraphModule, list]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        def first_call(*a: Any) -> Any:
            if len(runs) < 64 and not any(g is gm for g, _ in runs):
                runs.append((gm, list(a)))
            return gm.forward(*a)

        return first_call

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=True), quiet_recompile_limit():
            run_under(context, lambda: torch.compile(model, backend=backend)(*args, **(kwargs or {})))
    finally:
        torch._dynamo.reset()
    pieces, failures = 0, []
    for gm, real_args in runs:  # split ops inside the pieces' inputs run for real: under the model's context
        n, found = run_under(context, lambda gm=gm, real_args=real_args: probe_graph(gm, real_args))
        pieces += n
        failures += found
    return pieces, failures
