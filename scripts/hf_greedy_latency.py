"""End-to-end greedy latency at batch 1 on a transformers Qwen2 of the 0.5B shape (random weights, bf16, CUDA):
``piecegraph.hf.Session`` (FlashInfer and torch attention) beside transformers' own ``generate`` with its static
cache, compiled (the recipe transformers documents: ``cache_implementation="static"``, which compiles the forward).

Usage: python scripts/hf_greedy_latency.py OUT.json [--new 128] [--prompt 32] [--repeats 5] [--backends LIST]
(``--device cpu --layers 2`` smoke-tests the script itself; its numbers mean nothing there.)

Per-token milliseconds are ``(T(new) - T(1)) / (new - 1)`` from the medians of ``repeats`` timed calls each
(wall clock between two synchronizations: what a caller waits, host work included), so the prefill and the first
token drop out. Tokens are compared with transformers' (a bf16 near-tie may part them: the first divergence is
reported, not judged here). The same weights serve every path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_random_qwen2 import random_qwen2  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm call, and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _per_token(fn: Callable[[int], Any], new: int, repeats: int) -> dict[str, Any]:
    one, _ = _timed(lambda: fn(1), repeats)
    many, tokens = _timed(lambda: fn(new), repeats)
    return {"first_token_ms": one * 1e3, "total_ms": many * 1e3, "ms_per_token": (many - one) * 1e3 / (new - 1),
            "tokens": tokens}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="flashinfer,torch")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    import transformers

    model = random_qwen2(args.layers, device=args.device)
    prompt = torch.randint(0, 1000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    never = model.config.vocab_size  # an EOS id no token can equal: every call makes all its tokens, stops checked
    results: dict[str, Any] = {
        "env": {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none", "torch": torch.__version__,
                "transformers": transformers.__version__, "prompt_tokens": args.prompt, "new_tokens": args.new,
                "repeats": args.repeats, "shape": f"Qwen2 0.5B ({args.layers} layers), random weights, bf16"},
        "rows": {}}
    for backend in args.backends.split(","):
        start = time.perf_counter()
        session = pghf.Session(model, max_seqs=1, max_len=args.prompt + args.new + 16, prefill_tokens=64,
                               backend=backend)
        row = _per_token(lambda n, s=session: s.generate([prompt], n, eos_token_id=never)[0], args.new, args.repeats)
        row["setup_and_warm_s"] = time.perf_counter() - start
        session.close()
        results["rows"][f"piecegraph.hf {backend}"] = row
        print(f"piecegraph.hf ({backend}): {row['ms_per_token']:.3f} ms per token", flush=True)

    ids = torch.tensor([prompt], device=args.device)

    def hf_generate(n: int) -> list[int]:
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             cache_implementation="static", pad_token_id=0)
        return out[0, args.prompt:].tolist()

    start = time.perf_counter()
    hf_generate(args.new)  # compiles: not timed in the per-token number
    row = _per_token(hf_generate, args.new, args.repeats)
    row["setup_and_warm_s"] = time.perf_counter() - start
    results["rows"]["transformers static cache + compile"] = row
    print(f"transformers static cache + compile: {row['ms_per_token']:.3f} ms per token", flush=True)
    reference = row["tokens"]
    for row in results["rows"].values():
        row["first_divergence_from_transformers"] = _first_divergence(row["tokens"], reference)
    base = results["rows"]["transformers static cache + compile"]["ms_per_token"]
    for name, row in results["rows"].items():
        row["speedup_vs_transformers"] = base / row["ms_per_token"]
        print(f"{name}: {row['ms_per_token']:.3f} ms/token ({row['speedup_vs_transformers']:.2f}x transformers), "
              f"first token {row['first_token_ms']:.1f} ms, diverges at {row['first_divergence_from_transformers']}")
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
