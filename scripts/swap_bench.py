"""Decode speed before and after the swap (issue 24): an engine started cold with its full module compiled by pieces
(``EngineConfig(full_compile="pieces")``, packaging in the background) serves closed loops on that program, waits
for the background workers, lets the idle engine swap the whole graph's package in (``Engine.idle_work``), and serves
the same loops again; the decode-only ITL floor (concurrency 1) is timed on each side too. One process, one engine:
the two sides differ only by the full module's program (and auto's decode choice, timed again after the swap).

    python scripts/swap_bench.py OUT.json [CACHE_DIR]

CACHE_DIR must be empty or absent (a cold start); default: a fresh temporary folder. PIECEGRAPH_SWAP_MODEL=tiny and
PIECEGRAPH_SWAP_DEVICE=cpu make a dry run (graphs emulated: no speed to read); PIECEGRAPH_SWAP_CONC: the
concurrencies (default 1,64,256); PIECEGRAPH_SWAP_REPEATS: runs per concurrency (the median output tok/s is kept).
A row during which the swap happened anyway (the workers finished early) says so (``swapped_during``), and each
row counts the packaging workers running at its start and end (``workers_busy``): rows before the swap run beside
them, as a freshly started server does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(out_path: str, cache_dir: str | None = None) -> None:
    import torch

    from piecegraph.cache import wait_packaging
    from piecegraph.cache.packaging import running
    from piecegraph.cli_common import load_model, resolve_attention
    from piecegraph.serve import Engine, EngineConfig
    from piecegraph.serve.bench import Workload, decode_reference, measure, median_run, requests_for

    cache_dir = cache_dir or tempfile.mkdtemp(prefix="pg-swap-")
    if Path(cache_dir).exists() and any(Path(cache_dir).iterdir()):
        raise SystemExit(f"{cache_dir} is not empty: the swap needs a cold start")
    device = os.environ.get("PIECEGRAPH_SWAP_DEVICE", "cuda")
    gpu = device == "cuda"
    name = os.environ.get("PIECEGRAPH_SWAP_MODEL", "qwen2.5-0.5b" if gpu else "tiny")
    conc = [int(c) for c in os.environ.get("PIECEGRAPH_SWAP_CONC", "1,64,256").split(",")]
    repeats = int(os.environ.get("PIECEGRAPH_SWAP_REPEATS", "3"))
    backend = resolve_attention("auto", device)
    model = load_model(name, device, torch.bfloat16 if gpu else torch.float32)
    work = Workload(512, 128) if gpu else Workload(32, 8)
    config = EngineConfig(mode="auto", max_num_seqs=max(conc), max_num_batched_tokens=2048, page_size=16,
                          max_seq_len=-(-work.max_len // 16) * 16, emulate_graphs=not gpu, attention_backend=backend,
                          cache_dir=cache_dir, aot_package=True, full_compile="pieces")
    floor_steps = min(64, config.max_seq_len - work.input_len - 1)
    began = time.perf_counter()
    engine = Engine(model, config)
    ready_s = time.perf_counter() - began
    full = engine.executor.decode.module
    engine.generate([[1, 2, 3]] * 4)  # warm-up

    def busy_workers() -> int:  # packaging workers running now (their CPU use is part of what a row measures)
        folder = Path(cache_dir) / "packaging"
        return sum(running(cache_dir, p.stem) for p in folder.glob("*.json")) if folder.exists() else 0

    def side() -> dict:
        rows = []
        for c in conc:
            items = work.requests(requests_for(c, 3.0, 4, 1024), model.config.vocab_size, salt=c)
            swaps, busy = full.swaps, busy_workers()
            row = median_run(lambda c=c, items=items: measure(engine, items, c), repeats)
            rows.append({**row, "swapped_during": full.swaps != swaps, "workers_busy": [busy, busy_workers()]})
        return {"rows": rows, "itl_floor": decode_reference(engine, work.input_len, floor_steps),
                "decode_choice": engine.capture_report().get("decode_choice"),
                "aot": engine.capture_report()["modules"]["full"]["startup"].get("aot")}

    before = side()
    waited = time.perf_counter()
    packaging = wait_packaging(cache_dir, timeout=900)
    packaging_wait_s = time.perf_counter() - waited
    swap_s, deadline = None, time.monotonic() + 10
    while full.swaps == 0 and time.monotonic() < deadline:  # the module looks at most once a second
        start = time.perf_counter()
        engine.idle_work()
        if full.swaps:
            swap_s = time.perf_counter() - start
        time.sleep(0.05)
    after = side()
    ratios = {str(a["concurrency"]): round(a["output_tok_s"] / b["output_tok_s"], 3)
              for a, b in zip(after["rows"], before["rows"])}
    result = {
        "note": "decode by pieces (before) vs the whole graph's package swapped in (after), one engine, one process",
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__, "model": name,
        "attention": backend, "concurrency": conc, "repeats": repeats, "ready_s": round(ready_s, 2),
        "packaging": packaging, "packaging_wait_s": round(packaging_wait_s, 1), "swapped": full.swaps > 0,
        "swap_s": swap_s, "before": before, "after": after, "output_tok_s_after_over_before": ratios,
    }
    Path(out_path).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"ready_s": result["ready_s"], "swapped": result["swapped"], "swap_s": swap_s,
                      "after_over_before": ratios}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
