"""The modes the benchmark compares, each built into a callable with its setup (compile + capture) timed.

| mode | what runs |
|---|---|
| eager | the model as written |
| full | piecegraph ``mode="full"``, ``compiler="eager"``: the traced ops, whole graph captured (decode only) |
| full-compiled | piecegraph ``mode="full"``, Inductor: the best case for decode |
| full-static | full-compiled, ``compile_sizes="auto"``: each size also compiled static, kept where it ran faster |
| full-pieces | full-compiled, ``full_compile="pieces"``: the pieces between split ops compiled, each distinct once |
| piecewise | piecegraph ``mode="piecewise"``, Inductor: graphs between attention calls, attention eager |
| piecewise-static | piecewise, ``compile_sizes="auto"``: each size also compiled static, kept where it ran faster |
| breakable | piecegraph ``mode="breakable"``: eager forward captured in segments, no Dynamo (when it exists) |
| auto | what the engine's auto runs: piecegraph ``mode="auto"``, decode steps on a full graph where measured faster |
| none | piecegraph ``mode="none"``: compiled pieces, no graphs (the CPU mode) |
| torch.compile | ``torch.compile(model)``, default mode |
| reduce-overhead | ``torch.compile(model, mode="reduce-overhead")``: Inductor's CUDA graph trees |
| graph-partition | reduce-overhead with Inductor graph partition cut at the attention op (PyTorch's piecewise) |
| baked-graph | ``torch.compile(model)`` captured whole per case, layout and plan baked in: piecewise's lower bound |
| meta-pcg | Meta's ``piecewise_cuda_graphs`` with attention as ``@no_graph`` (when installed) |

``reduce-overhead`` runs with this torch's Inductor defaults (recorded as ``env.inductor_graph_partition``):
recent torch (2.13 here) turns ``graph_partition`` on by default, but it then cuts only at CUDA-graph-unsafe
ops (CPU ops, tagged custom ops), so the attention op is still recorded inside the graphs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import piecegraph
from piecegraph.bench import meta_pcg
from piecegraph.bench.auto_mode import prepare_auto
from piecegraph.bench.baked import NOTE as BAKED_NOTE
from piecegraph.bench.baked import BakedGraph
from piecegraph.bench.harness import sync
from piecegraph.graphs.capture import release_compiled

# Slowest to compile last: a sweep cut short by a time limit loses the baselines, not piecegraph's modes.
GPU_MODES = ("eager", "full", "full-compiled", "full-static", "full-pieces", "piecewise", "piecewise-static",
             "breakable", "auto", "meta-pcg", "torch.compile", "reduce-overhead", "graph-partition", "baked-graph")
CPU_MODES = ("eager", "none")
KNOWN_MODES = GPU_MODES + ("none",)
_GRAPHED = ("full", "full-compiled", "full-static", "full-pieces", "piecewise", "piecewise-static", "breakable",
            "auto", "meta-pcg", "reduce-overhead", "graph-partition", "baked-graph")

FULL_PREFILL = ("a full graph captures pure decode steps only (token-aligned metadata); a varlen prefill's layout "
                "is host metadata, so it needs piecewise (piecegraph rejects it)")
REDUCE_OVERHEAD_PREFILL = ("attention op recorded inside the graph: replays reuse the metadata tensors of the "
                           "recording step (slots, page tables, masks); correct only while that step repeats (a "
                           "server would get wrong results)")
REDUCE_OVERHEAD_DECODE = ("attention op recorded inside the graph: replays read the recording step's metadata tensors "
                          "(the bench keeps them; a server's next step builds new ones, which replays would not see)")
GRAPH_PARTITION_PREFILL = ("attention runs eagerly between the partitions' graphs and reads this step's metadata at "
                           "call time: valid for any layout of this token count (graphs recorded per token count)")
# Inductor graph partition, cut at the attention op (torch._inductor.config; custom_should_partition_ops arrived
# after torch 2.9.0). Patched for the graph-partition mode's whole life, compile and calls, then restored.
GRAPH_PARTITION_CONFIG: dict[str, Any] = {
    "graph_partition": True,
    "custom_should_partition_ops": ["piecegraph_models::attention"],
}
# Both CUDA-graph-tree modes compile with torch.compile's default (dynamic after the first new size), so their
# rows differ only in the partition.
_DYNAMIC: bool | None = None


@dataclass
class Prepared:
    """A mode ready to time: ``fn(input_ids, positions)`` under a forward context.

    ``warm_calls`` first calls per case are setup, not steady state (``torch.compile`` compiles, CUDA graph
    trees record on them); their seconds are added to ``setup_s`` by the sweep.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    setup_s: float = 0.0
    stats: Callable[[], dict[str, Any]] = field(default=dict)
    warm_calls: int = 0
    prefill_skip: str | None = None
    prefill_note: str | None = None
    decode_note: str | None = None
    close: Callable[[], None] = field(default=lambda: None)  # undo what prepare() changed (config patches)


def has_breakable() -> bool:
    """Whether this piecegraph has ``mode="breakable"`` (built in parallel; absent in older versions)."""
    try:
        piecegraph.Config(mode="breakable")
    except ValueError:
        return False
    return True


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot run in this process (a skipped row's reason), or ``None`` when it can."""
    if name not in KNOWN_MODES:
        raise ValueError(f"unknown bench mode {name!r}; choose from {', '.join(KNOWN_MODES)}")
    if name == "breakable" and not has_breakable():
        return "this piecegraph has no mode='breakable'"
    if name == "meta-pcg":
        return meta_pcg.available()
    if name == "graph-partition" and (reason := graph_partition_missing()):
        return reason
    if name in _GRAPHED and not torch.cuda.is_available():
        return "captures CUDA graphs: needs a GPU"
    return None


def graph_partition_missing() -> str | None:
    """Why this torch has no Inductor graph partition at custom ops (the missing config names), or ``None``."""
    import torch._inductor.config as inductor_config

    missing = [key for key in GRAPH_PARTITION_CONFIG if not hasattr(inductor_config, key)]
    if not missing:
        return None
    return (f"torch {torch.__version__} has no torch._inductor.config.{', '.join(missing)} "
            "(Inductor graph partition at named custom ops came after torch 2.9.0)")


def _graph_partition(model: torch.nn.Module) -> Prepared:
    """reduce-overhead with the graph cut at the attention op; :attr:`Prepared.close` restores the config.

    ``torch.compile`` compiles lazily (on the first calls, and again on recompiles), so the patch must hold
    through the calls too, not only around ``torch.compile``.
    """
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(GRAPH_PARTITION_CONFIG))
    try:
        fn = torch.compile(model, mode="reduce-overhead", dynamic=_DYNAMIC)
    except BaseException:
        stack.close()
        raise
    return Prepared("graph-partition", fn, warm_calls=3, prefill_note=GRAPH_PARTITION_PREFILL, close=stack.close)


def _graphed(model: torch.nn.Module, mode: str, compiler: str, sizes: Sequence[int],
             make_inputs: Callable[[int], Any], **options: Any) -> tuple[Any, float]:
    """A GraphedModule with every size in ``sizes`` traced, compiled and captured now; returns it and seconds."""
    kwargs: dict[str, Any] = {"mode": mode, "capture_sizes": tuple(sizes), **options}
    if mode != "breakable":
        kwargs["compiler"] = compiler
    if mode in ("piecewise", "full"):  # a library kernel nobody adapted (FP8 GEMMs) is wrapped, as auto does
        kwargs.setdefault("auto_opaque", True)
    sync()
    start = time.perf_counter()
    graphed = piecegraph.compile(model, **kwargs)
    graphed.capture(make_inputs)
    sync()
    return graphed, time.perf_counter() - start


def prepare(name: str, model: torch.nn.Module, decode_sizes: Sequence[int], prefill_sizes: Sequence[int],
            make_inputs: Callable[[int], Any]) -> Prepared:
    """Build mode ``name``; graphed modes capture every bench size they will run (decode + prefill).

    Full-graph modes capture only the decode batches: their prefill rows are skipped (see ``FULL_PREFILL``).
    Call the result's ``close()`` once its calls are done (``graph-partition`` patches Inductor's config).
    """
    every = tuple(sorted(set(decode_sizes) | set(prefill_sizes)))
    if name == "eager":
        return Prepared(name, model)
    if name in ("full", "full-compiled"):
        compiler = "eager" if name == "full" else "inductor"
        graphed, seconds = _graphed(model, "full", compiler, decode_sizes, make_inputs)
        return Prepared(name, graphed, seconds, graphed.stats, prefill_skip=FULL_PREFILL)
    if name in ("full-static", "full-pieces"):
        extra = {"compile_sizes": "auto"} if name == "full-static" else {"full_compile": "pieces"}
        graphed, seconds = _graphed(model, "full", "inductor", decode_sizes, make_inputs, **extra)
        return Prepared(name, graphed, seconds, graphed.stats, prefill_skip=FULL_PREFILL)
    if name in ("piecewise", "none", "breakable"):
        graphed, seconds = _graphed(model, name, "inductor", every, make_inputs)
        return Prepared(name, graphed, seconds, graphed.stats)
    if name == "piecewise-static":
        graphed, seconds = _graphed(model, "piecewise", "inductor", every, make_inputs, compile_sizes="auto")
        return Prepared(name, graphed, seconds, graphed.stats)
    if name == "auto":
        auto, seconds = prepare_auto(model, decode_sizes, prefill_sizes, make_inputs)
        return Prepared(name, auto, seconds, auto.stats)
    if name == "torch.compile":
        return Prepared(name, torch.compile(model), warm_calls=2)
    if name == "reduce-overhead":
        # Three first calls: warm-up, record, first replay (CUDA graph trees record on the second call).
        return Prepared(name, torch.compile(model, mode="reduce-overhead", dynamic=_DYNAMIC), warm_calls=3,
                        prefill_note=REDUCE_OVERHEAD_PREFILL, decode_note=REDUCE_OVERHEAD_DECODE)
    if name == "graph-partition":
        return _graph_partition(model)
    if name == "baked-graph":
        baked = BakedGraph(model)
        return Prepared(name, baked, stats=baked.stats, warm_calls=1, prefill_note=BAKED_NOTE, decode_note=BAKED_NOTE)
    if name == "meta-pcg":
        runner = meta_pcg.MetaPiecewise(model, every)
        sync()
        start = time.perf_counter()
        runner.capture(make_inputs)
        sync()
        return Prepared(name, runner, time.perf_counter() - start, runner.stats)
    raise ValueError(f"unknown bench mode {name!r}; choose from {', '.join(KNOWN_MODES)}")


def release() -> None:
    """Free the last mode's graphs and compiled code (drop your references first), so each mode starts alike;
    Dynamo's caches are reset too: without that, torch.compile modes share recompile budgets and cache."""
    release_compiled()
