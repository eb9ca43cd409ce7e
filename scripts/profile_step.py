"""Where a serving step's host time goes: an engine stepped under a profiler after a warm-up round.

The engine serves the 0.5B shape (bf16, FlashInfer attention when it imports) in one mode (default auto).

    python scripts/profile_step.py OUTDIR [--what host,cuda-api,timeline] [--mode auto]

``host``: cProfile over the engine's steps, three workloads apart: ``c256`` (256 requests of 512 prompt tokens and
32 new, submitted at once: mixed steps, then decode at batch 256), ``c10`` (serve-bench's c=10 shape: 30 requests
of ~512 prompt tokens and ~128 new, each within +-25%, at most 10 running, a new one added as one finishes: decode
at batch 10, and a mixed step of one ~512-token prompt beside nine decode rows per arrival) and ``c1`` (one
request, 8 prompt tokens, 128 new: decode at batch 1). Per workload the engine's step kinds and phase means (host
ms) and the top functions by own and by cumulative time. The profiler's own overhead inflates every number: read
the ranking, not the ms.

``cuda-api``: the ``c10`` and ``c256`` workloads under ``torch.profiler``, in the engine's overlapped loop: the
CUDA runtime calls by total host time (a call that waits for the device, such as a copy from
pageable memory or a stream sync, shows as long) and the longest single calls with the ops that made them. An
overlapped step's host work must not wait for the step before it, and torch's sync debug mode sees only the syncs
torch makes, not those inside a kernel library's plan.

``timeline``: a short c10 loop (14 requests, 32 new tokens) under ``torch.profiler`` with each forward marked: per
step kind the forward's host ms beside the device busy and span ms of what it launched, and how far ahead of the
device the host was (``summarize``); its gzipped Chrome trace is written beside the result.

Writes one result file under OUTDIR (``<date>_<gpu>_profile_step.json``, one row per workload and profile) and
prints each row's summary. Without CUDA: a dry run on the tiny shape (graphs emulated), to check the script runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
from pathlib import Path
from typing import Any, Iterable

import torch

from piecegraph.attention import flashinfer_available
from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.engine import Engine
from piecegraph.serve.request import SamplingParams

# requests, prompt tokens, new tokens, running at most (a closed loop: a request added as one finishes), and the
# spread of both lengths (0.25: uniform within +-25%, as serve-bench's --range-ratio; without it requests of one
# length finish in the same step and the next ones arrive together, not one by one)
WORKLOADS = {"c256": (256, 512, 32, 256, 0.0), "c10": (30, 512, 128, 10, 0.25), "c1": (1, 8, 128, 1, 0.0)}
RUNTIME_PREFIXES = ("cuda", "cu")  # runtime and driver API events, as torch's profiler names them
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's device events


def _submit(engine: Engine, vocab: int, gen: torch.Generator, count: int, prompt: int, new: int,
            spread: float = 0.0) -> None:
    def length(n: int) -> int:  # uniform in [n (1 - spread), n (1 + spread)]
        low, high = max(1, round(n * (1 - spread))), max(1, round(n * (1 + spread)))
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    for _ in range(count):
        engine.add_request(torch.randint(0, min(1000, vocab), (length(prompt),), generator=gen).tolist(),
                           SamplingParams(max_new_tokens=length(new)))


def _closed_loop(engine: Engine, vocab: int, gen: torch.Generator, count: int, prompt: int, new: int,
                 running: int, spread: float = 0.0) -> None:
    """Serve ``count`` requests with at most ``running`` in the engine at once, as serve-bench's clients do;
    ``spread``: each request's prompt and new-token lengths vary that much around ``prompt`` and ``new``."""
    left = count
    _submit(engine, vocab, gen, min(running, left), prompt, new, spread)
    left -= min(running, left)
    while engine.has_work():
        done = len(engine.step())
        if done and left:
            _submit(engine, vocab, gen, min(done, left), prompt, new, spread)
            left -= min(done, left)


def _top(stats: pstats.Stats, key: str, count: int = 45) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats(key).print_stats(count)
    return out.getvalue()


def _parents(event) -> str:
    names, parent = [], event.cpu_parent
    while parent is not None and len(names) < 4:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " < ".join(names)


def _runtime_calls(prof) -> dict:
    events = [e for e in prof.events() if e.name.startswith(RUNTIME_PREFIXES) and e.device_type.name == "CPU"]
    totals: dict[str, list[float]] = {}
    for e in events:
        totals.setdefault(e.name, []).append(e.cpu_time_total)
    by_total = sorted(((sum(v) / 1e3, len(v), max(v) / 1e3, name) for name, v in totals.items()), reverse=True)
    longest = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:25]
    return {"by_total_ms": [{"name": n, "total_ms": round(t, 3), "calls": c, "max_ms": round(m, 3)}
                            for t, c, m, n in by_total[:20]],
            "longest": [{"name": e.name, "ms": round(e.cpu_time_total / 1e3, 3), "made_by": _parents(e)}
                        for e in longest]}


def _engine(model: Decoder, mode: str, cuda: bool, **options) -> Engine:
    return Engine(model, EngineConfig(mode=mode, max_num_seqs=256, max_num_batched_tokens=2048, max_seq_len=800,
                                      emulate_graphs=not cuda, **options))


def host_rows(model: Decoder, mode: str, cuda: bool, vocab: int) -> list[dict]:
    engine = _engine(model, mode, cuda, prefill_sizes=(1, 8, 64, 256, 512, 1024, 2048))
    gen = torch.Generator().manual_seed(0)
    _submit(engine, vocab, gen, 64, 512, 32)
    engine.run()  # warm-up: every path once
    rows = []
    for name, (count, prompt, new, running, spread) in WORKLOADS.items():
        engine.reset_stats()
        profiler = cProfile.Profile()
        profiler.enable()
        _closed_loop(engine, vocab, gen, count, prompt, new, running, spread)
        profiler.disable()
        stats, summary = pstats.Stats(profiler), engine.stats()
        rows.append({"profile": "host", "workload": name, "requests": count, "prompt": prompt, "new": new,
                     "engine_stats": summary, "by_tottime": _top(stats, "tottime"),
                     "by_cumtime": _top(stats, "cumulative")})
        print(f"== host, {name}: {count} requests, {prompt} prompt tokens, {new} new")
        print(json.dumps({k: summary.get(k) for k in ("by_kind", "ms_per_step", "phase_ms", "plan_us")}, default=str))
        print(rows[-1]["by_tottime"])
        print(rows[-1]["by_cumtime"])
    return rows


def cuda_api_rows(model: Decoder, mode: str, cuda: bool, vocab: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    gen = torch.Generator().manual_seed(0)
    engine = _engine(model, mode, cuda)
    _submit(engine, vocab, gen, 64, 512, 32)
    engine.run()  # warm-up: every path once
    for name in ("c10", "c256"):
        count, prompt, new, running, spread = WORKLOADS[name]
        engine.reset_stats()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            _closed_loop(engine, vocab, gen, count, prompt, new, running, spread)
        summary = engine.stats()
        row = {"profile": "cuda-api", "workload": name, "loop": "overlap", "phase_ms": summary.get("phase_ms"),
               "ms_per_step": summary.get("ms_per_step"), "steps_by_kind": summary.get("by_kind"),
               **_runtime_calls(prof)}
        rows.append(row)
        print(f"== cuda-api, {name}")
        print(json.dumps(row, indent=1, default=str))
    return rows


def _complete(trace: dict, cat: str | tuple[str, ...]) -> list[dict]:
    cats = (cat,) if isinstance(cat, str) else cat
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in cats]


def _within(events: Iterable[dict], start: float, end: float, tid: Any) -> list[dict]:
    return [e for e in events if e["tid"] == tid and start <= e["ts"] and e["ts"] + e["dur"] <= end]


def forward_rows(trace: dict, kinds: list[str]) -> list[dict]:
    """One row per ``forward`` range, in order, with the step kind ``kinds[i]`` (the engine's ``steps``, which
    follow launch order); rows past ``len(kinds)`` are dropped (a trace may end mid-step)."""
    forwards = sorted((e for e in _complete(trace, "user_annotation") if e["name"] == "forward"),
                      key=lambda e: e["ts"])
    runtime = _complete(trace, "cuda_runtime") + _complete(trace, "cuda_driver")
    device = _complete(trace, DEVICE_CATS)
    by_correlation: dict[int, list[dict]] = {}
    for e in device:
        by_correlation.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    rows = []
    for kind, fwd in zip(kinds, forwards):
        calls = _within(runtime, fwd["ts"], fwd["ts"] + fwd["dur"], fwd["tid"])
        launched = [k for c in calls for k in by_correlation.get(c.get("args", {}).get("correlation"), ())]
        by_name: dict[str, float] = {}
        for c in calls:
            by_name[c["name"]] = by_name.get(c["name"], 0.0) + c["dur"] / 1e3
        row = {"kind": kind, "host_ms": fwd["dur"] / 1e3, "runtime_ms": by_name, "kernels": len(launched)}
        if launched:
            first = min(k["ts"] for k in launched)
            row.update(gpu_busy_ms=sum(k["dur"] for k in launched) / 1e3,
                       gpu_span_ms=(max(k["ts"] + k["dur"] for k in launched) - first) / 1e3,
                       queue_ms=(first - fwd["ts"]) / 1e3)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per step kind: the count and the median of each number of :func:`forward_rows`'s ``rows`` (runtime calls:
    the five longest by median)."""
    out: dict[str, dict] = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        entry: dict[str, Any] = {"steps": len(mine)}
        for key in ("host_ms", "gpu_busy_ms", "gpu_span_ms", "queue_ms", "kernels"):
            values = [r[key] for r in mine if key in r]
            if values:
                entry[key] = round(statistics.median(values), 3)
        names = {n for r in mine for n in r["runtime_ms"]}
        medians = {n: statistics.median(r["runtime_ms"].get(n, 0.0) for r in mine) for n in names}
        entry["runtime_ms"] = {n: round(v, 3) for n, v in sorted(medians.items(), key=lambda kv: -kv[1])[:5]}
        out[kind] = entry
    return out


def _step_label(step) -> str:
    shape = "decode" if step.is_decode else ("mixed" if step.decode_rows else "prefill")
    return f"{step.kind}:{shape}"


def timeline_rows(model: Decoder, mode: str, cuda: bool, vocab: int, outdir: Path) -> list[dict]:
    """A short c10 loop (14 requests, 32 new tokens: the first prompts, then one mixed step per arrival) under
    ``torch.profiler`` with each forward marked; the gzipped Chrome trace goes to OUTDIR and
    :func:`summarize` reads it per step kind (host ms against device busy ms)."""
    import gzip

    from torch.profiler import ProfilerActivity, profile, record_function

    engine = _engine(model, mode, cuda)
    gen = torch.Generator().manual_seed(0)
    _submit(engine, vocab, gen, 2, 512, 32)
    engine.run()  # serve-bench's warm-up (two requests): a burst of prompts is first met in the profiled loop
    engine.reset_stats()
    run = engine.executor.run

    def marked_run(*args, **kwargs):
        with record_function("forward"):
            return run(*args, **kwargs)

    engine.executor.run = marked_run
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _closed_loop(engine, vocab, gen, 14, 512, 32, 10, 0.25)
    engine.executor.run = run
    path = outdir / "c10_timeline_trace.json.gz"
    prof.export_chrome_trace(str(path))  # torch gzips a path ending in .gz
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    steps = forward_rows(trace, [_step_label(s) for s in engine.steps])
    row = {"profile": "timeline", "workload": "c10-short", "trace": path.name, "by_kind": summarize(steps),
           "steps": steps}
    print("== timeline, c10-short (medians per step kind)")
    print(json.dumps(row["by_kind"], indent=1))
    return [row]


PROFILES = {"host": host_rows, "cuda-api": cuda_api_rows, "timeline": timeline_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--what", default="host,cuda-api",
                        help="comma-separated: host, cuda-api, timeline (default host,cuda-api)")
    parser.add_argument("--mode", default="auto", help="the engine's mode (default auto)")
    args = parser.parse_args()
    what = [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = [w for w in what if w not in PROFILES]
    if unknown or not what:
        parser.error(f"--what: unknown {unknown}; choose from {', '.join(PROFILES)}")
    from piecegraph.results.schema import environment, result_name, write_result

    cuda = torch.cuda.is_available()
    backend = "flashinfer" if cuda and flashinfer_available(torch.device("cuda")) is None else "torch"
    shape, dtype, device = (QWEN2_5_0_5B, torch.bfloat16, "cuda") if cuda else (TINY, torch.float32, "cpu")
    model = Decoder.random(shape.replace(attention_backend=backend), dtype=dtype, device=device)
    env = environment(attention=backend, model="qwen2.5-0.5b" if cuda else "tiny", dtype=dtype, quant=None,
                      mode=args.mode, dry_run=not cuda)
    path = Path(args.outdir) / result_name(env, "profile_step")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in what:
        extra = {"outdir": path.parent} if name == "timeline" else {}
        rows += PROFILES[name](model, args.mode, cuda, shape.vocab_size, **extra)
        write_result(path, "profile_step", env, rows)  # after each profile: a run cut short keeps what it made
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
