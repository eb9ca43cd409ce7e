"""Where one decode step's time goes: graph replays versus the split ops that run eagerly between them.

Two measurements, kept apart because the profiler's own overhead would distort the timings:

1. timers (no profiler): the step's device time (CUDA events), its CPU time (wall time of the call, which
   returns before the GPU finishes), and the CPU time inside graph replays and piecegraph's piece calls;
2. ``torch.profiler`` over a few steps: split-op calls and their CPU time, ATen ops and kernel launches issued
   inside split ops (what runs eagerly between replays), and graph launches per step.

A step whose CPU time is about its device time is CPU bound: the GPU waits for Python between pieces.
:func:`attention_op_us` prices the piece in between: one call of the attention split op, per backend.
"""

from __future__ import annotations

import statistics
import time
from typing import Any
from unittest import mock

import torch

from piecegraph.attention.types import v_head_dim
from piecegraph.bench import modes as bench_modes
from piecegraph.bench.cases import capture_inputs, decode_cache, decode_cases, prefill_cases
from piecegraph.bench.harness import sync, time_ms
from piecegraph.context import forward_context
from piecegraph.graphs.capture import GraphedPiece
from piecegraph.models import ModelFacts

# the attention split ops a step calls between pieces: ordinary models', and MLA models' (DeepSeek, GLM-5)
SPLIT_OPS = ("piecegraph_models::attention", "piecegraph_models::mla_attention")
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# attention_op_us's cases: (JSON key, phase, decode batch | prefill tokens)
OP_COST_CASES = (("decode_1", "decode", 1), ("prefill_512", "prefill", 512))
_VIEWS = ("aten::view", "aten::reshape", "aten::transpose", "aten::slice", "aten::select", "aten::unsqueeze",
          "aten::expand", "aten::as_strided", "aten::_reshape_alias", "aten::alias", "aten::narrow",
          "aten::t", "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_like")


def _cpu_breakdown(fn: Any, args: tuple[Any, ...], steps: int) -> dict[str, float]:
    """Median CPU ms of a step; mean CPU ms per step inside ``CUDAGraph.replay`` (every graphed mode's launches)
    and inside piecegraph's ``GraphedPiece`` calls (replay plus its address checks). No profiler."""
    spent = {"replay": 0.0, "piece": 0.0}

    def timer(key: str, original: Any) -> Any:
        def timed(self: Any, *a: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self, *a)
            finally:
                spent[key] += time.perf_counter() - start
        return timed

    step_ms = []
    with mock.patch.object(GraphedPiece, "__call__", timer("piece", GraphedPiece.__call__)), \
            mock.patch.object(torch.cuda.CUDAGraph, "replay", timer("replay", torch.cuda.CUDAGraph.replay)):
        for _ in range(steps):
            sync()  # start each step with an idle GPU, so a full launch queue cannot stall the CPU timing
            start = time.perf_counter()
            fn(*args)
            step_ms.append((time.perf_counter() - start) * 1e3)
    step_ms.sort()
    return {"step_cpu_ms": step_ms[len(step_ms) // 2], "replay_cpu_ms": spent["replay"] * 1e3 / steps,
            "piece_call_cpu_ms": spent["piece"] * 1e3 / steps}


def _under_split(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SPLIT_OPS:
            return True
        parent = parent.cpu_parent
    return False


def _profiled_counts(fn: Any, args: tuple[Any, ...], steps: int) -> dict[str, float]:
    """Per-step counts and times from ``torch.profiler``: split ops, their ATen ops and launches, graph launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn(*args)
        sync()
    events = list(prof.events())
    split = [e for e in events if e.name in SPLIT_OPS]
    inner = [e for e in events if e.name.startswith("aten::") and e.name not in _VIEWS and _under_split(e)]
    launches = [e for e in events if e.name in _LAUNCHES]
    launches_in_split = sum(1 for e in launches if _under_split(e))
    calls = max(len(split), 1)
    return {
        "split_calls_per_step": len(split) / steps,
        "split_cpu_ms_per_step": sum(e.cpu_time_total for e in split) / 1e3 / steps,
        "split_gpu_ms_per_step": sum(_device_us(e) for e in split) / 1e3 / steps,
        "aten_ops_per_split": len(inner) / calls,
        "kernels_per_split": launches_in_split / calls,
        "eager_kernels_outside_split_per_step": (len(launches) - launches_in_split) / steps,
        "graph_launches_per_step": sum(1 for e in events if e.name == "cudaGraphLaunch") / steps,
        **_kernel_summary(events, steps),
    }


def _kernel_summary(events: list[Any], steps: int, top: int = 6) -> dict[str, Any]:
    """GPU kernels per step (graph replays included: CUPTI traces the kernels a graph launches), their summed
    ms, and the ``top`` kernel names by time: what a step spends its device time on."""
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {}
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    ranges = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    gaps = [max(0.0, start - prev_end) for (_, prev_end), (start, _) in zip(ranges, ranges[1:])]
    busy_us = sum(by_name.values())
    gemm_us = sum(us for name, us in by_name.items() if is_gemm_kernel(name))
    return {
        "timeline": step_timeline(kernels, len(kernels) // steps),
        "gemm_ms_per_step": gemm_us / 1e3 / steps,
        "gpu_kernels_per_step": len(kernels) / steps,
        "gpu_kernel_ms_per_step": busy_us / 1e3 / steps,
        # from the first kernel's start to the last one's end, per step: busy + the gaps between kernels
        "gpu_span_ms_per_step": (ranges[-1][1] - ranges[0][0]) / 1e3 / steps,
        "median_gap_us": round(statistics.median(gaps), 2) if gaps else 0.0,
        "top_kernels_ms_per_step": {name[:80]: round(us / 1e3 / steps, 4) for name, us in ranked},
    }


# Name fragments of matrix-multiply kernels: cuBLAS's (nvjet on sm90, *gemm* elsewhere), CUTLASS's, Triton's
# (Inductor's templates and piecegraph's small-batch linear)
_GEMM_NAMES = ("gemm", "nvjet", "cutlass", "gemv", "small_linear", "triton_tem_fused_mm", "_mm_", "xmma")


_ATTENTION_NAMES = ("attention", "attn", "flashinfer", "flash", "paged", "mla", "sdpa")


def is_gemm_kernel(name: str) -> bool:
    """Whether a kernel name is a matrix multiply's (cuBLAS, CUTLASS, Triton templates): the kernels that read the
    weights, so their summed time against the weight bytes is the step's GEMM bandwidth."""
    lowered = name.lower()
    return any(fragment in lowered for fragment in _GEMM_NAMES)


def step_timeline(kernels: list[Any], per_step: int) -> dict[str, Any]:
    """The last profiled step's kernels in launch order: ``[name (60 chars), us, gap before it in us]`` each,
    the kernel count, the summed gaps and the gap share of the step's span, and microseconds by kind
    (``gemm`` | ``attention`` | ``other``): where a step's time goes between kernels and inside them."""
    if per_step < 1:
        return {}
    last = sorted(kernels, key=lambda e: e.time_range.start)[-per_step:]
    rows, gaps, by_kind = [], 0.0, {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    prev_end = None
    for e in last:
        start, end = e.time_range.start, e.time_range.end
        gap = max(0.0, start - prev_end) if prev_end is not None else 0.0
        gaps += gap
        prev_end = end
        us = end - start
        kind = ("gemm" if is_gemm_kernel(e.name) else
                "attention" if any(k in e.name.lower() for k in _ATTENTION_NAMES) else "other")
        by_kind[kind] += us
        rows.append([e.name[:60], round(us, 2), round(gap, 2)])
    span = last[-1].time_range.end - last[0].time_range.start
    return {"kernels": len(last), "span_us": round(span, 1), "gaps_us": round(gaps, 1),
            "gap_share": round(gaps / span, 3) if span else 0.0,
            "us_by_kind": {k: round(v, 1) for k, v in by_kind.items()}, "rows": rows}


def _device_us(event: Any) -> float:
    # device_time_total in torch >= 2.4; cuda_time_total before (deprecated after: never touch it if we can)
    if hasattr(type(event), "device_time_total"):
        return float(event.device_time_total or 0)
    return float(getattr(event, "cuda_time_total", 0) or 0)


def profile_step(model: torch.nn.Module, facts: ModelFacts, mode: str, batch: int, context: int = 256,
                 steps: int = 20, attention: str = "auto") -> dict[str, Any]:
    """Profile one decode step of ``mode`` at ``batch`` sequences of ``context`` cached tokens, on a paged cache
    with the ``attention`` backend; ``facts`` are ``model``'s (``model.facts()``).

    Returns a flat dict (JSON-ready): pieces, step GPU and CPU ms, CPU ms in graph replays, split-op calls with
    their CPU/GPU ms, eager ATen ops and kernels per split op, graph launches per step, and a one-line verdict.
    Works for any mode; piece timings are zero for modes without piecegraph pieces (eager, torch.compile).
    """
    reason = bench_modes.unavailable(mode)
    if reason:
        return {"mode": mode, "batch": batch, "skipped": reason}
    cache = decode_cache(facts, [batch], context, attention)
    case = decode_cases(facts, cache, [batch], context)[0]
    prep = bench_modes.prepare(mode, model, [batch], [], capture_inputs(facts, cache))
    args = case.args(0)
    try:
        with torch.no_grad(), forward_context(case.meta):
            for _ in range(max(prep.warm_calls, 1)):
                prep.fn(*args)
            gpu_ms = time_ms(lambda i: prep.fn(*case.args(i)), repeats=steps)
            cpu = _cpu_breakdown(prep.fn, args, steps)
            counts = _profiled_counts(prep.fn, args, min(steps, 5))
        stats = prep.stats() or {}
    finally:
        prep.close()
    result = {"mode": mode, "batch": batch, "context": context, "attention_backend": cache.backend.name,
              "pieces": stats.get("pieces"), "step_gpu_ms": gpu_ms, **cpu, **counts}
    if counts.get("gemm_ms_per_step"):  # the weights' read rate inside the GEMMs alone (the step's floor is all of it)
        result["gemm_gbs"] = round(facts.weight_bytes_read(batch) / counts["gemm_ms_per_step"] / 1e6, 1)
    # What is neither a graph launch nor a split op: staging copies, output clones, Python glue.
    launch_ms = max(cpu["replay_cpu_ms"], cpu["piece_call_cpu_ms"])
    result["other_cpu_ms"] = max(0.0, cpu["step_cpu_ms"] - launch_ms - counts["split_cpu_ms_per_step"])
    result["verdict"] = verdict(result)
    prep = None
    bench_modes.release()
    return result


def verdict(p: dict[str, Any]) -> str:
    """One sentence on what bounds the step, from :func:`profile_step`'s numbers."""
    split = p["split_cpu_ms_per_step"]
    bound = "CPU bound" if p["step_cpu_ms"] >= 0.8 * p["step_gpu_ms"] else "GPU bound"
    return (f"{bound}: {p['step_cpu_ms']:.2f} ms CPU per {p['step_gpu_ms']:.2f} ms step; "
            f"{p['split_calls_per_step']:.0f} split-op calls cost {split:.2f} ms CPU "
            f"({p['aten_ops_per_split']:.0f} ATen ops, {p['kernels_per_split']:.0f} kernels each), "
            f"graph replays {p['replay_cpu_ms']:.2f} ms CPU for {p['graph_launches_per_step']:.0f} launches, "
            f"other {p['other_cpu_ms']:.2f} ms CPU")


def attention_op_us(facts: ModelFacts, attention: str = "auto", context: int = 256, calls: int = 30
                    ) -> dict[str, Any]:
    """Median CPU microseconds of one call of the attention split op (layer 0; ``mla_attention`` for an MLA
    model, with its DSA indexer's top-k where layer 0 has one), per :data:`OP_COST_CASES`:
    decode batch 1 at ``context`` cached tokens, and the bench's 512-token packed prefill, on fresh paged caches
    with the ``attention`` backend. Never raises: a case that fails is ``None``, its reason under ``"failed"``.

    What a piecewise mode pays per layer between graph replays: the dispatcher, the op's Python and the
    backend's kernel launches, but not the step's metadata build (once per step, not per call). Each call starts
    on an idle device and is not synchronized at its end, so on CUDA it is host time only; on CPU the kernels
    run inside the call, so it is the whole op. ``facts``: the model's (``model.facts()``), with a cache shape.
    """
    result: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for key, phase, size in OP_COST_CASES:
        try:
            if phase == "decode":
                meta = decode_cases(facts, decode_cache(facts, [size], context, attention), [size], context)[0].meta
            else:
                meta = prefill_cases(facts, [size], attention)[0].meta
            result[key] = _op_call_us(facts, meta, calls)
        except Exception as exc:  # noqa: BLE001  (a number we could not take is a reason, not a lost sweep)
            result[key] = None
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            failed[key] = f"failed: {type(exc).__name__}: {text}"[:300]
    if failed:
        result["failed"] = failed
    return result


def _op_call_us(facts: ModelFacts, meta: Any, calls: int, warmup: int = 3) -> float:
    """Median host microseconds of layer 0's attention split op under ``meta``, on random inputs: see
    :func:`_op_and_args`."""
    op, args = _op_and_args(facts, meta.num_tokens)
    times = []
    with torch.no_grad(), forward_context(meta):
        for i in range(warmup + calls):  # warm-up: lazy inits, JIT kernels (FlashInfer), allocator blocks
            sync()
            start = time.perf_counter()
            op(*args)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e6


def _op_and_args(facts: ModelFacts, n: int) -> tuple[Any, tuple[Any, ...]]:
    """The split op layer 0 calls and random arguments for ``n`` tokens: ``piecegraph_models::attention(q, k, v,
    out, 0)``, or for an MLA config (``config.mla``) ``piecegraph_models::mla_attention`` with the absorbed query,
    the latent and rotary key, and with DSA (layer 0 has its own indexer) the indexer's query, weights and key."""
    config, device, dtype = facts.config, facts.device, facts.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(n, *shape, generator=gen).to(device=device, dtype=as_dtype)

    if not getattr(config, "mla", False):
        v_dim = v_head_dim(config)
        q, k, v = rand(config.num_heads * config.head_dim), rand(config.num_kv_heads * config.head_dim), \
            rand(config.num_kv_heads * v_dim)
        out = torch.empty(n, config.num_heads * v_dim, device=device, dtype=dtype)
        return torch.ops.piecegraph_models.attention, (q, k, v, out, 0)
    from piecegraph.models.mla import softmax_scale  # registers mla_attention (an MLA model has imported it)

    heads, rank, rope = config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
    q_nope, q_pe, ckv, kpe = rand(heads, rank), rand(heads, rope), rand(rank), rand(rope)
    index: tuple[Any, ...] = (None, None, None, 1.0)
    if config.index_head_dim and config.layer_indexer_types[0] == "full":
        hi, di = config.index_n_heads, config.index_head_dim
        index = (rand(hi, di), rand(hi, as_dtype=torch.float32) * hi ** -0.5, rand(di), di ** -0.5)
    return torch.ops.piecegraph_models.mla_attention, (
        q_nope, q_pe, ckv, kpe, torch.empty_like(q_nope), 0, softmax_scale(config), config.index_topk, *index)
