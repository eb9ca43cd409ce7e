"""Every mode at every concurrency: one engine per mode (graphs captured once), a warm-up, then the loops.

Modes run one after another in one process; each engine is dropped (and Dynamo reset) before the next, so
each starts alike. A mode that fails to start or run is recorded with its error and the sweep goes on. A mode is
an engine mode (overlapped steps, the engine's default), ``auto-sync``: ``auto`` with the synchronous loop
(``EngineConfig.overlap=False``), the baseline row of the overlapped engine, ``auto-freeze``: ``auto`` on a
frozen heap (``EngineConfig.freeze_gc=True``), ``auto-shared``: ``auto`` whose full module builds from the
piecewise module's trace and compiles it whole (``share_trace=True``, ``full_compile="whole"``: what the defaults
do without a cache), or ``auto-pieces``: that, compiled by pieces (``full_compile="pieces"``: what the defaults do
on a cold start with a cache, until the whole graph's package is swapped in), or ``auto-noprefix``: ``auto``
without its prefix cache (``prefix_cache=False``: the shared-prefix workload's row without the cache), or
``auto-nomixed``: ``auto`` whose steps with prompt tokens all run piecewise (``mixed_graphs=False``).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.graphs.capture import release_compiled
from piecegraph.serve.bench import Workload, decode_reference, measure, median_run, requests_for
from piecegraph.serve.config import ENGINE_MODES, EngineConfig
from piecegraph.serve.engine import Engine
from piecegraph.serve.executor import Progress
from piecegraph.serve.gpu_bound import engine_fits, engine_timer, estimate

SYNC_SUFFIX = "-sync"
# auto's variant rows: the synchronous loop, the frozen heap, the full module from the shared trace (whole, and
# by pieces), no prefix cache, decode graphs compiled per static size, no full-mixed graphs
VARIANTS = {SYNC_SUFFIX: {"overlap": False}, "-freeze": {"freeze_gc": True},
            "-shared": {"share_trace": True, "full_compile": "whole"},
            "-pieces": {"share_trace": True, "full_compile": "pieces"}, "-noprefix": {"prefix_cache": False},
            "-static": {"decode_compile_sizes": "auto"}, "-nomixed": {"mixed_graphs": False}}
BENCH_MODES = (*ENGINE_MODES, *("auto" + suffix for suffix in VARIANTS))


def engine_config(mode: str, base: EngineConfig) -> EngineConfig:
    """The engine config of a bench mode: ``base`` with its engine mode and, for a variant row, its changes
    (:data:`VARIANTS`). Raises ``ValueError`` naming the known modes for any other name."""
    if mode not in BENCH_MODES:
        raise ValueError(f"serve-bench mode {mode!r} is not one of {BENCH_MODES}")
    for suffix, changes in VARIANTS.items():
        if mode.endswith(suffix):
            return base.replace(mode=mode.removesuffix(suffix), **changes)
    return base.replace(mode=mode)


@dataclass(frozen=True)
class Plan:
    """What the sweep runs: modes, concurrencies, request counts (``counts[c]``, else
    :func:`~piecegraph.serve.bench.requests_for` of ``rounds``, ``min_requests``, ``max_requests``), the workload,
    the engine's config (its ``mode`` replaced per mode), warm-up requests per mode, whether to time the
    decode-only full-graph reference loop (in ``auto``), whether to estimate what the GPU allows per
    concurrency (in ``auto``, on CUDA: :mod:`piecegraph.serve.gpu_bound`) and how many times each concurrency
    runs (``repeats``: the median run is reported, :func:`~piecegraph.serve.bench.median_run`)."""

    modes: tuple[str, ...]
    concurrencies: tuple[int, ...]
    workload: Workload
    engine: EngineConfig
    counts: dict[int, int] = field(default_factory=dict)
    rounds: float = 3.0
    min_requests: int = 4
    max_requests: int = 1024
    warmup: int = 2
    reference: bool = True
    gpu_bound: bool = True
    repeats: int = 1

    def num_requests(self, concurrency: int) -> int:
        if concurrency in self.counts:
            return self.counts[concurrency]
        return requests_for(concurrency, self.rounds, self.min_requests, self.max_requests)


def start_mode(model: torch.nn.Module, mode: str, plan: Plan, log: Callable[[str], None],
               progress: Callable[[str], Progress | None], cache: KVCache | None = None
               ) -> tuple[Engine, dict[str, Any]]:
    """One mode's engine (timed; on ``cache`` when given, else its own) after its warm-up requests, and its result
    so far (no rows)."""
    vocab = model.config.vocab_size
    engine = Engine(model, engine_config(mode, plan.engine), cache=cache, progress=progress(mode))
    result: dict[str, Any] = {"mode": mode, "capture": engine.capture_report(), "rows": [],
                              "attention_kernel": getattr(engine.cache.backend, "kernel", engine.cache.backend.name)}
    log(f"{mode}: engine ready in {engine.setup_s:.1f} s ({_captured(result['capture'])})")
    if plan.warmup:
        warm = Workload(min(plan.workload.input_len, 64), min(plan.workload.output_len, 8), 0.0, plan.workload.seed)
        measure(engine, warm.requests(plan.warmup, vocab, salt=-1), plan.warmup)
    return engine, result


def works_of(model: torch.nn.Module, plan: Plan) -> dict[int, list[tuple[list[int], int]]]:
    """Each concurrency's requests: the same for every mode."""
    vocab = model.config.vocab_size
    return {c: plan.workload.requests(plan.num_requests(c), vocab, salt=c) for c in plan.concurrencies}


def finish_mode(engine: Engine, plan: Plan, works: dict[int, Any], result: dict[str, Any],
                log: Callable[[str], None]) -> dict[str, Any]:
    """After the loops: the reference loop and the GPU-bound estimate (in ``auto``), the capture report again."""
    mode = result["mode"]
    if plan.reference and engine.executor.decode is not None and not mode.endswith(SYNC_SUFFIX):
        ref = decode_reference(engine, plan.workload.input_len, min(plan.workload.output_len, 128))
        result["decode_reference"] = ref
        log(f"{mode}: decode-only full-graph loop ITL p50 {ref['itl_p50_ms']:.2f} ms")
    if plan.gpu_bound and mode == "auto" and engine.cache.device.type == "cuda":
        cached = {row["concurrency"]: row.get("cached_tokens", 0) for row in result["rows"]}
        result["gpu_bound"] = _gpu_bound(engine, works, plan, log, cached)
    result["capture"] = engine.capture_report()  # pool MiB after the runs too (FlashInfer plans may add)
    return result


def run_mode(model: torch.nn.Module, mode: str, plan: Plan, log: Callable[[str], None],
             progress: Callable[[str], Progress | None]) -> dict[str, Any]:
    """One mode: start the engine (timed), warm up, every concurrency, then the reference loop in ``auto``."""
    engine, result = start_mode(model, mode, plan, log, progress)
    works = works_of(model, plan)
    for c, work in works.items():
        row = median_run(lambda work=work, c=c: measure(engine, work, c), plan.repeats)
        result["rows"].append({"mode": mode, **row})
        log_row(log, mode, row)
    return finish_mode(engine, plan, works, result, log)


def log_row(log: Callable[[str], None], mode: str, row: dict[str, Any]) -> None:
    log(f"{mode} c={row['concurrency']}: {row['requests']} requests in {row['duration_s']:.2f} s, "
        f"{row['output_tok_s']:.0f} output tok/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p50 "
        f"{row['itl_p50_ms'] or 0:.2f} ms, graphs {row['graph_share']:.0%} of {row['steps']} steps, GC pauses "
        f"{row['gc_pause_ms']:.0f} ms ({row['gc_full']} full)")


def _gpu_bound(engine: Engine, works: dict[int, Any], plan: Plan, log: Callable[[str], None],
               cached: dict[int, int]) -> list[dict[str, Any]]:
    """The GPU-bound estimate per concurrency (an error is logged and leaves the list short: it is a side note),
    of the same work as the measured run: its prefix-cache hits (``cached``: concurrency -> tokens) not prefilled."""
    timer, fits, out = engine_timer(engine), engine_fits(engine), []
    for c, work in works.items():
        try:
            out.append(estimate(work, c, timer, plan.engine.max_num_batched_tokens, fits, cached.get(c, 0)))
        except Exception as exc:  # noqa: BLE001  (an estimate must not lose the measured rows)
            log(f"GPU-bound estimate at c={c} failed: {type(exc).__name__}: {exc}")
            continue
        log(f"c={c}: GPU-bound estimate {out[-1]['gpu_bound_output_tok_s']:.0f} output tok/s (decode step "
            f"{out[-1]['decode_step_ms']:.3f} ms x {out[-1]['decode_rows']} rows at context {out[-1]['context']}, "
            f"prefill {out[-1]['prefill_us_per_token']:.2f} us/token)")
    return out


def _captured(report: dict[str, Any]) -> str:
    parts = [f"{kind} {len(m['sizes'])} sizes {m['setup_s']:.1f} s" for kind, m in report["modules"].items()]
    parts.append(f"pool {report['pool_mib']:.0f} MiB")
    return ", ".join(parts) if report["modules"] else "no graphs"


def run_sweep(model: torch.nn.Module, plan: Plan, log: Callable[[str], None] = print,
              progress: Callable[[str], Progress | None] = lambda mode: None,
              on_mode: Callable[[list[dict[str, Any]]], None] | None = None, keep_going: bool = True
              ) -> list[dict[str, Any]]:
    """Every mode of ``plan``; returns one result per mode (``error`` set where it failed). ``keep_going=False``
    raises at the first failure instead: a tensor-parallel rank must, since its peers would pair their
    collectives with its next mode's."""
    results: list[dict[str, Any]] = []
    for mode in plan.modes:
        start = time.perf_counter()
        try:
            result = run_mode(model, mode, plan, log, progress)
        except Exception as exc:  # noqa: BLE001  (one failing mode must not lose the others' results)
            if not keep_going:
                raise
            log(f"{mode}: failed: {type(exc).__name__}: {exc}")
            log(traceback.format_exc(limit=6))
            result = {"mode": mode, "rows": [], "error": f"{type(exc).__name__}: {exc}"[:500]}
        result["wall_s"] = round(time.perf_counter() - start, 2)
        results.append(result)
        release()
        if on_mode:
            on_mode(results)
    return results


def release() -> None:
    """Free the last engine's graphs, compiled code and KV cache, so each mode starts alike
    (:func:`~piecegraph.graphs.capture.release_compiled`)."""
    release_compiled()


def rows_of(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for result in results for row in result["rows"]]
