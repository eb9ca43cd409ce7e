"""Where the attention split op's host time goes, per call, on a CUDA machine (decode batch 1 and a 512-token
prefill, 0.5B attention shape, bf16): the whole op through the dispatcher, the backend's forward alone, and for
FlashInfer its cache write and its run() alone. Median host microseconds over 200 calls, each started on an
idle GPU. Prints one JSON object.

Usage: python scripts/attention_cost.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import QWEN2_5_0_5B


def _us(fn, calls: int = 200, warmup: int = 10) -> float:
    times = []
    for i in range(warmup + calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def _case(backend: str, seqs, cached: int) -> dict[str, float]:
    config = QWEN2_5_0_5B.replace(num_layers=1, max_seq_len=cached + 520)
    cache = KVCache.for_sequences(config, len(seqs), cached + 520, dtype=torch.bfloat16, device="cuda",
                                  backend=backend)
    if cached:
        cache.reserve((s, cached + 1) for s, _, _ in seqs)
    meta = AttentionMetadata.for_batch(cache, seqs)
    n, d = meta.num_tokens, config.head_dim
    q = torch.randn(n, config.num_heads * d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, config.num_kv_heads * d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    qn, kn, vn, on = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d), out.view(n, -1, d)
    op = torch.ops.piecegraph_models.attention
    result = {}
    with torch.no_grad(), forward_context(meta):
        result["op"] = _us(lambda: op(q, k, v, out, 0))
        result["backend_forward"] = _us(lambda: cache.backend.forward(qn, kn, vn, on, 0, meta))
        if backend == "flashinfer":

            plan = meta.plan
            kv = (cache.k[0], cache.v[0])
            flat = (cache.k[0].view(-1, *kn.shape[1:]), cache.v[0].view(-1, *vn.shape[1:]))
            result["kv_write_index_copy"] = _us(lambda: (flat[0].index_copy_(0, meta.slot_mapping, kn),
                                                         flat[1].index_copy_(0, meta.slot_mapping, vn)))
            result["wrapper_run"] = _us(lambda: plan.slot.wrapper.run(qn, kv, out=on))
        result["metadata_build_and_plan"] = _us(lambda: AttentionMetadata.for_batch(cache, seqs), calls=50)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    prefill = [(i, 0, n) for i, n in enumerate((112, 32, 80, 16, 48, 128, 32, 64))]  # 512 tokens, mixed
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for backend in ("flashinfer", "torch"):
        report[backend] = {"decode_1": _case(backend, [(0, 256, 1)], 256), "prefill_512": _case(backend, prefill, 0)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
