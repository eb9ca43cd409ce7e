"""Which CUDA runtime calls block the engine's host loop: the 0.5B shape (bf16, FlashInfer attention when it
imports) served by one engine mode, overlapped and synchronous, the "c256" workload of profile_serve_step.py (256
requests of 512 prompt tokens and 32 new, submitted at once: mixed steps, then decode at batch 256) stepped under
torch.profiler after a warm-up round. Per loop: the engine's phase means, the CUDA runtime calls by total host
time (a call that waits for the device, such as a copy from pageable memory or a stream sync, shows as long), and
the longest single calls with the ops that made them. Written to OUT.json and printed.

Why: an overlapped step's host work must not wait for the step before it; torch's sync debug mode sees only the
syncs torch makes, not those inside a kernel library's plan. Without CUDA: a dry run on the tiny shape.
Usage: cuda_api_profile.py OUT.json [MODE]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from piecegraph.attention import flashinfer_available
from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.engine import Engine
from piecegraph.serve.request import SamplingParams

RUNTIME_PREFIXES = ("cuda", "cu")  # runtime and driver API events, as the profiler names them


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


def main(out: str, mode: str = "auto") -> None:
    cuda = torch.cuda.is_available()
    backend = "flashinfer" if cuda and flashinfer_available(torch.device("cuda")) is None else "torch"
    shape, dtype, device = (QWEN2_5_0_5B, torch.bfloat16, "cuda") if cuda else (TINY, torch.float32, "cpu")
    model = Decoder.random(shape.replace(attention_backend=backend), dtype=dtype, device=device)
    result = {"mode": mode, "backend": backend, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if cuda else "none (dry run)"}
    gen = torch.Generator().manual_seed(0)
    for overlap in (True, False):
        engine = Engine(model, EngineConfig(mode=mode, max_num_seqs=256, max_num_batched_tokens=2048,
                                            max_seq_len=640, emulate_graphs=not cuda, overlap=overlap))

        def submit(engine: Engine, count: int, prompt: int = 512, new: int = 32) -> None:
            for _ in range(count):
                engine.add_request(torch.randint(0, min(1000, shape.vocab_size), (prompt,), generator=gen).tolist(),
                                   SamplingParams(max_new_tokens=new))

        submit(engine, 64)
        engine.run()  # warm-up: every path once
        engine.reset_stats()
        submit(engine, 256)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.run()
        summary = engine.stats()
        name = "overlap" if overlap else "sync"
        result[name] = {"phase_ms": summary.get("phase_ms"), "ms_per_step": summary.get("ms_per_step"),
                        "steps_by_kind": summary.get("by_kind"), **_runtime_calls(prof)}
        print(f"== {mode}, {name}")
        print(json.dumps(result[name], indent=1, default=str))
        Path(out).write_text(json.dumps(result, indent=1, default=str))
        del engine
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:3])
