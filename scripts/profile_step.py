"""Where a serving step's host time goes: an engine stepped under a profiler after a warm-up round.

The engine serves the 0.5B shape (bf16, FlashInfer attention when it imports) in one mode (default auto).

    python scripts/profile_step.py OUTDIR [--what host,cuda-api] [--mode auto]

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

Writes one result file under OUTDIR (``<date>_<gpu>_profile_step.json``, one row per workload and profile) and
prints each row's summary. Without CUDA: a dry run on the tiny shape (graphs emulated), to check the script runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

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


PROFILES = {"host": host_rows, "cuda-api": cuda_api_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--what", default="host,cuda-api", help="comma-separated: host, cuda-api (default both)")
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
        rows += PROFILES[name](model, args.mode, cuda, shape.vocab_size)
        write_result(path, "profile_step", env, rows)  # after each profile: a run cut short keeps what it made
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
