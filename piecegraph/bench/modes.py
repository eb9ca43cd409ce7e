"""The modes the benchmark compares, each built into a callable with its setup (compile + capture) timed.

| mode | what runs |
|---|---|
| eager | the model as written |
| full | piecegraph ``mode="full"``, ``compiler="eager"``: the traced ops, whole graph captured (decode only) |
| full-compiled | piecegraph ``mode="full"``, Inductor: the best case for decode |
| piecewise | piecegraph ``mode="piecewise"``, Inductor: graphs between attention calls, attention eager |
| breakable | piecegraph ``mode="breakable"``: eager forward captured in segments, no Dynamo (when it exists) |
| none | piecegraph ``mode="none"``: compiled pieces, no graphs (the CPU mode) |
| torch.compile | ``torch.compile(model)``, default mode |
| reduce-overhead | ``torch.compile(model, mode="reduce-overhead")``: Inductor's CUDA graph trees |
| meta-pcg | Meta's ``piecewise_cuda_graphs`` with attention as ``@no_graph`` (when installed) |
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

import piecegraph
from piecegraph.bench import meta_pcg
from piecegraph.bench.harness import sync

# Slowest to compile last: a sweep cut short by a time limit loses the baselines, not piecegraph's modes.
GPU_MODES = ("eager", "full", "full-compiled", "piecewise", "breakable", "meta-pcg", "torch.compile", "reduce-overhead")
CPU_MODES = ("eager", "none")
KNOWN_MODES = GPU_MODES + ("none",)
_GRAPHED = ("full", "full-compiled", "piecewise", "breakable", "meta-pcg", "reduce-overhead")

FULL_PREFILL = ("a full graph bakes host metadata (seq_bounds) into the graph; varlen prefill needs piecewise "
                "(piecegraph rejects the changed layout)")
REDUCE_OVERHEAD_PREFILL = ("graph recorded with this layout's host metadata baked in: correct only while the layout "
                           "repeats (a server would get wrong results)")


@dataclass
class Prepared:
    """A mode ready to time: ``fn(input_ids, positions)`` under a forward context.

    ``warm_calls`` first calls per case are setup, not steady state (``torch.compile`` compiles, CUDA graph
    trees record on them); their seconds are added to ``setup_s`` by the sweep.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    setup_s: float = 0.0
    stats: Callable[[], dict[str, Any]] = field(default=lambda: {})
    warm_calls: int = 0
    prefill_skip: str | None = None
    prefill_note: str | None = None


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
    if name in _GRAPHED and not torch.cuda.is_available():
        return "captures CUDA graphs: needs a GPU"
    return None


def _graphed(model: torch.nn.Module, mode: str, compiler: str, sizes: Sequence[int],
             make_inputs: Callable[[int], Any]) -> tuple[Any, float]:
    """A GraphedModule with every size in ``sizes`` traced, compiled and captured now; returns it and seconds."""
    kwargs: dict[str, Any] = {"mode": mode, "capture_sizes": tuple(sizes)}
    if mode != "breakable":
        kwargs["compiler"] = compiler
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
    """
    every = tuple(sorted(set(decode_sizes) | set(prefill_sizes)))
    if name == "eager":
        return Prepared(name, model)
    if name in ("full", "full-compiled"):
        compiler = "eager" if name == "full" else "inductor"
        graphed, seconds = _graphed(model, "full", compiler, decode_sizes, make_inputs)
        return Prepared(name, graphed, seconds, graphed.stats, prefill_skip=FULL_PREFILL)
    if name in ("piecewise", "none", "breakable"):
        graphed, seconds = _graphed(model, name, "inductor", every, make_inputs)
        return Prepared(name, graphed, seconds, graphed.stats)
    if name == "torch.compile":
        return Prepared(name, torch.compile(model), warm_calls=2)
    if name == "reduce-overhead":
        # Three first calls: warm-up, record, first replay (CUDA graph trees record on the second call).
        return Prepared(name, torch.compile(model, mode="reduce-overhead"), warm_calls=3,
                        prefill_note=REDUCE_OVERHEAD_PREFILL)
    if name == "meta-pcg":
        runner = meta_pcg.MetaPiecewise(model, every)
        sync()
        start = time.perf_counter()
        runner.capture(make_inputs)
        sync()
        return Prepared(name, runner, time.perf_counter() - start, runner.stats)
    raise ValueError(f"unknown bench mode {name!r}; choose from {', '.join(KNOWN_MODES)}")


def release() -> None:
    """Free the last mode's graphs and compiled code (drop your references first), so each mode starts alike."""
    import gc

    gc.collect()
    # Dynamo caches per code object: without a reset, torch.compile modes share recompile budgets and cache.
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
