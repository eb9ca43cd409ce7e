"""Which allocations a piecewise capture puts in the graph pool, against the estimate (issue 24: the estimate is
within 10% on the dense 0.5B shape, but 140 MB against a 338 MB pool on the FP8 MoE). One capture size of a preset
is captured under torch's allocation history; the allocations that land in the graph pool's segments are grouped
by their innermost frame in piecegraph, Inductor's generated code or the model, and printed and written with
their bytes, beside ``stats()["graph_memory"]``. A first, unrecorded capture builds the JIT kernels and fills
Inductor's cache; its pool stays, so ``pool_segments_bytes`` counts both pools (``pool_bytes`` is the recorded
module's). The sums are of every allocation made in the pool during the capture (freed blocks are reused), not
a peak. CUDA only.

    python scripts/pool_snapshot.py OUT.json [MODEL] [QUANT] [SIZE]     (defaults: qwen1.5-moe-a2.7b fp8 2048)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.cli_common import load_model
from piecegraph.graphs.capture import release_compiled
from piecegraph.models.generate import dummy_inputs


def site(frames: list[dict]) -> str:
    """The innermost frame in piecegraph, Inductor's generated code, FlashInfer or the model (frames come innermost
    first), as ``file:line function``; the innermost frame of all when none is."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in ("piecegraph/", "torchinductor", "flashinfer/")):
            return f"{name.split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?" if not frames else f"{frames[0].get('filename', '?').split('/')[-1]}:{frames[0].get('line')}"


def main(out: str, model_name: str = "qwen1.5-moe-a2.7b", quant: str = "fp8", size: str = "2048") -> None:
    n = int(size)
    model = load_model(model_name, "cuda", torch.bfloat16, quant=quant)
    cache = KVCache.for_sequences(model.config, 4, 64, dtype=torch.bfloat16, device="cuda", backend="flashinfer")
    torch.cuda.synchronize()
    graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(n,), max_tokens=n, auto_opaque=True)
    graphed.capture(lambda k: dummy_inputs(model, cache, k))  # trace, compile (prewarm builds the JIT kernels)
    del graphed
    release_compiled()  # the next compile loads the same pieces from Inductor's cache
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(n,), max_tokens=n, auto_opaque=True,
                                 pool=piecegraph.GraphPool())
    graphed.capture(lambda k: dummy_inputs(model, cache, k))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pools = [s for s in snap["segments"] if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    spans = [(s["address"], s["address"] + s["total_size"]) for s in pools]
    sites: Counter = Counter()
    largest: dict[str, int] = {}
    for trace in snap["device_traces"][0] if snap.get("device_traces") else []:
        addr = trace.get("addr", 0)
        if trace.get("action") != "alloc" or not any(lo <= addr < hi for lo, hi in spans):
            continue
        key = site(trace.get("frames", []))
        sites[key] += trace["size"]
        largest[key] = max(largest.get(key, 0), trace["size"])
    stats = graphed.stats()
    report = {"model": model_name, "quant": quant, "size": n,
              "pool_segments_bytes": sum(s["total_size"] for s in pools),
              "pool_bytes": stats["pool_bytes"], "estimate": stats.get("graph_memory"),
              "alloc_bytes_by_site": dict(sites.most_common(40)), "largest_alloc_by_site": largest}
    Path(out).write_text(json.dumps(report, indent=1, default=str))
    print(f"pool {report['pool_bytes'] / 2**20:.0f} MiB (segments {report['pool_segments_bytes'] / 2**20:.0f} MiB), "
          f"estimate {stats['graph_memory'].get('pool_estimate_bytes', 0) / 2**20:.0f} MiB, measured before capture "
          f"{(stats['graph_memory'].get('pool_measured_bytes') or 0) / 2**20:.0f} MiB")
    for key, total in sites.most_common(25):
        print(f"{total / 2**20:10.1f} MiB allocated (largest {largest[key] / 2**20:.1f})  {key}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
