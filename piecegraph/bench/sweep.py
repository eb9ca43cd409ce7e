"""Run every mode over every case: eager references first, then one mode at a time (built, timed, freed).

Mode after mode rather than case after case: a mode's compile and capture happen once, its setup is timed as a
whole, and its graphs are freed before the next mode builds, so no mode runs with another's pool resident.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from piecegraph.bench import modes as bench_modes
from piecegraph.bench.cases import Case, capture_inputs, decode_cache, decode_cases, prefill_cases
from piecegraph.bench.harness import Row, measure_bandwidth_gbs, peak_hbm_gbs, rel_err, sync, time_ms
from piecegraph.context import forward_context
from piecegraph.graphs.capture import pipelined_ms
from piecegraph.models import ModelFacts, model_facts

Log = Callable[[str], None]


@dataclass
class SweepResult:
    """Rows (one per mode x case, skipped ones included), per-mode setup facts, and the measured bandwidth."""

    rows: list[Row]
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    bandwidth_gbs: float = 0.0
    attention_backend: str | None = None  # the name the caches' backend resolved to


def _reason(exc: BaseException, log: Log | None = None) -> str:
    """A one-line skip reason; the last frames of the traceback go to ``log`` (GPU runs are debugged from logs)."""
    if log is not None:
        log(traceback.format_exc(limit=-6).rstrip())
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}: {text}"[:300]


def _references(model: torch.nn.Module, cases: Sequence[Case], float_model: torch.nn.Module | None = None) -> None:
    """Eager float32 outputs of every case's first input set: what ``rel_err`` compares against; with
    ``float_model`` (the same weights unquantized) its outputs too, for ``rel_err_float``. Each run writes its own
    keys and values into the case's slots before attending to them, so the two models' runs do not mix."""
    with torch.no_grad():
        for case in cases:
            with forward_context(case.meta):
                if float_model is not None:
                    case.float_reference = float_model(*case.args(0)).float()
                case.reference = model(*case.args(0)).float()


def _time_case(prep: bench_modes.Prepared, case: Case, repeats: int, bandwidth_gbs: float) -> tuple[Row, float]:
    """One mode on one case: ``warm_calls`` setup calls, an accuracy call, then the median of ``repeats``
    synchronized calls (``ms``); a decode case also the pace of ``repeats`` calls back to back (``loop_ms``).

    Every mode of ``modes.py`` may be called back to back without a sync: the inputs are device tensors that
    graphed modes copy into their static buffers on the same stream (ordered after the previous replay), each
    case's metadata is built once, a FlashInfer re-plan waits for the copy of its previous plan, and a replay
    that overwrites the previous call's output (graphs, CUDA graph trees) is harmless: the timed outputs are
    never read."""
    row = Row(prep.name, case.phase, case.size, seqs=case.seqs if case.phase == "prefill" else None)
    if case.phase == "prefill" and prep.prefill_skip:
        row.skipped = prep.prefill_skip
        return row, 0.0
    fn = prep.fn
    with torch.no_grad(), forward_context(case.meta):
        sync()
        start = time.perf_counter()
        for _ in range(prep.warm_calls):
            fn(*case.args(0))
        sync()
        warm_s = time.perf_counter() - start
        out = fn(*case.args(0))
        row.rel_err = rel_err(out, case.reference)
        if case.float_reference is not None:
            row.rel_err_float = rel_err(out, case.float_reference)
        row.ms = time_ms(lambda i: fn(*case.args(i)), repeats=repeats)
        if case.phase == "decode":  # the overlapped engine's decode loop launches step k+1 while step k runs
            row.loop_ms = pipelined_ms(lambda i: fn(*case.args(i)), repeats=repeats)
    row.tok_s = case.size / row.ms * 1e3
    floor_ms = case.floor_bytes / (bandwidth_gbs * 1e9) * 1e3
    row.hbm_frac = floor_ms / row.ms
    if row.loop_ms is not None:
        row.loop_hbm_frac = floor_ms / row.loop_ms
    row.note = prep.prefill_note if case.phase == "prefill" else prep.decode_note
    return row, warm_s


def _mode_facts(prep: bench_modes.Prepared, setup_s: float) -> dict[str, Any]:
    stats = prep.stats() or {}
    pool = stats.get("pool_bytes")
    return {
        "setup_s": round(setup_s, 3),
        "capture_s": round(sum(stats.get("capture_s", {}).values()), 3) if "capture_s" in stats else None,
        "pool_mib": None if pool is None else round(pool / 2**20, 1),
        "pieces": stats.get("pieces"),
        "compiled_pieces": stats.get("compiled_pieces"),
        "sizes": stats.get("sizes"),
        # Whether the timed calls replayed graphs: a size dropped or a call without a graph would show here.
        **{key: stats[key] for key in ("replays", "fallbacks", "moved_inputs", "dropped_sizes") if key in stats},
        **({"static_compile_s": round(stats["static_compile_s"], 1),
            "static_sizes": {size: {"static": e["static"], "dynamic": e["dynamic"]}
                             for size, e in stats["static_sizes"].items()}} if stats.get("static_sizes") else {}),
        # where the setup went: prewarm (JIT builds), trace, compile, capture; automatic opaque's wrapped entries
        **({"startup": {k: round(v, 3) if isinstance(v, float) else v for k, v in stats["startup"].items()}}
           if stats.get("startup") else {}),
        **({"auto_opaque": sorted(stats["auto_opaque"])} if stats.get("auto_opaque") else {}),
        # the auto row: which module each decode size replays, and the two timings that chose it
        **({"decode_choice": stats["decode_choice"]} if stats.get("decode_choice") else {}),
    }


def _run_mode(name: str, model: torch.nn.Module, cases: Sequence[Case], make_inputs: Any, repeats: int,
              bandwidth_gbs: float, log: Log, keep_going: bool = True) -> tuple[list[Row], dict[str, Any]]:
    """Rows of one mode; a failure skips the affected rows with the reason instead of ending the run (unless
    ``keep_going`` is false: then it raises)."""
    reason = bench_modes.unavailable(name)
    if reason is None:
        decode = [c.size for c in cases if c.phase == "decode"]
        prefill = [c.size for c in cases if c.phase == "prefill"]
        try:
            prep = bench_modes.prepare(name, model, decode, prefill, make_inputs)
        except Exception as exc:  # noqa: BLE001  (a mode that cannot build is a result, not a crash)
            if not keep_going:
                raise
            reason = _reason(exc, log)
    if reason is not None:
        log(f"{name}: skipped ({reason})")
        return [Row(name, c.phase, c.size, skipped=reason) for c in cases], {"skipped": reason}
    rows, warm_total = [], 0.0
    try:
        for case in cases:
            try:
                row, warm_s = _time_case(prep, case, repeats, bandwidth_gbs)
            except Exception as exc:  # noqa: BLE001  (one failing case skips its row, not the mode)
                if not keep_going:
                    raise
                row, warm_s = Row(name, case.phase, case.size, skipped=_reason(exc, log)), 0.0
            warm_total += warm_s
            rows.append(row)
            log(_describe(row))
    finally:
        prep.close()  # even when interrupted: the next mode must not run under this one's config patches
    facts = _mode_facts(prep, prep.setup_s + warm_total)
    for row in rows:
        if row.skipped is None:
            row.setup_s, row.pool_mib = facts["setup_s"], facts["pool_mib"]
    stages = facts.get("startup") or {}
    keys = ("prewarm_s", "jit_build_s", "trace_s", "diagnose_s", "compile_s")  # the JIT build is inside prewarm
    split = ", ".join(f"{k[:-2]} {stages[k]:.1f}" for k in keys if stages.get(k))
    log(f"{name}: setup {facts['setup_s']:.1f} s ({split + ', ' if split else ''}capture {facts['capture_s']} s), "
        f"pool {facts['pool_mib']} MiB, pieces {facts['pieces']}")
    return rows, facts


def _describe(row: Row) -> str:
    key = "batch" if row.phase == "decode" else "tokens"
    if row.skipped:
        return f"{row.phase:7s} {key}={row.size:<5d} {row.mode:16s} skipped: {row.skipped}"
    versus_float = "" if row.rel_err_float is None else f"  vs unquantized {row.rel_err_float:.1e}"
    loop = "" if row.loop_ms is None else f"  loop {row.loop_ms:.3f} ms ({row.loop_hbm_frac:.1%})"
    return (f"{row.phase:7s} {key}={row.size:<5d} {row.mode:16s} {row.ms:9.3f} ms  "
            f"{row.hbm_frac:6.1%} of HBM floor{loop}  rel_err={row.rel_err:.1e}{versus_float}")


KV_MEMORY_SHARE = 0.7  # of the free device memory a decode cache may take: graphs and activations need the rest


def fitting_batches(facts: ModelFacts, batches: Sequence[int], context: int, log: Callable[[str], None]
                    ) -> tuple[list[int], list[tuple[int, str]]]:
    """The decode batches whose one shared KV cache (``context + 8`` tokens a sequence, for the largest batch)
    fits :data:`KV_MEMORY_SHARE` of the device's free memory, and ``(batch, reason)`` for those left out, largest
    first (a CUDA device only; elsewhere all fit). Refuses, naming ``--batches``, when none fits."""
    if facts.device.type != "cuda" or facts.config is None:
        return list(batches), []
    free = torch.cuda.mem_get_info(facts.device)[0] * KV_MEMORY_SHARE
    per_seq = facts.kv_bytes_per_token() * (context + 8)
    kept = sorted(batches)
    dropped: list[tuple[int, str]] = []
    while kept and kept[-1] * per_seq > free:
        b = kept.pop()
        dropped.append((b, f"its KV cache ({b} x {context + 8} tokens, {b * per_seq / 2**30:.1f} GiB) does not fit "
                           f"{KV_MEMORY_SHARE:.0%} of the {free / KV_MEMORY_SHARE / 2**30:.1f} GiB free beside the "
                           "model: a smaller --context or batch, or a GPU with more memory"))
        log(f"decode batch {b}: skipped, {dropped[-1][1]}")
    if not kept:
        raise ValueError(f"--batches {list(batches)}: no decode batch fits the device at --context {context} "
                         f"({per_seq / 2**20:.1f} MiB of KV cache a sequence, {free / 2**30:.1f} GiB usable)")
    return [b for b in batches if b in kept], dropped


def run_sweep(model: torch.nn.Module, modes: Sequence[str], batches: Sequence[int], prefill: Sequence[int],
              context: int = 256, repeats: int = 20, log: Log = print,
              on_mode: Callable[[SweepResult], None] | None = None, attention: str = "auto",
              keep_going: bool = True, float_model: torch.nn.Module | None = None,
              facts: ModelFacts | None = None) -> SweepResult:
    """Time ``modes`` on decode steps (``batches`` sequences at ``context`` cached tokens) and packed prefills
    (``prefill`` total tokens each), all against the same eager references and paged caches, whose attention
    backend is ``attention`` (``auto | torch | flashinfer``; the resolved name is ``result.attention_backend``).

    Constraints: ``model`` is a reference :class:`~piecegraph.models.Decoder` (or loads like one); ``batches``
    is non-empty (the decode cache is sized by it, and graphed modes capture with it); sizes are positive.
    ``on_mode(result)`` runs after each mode with the rows so far (write partial results: a sweep cut short by a
    time limit keeps the modes it finished). ``keep_going=False`` raises at the first failure instead of
    skipping: a tensor-parallel rank must, since its peers would pair their collectives with its next mode's.
    ``float_model``: the same weights unquantized (``--quant fp8``), run eagerly once per case for each row's
    ``rel_err_float``; dropped after the references, so pass one the caller does not keep. ``facts``: the
    model's (default ``model_facts(model)``), which the caches and each case's HBM floor are built from.
    """
    if not batches or min(batches) < 1 or (prefill and min(prefill) < 1):
        raise ValueError(f"batches {list(batches)} and prefill {list(prefill)} must be positive (batches non-empty)")
    facts = facts or model_facts(model)
    copy_gbs, peak = measure_bandwidth_gbs(facts.device), peak_hbm_gbs(facts.device)
    log(f"copy bandwidth {copy_gbs:.0f} GB/s" + (f"; hbm_frac against the peak {peak:.0f} GB/s" if peak else
                                                 "; no known peak: hbm_frac against the copy bandwidth"))
    bandwidth = peak or copy_gbs
    batches, too_big = fitting_batches(facts, batches, context, log)
    cache = decode_cache(facts, batches, context, attention)
    cases = decode_cases(facts, cache, batches, context) + prefill_cases(facts, prefill, attention)
    log(f"attention backend {cache.backend.name}: {cache!r}")
    _references(model, cases, float_model)
    float_model = None  # noqa: F841  (freed before the modes are built: the A2.7B shape is 28.6 GB in bf16)
    result = SweepResult([], bandwidth_gbs=copy_gbs, attention_backend=cache.backend.name)
    for name in modes:
        rows, mode_facts = _run_mode(name, model, cases, capture_inputs(facts, cache), repeats, bandwidth, log,
                                     keep_going)
        result.rows += rows + [Row(name, "decode", b, skipped=reason) for b, reason in too_big]
        result.modes[name] = mode_facts
        bench_modes.release()
        if on_mode is not None:
            on_mode(result)
    return result
