"""Per-call overhead of an opaque op against calling the function directly; prints JSON.

Usage: python scripts/opaque_overhead.py [--calls 2000] [--repeats 30] [--profile]
Times a trivial one-kernel function (``x + 1`` on a small tensor, CUDA when available) called directly, through
``piecegraph.opaque`` (torch.library DEF/impl), and through ``torch.library.custom_op`` for reference; with
FlashInfer installed, also ``flashinfer.rmsnorm`` before ``adapters.flashinfer.install()``, after it without
frozen probes, and after it (``--profile`` adds the functions that take the most time per call).
Each figure is the median over ``repeats`` of (wall time of ``calls`` calls, synchronized) / calls, in µs.
"""

import argparse
import json
import statistics
import time

import torch

from piecegraph.ops import opaque


def per_call_us(fn, args, calls, repeats, sync):
    for _ in range(50):
        fn(*args)
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def plus_one(x: torch.Tensor) -> torch.Tensor:
    """A trivial one-kernel function."""
    return x + 1


def _top_functions(fn, args, calls, sync, top=12):
    """The functions that take the most own time over ``calls`` calls (cProfile), as "tottime_us/call name"."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn(*args)
    sync()
    profile.disable()
    stats = pstats.Stats(profile).sort_stats("tottime").stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{tt / calls * 1e6:.2f} us/call x{nc / calls:.0f} {f[2]} ({f[0].rsplit('/', 2)[-1]}:{f[1]})"
            for f, (cc, nc, tt, ct, callers) in rows]


def flashinfer_rows(device, calls, repeats, sync, profile):
    """flashinfer.rmsnorm direct, as an opaque op (adapter, probes not frozen), and with its probes frozen."""
    try:
        import flashinfer
        from piecegraph.ops.adapters import flashinfer as adapter
    except ImportError:
        return {}
    x = torch.randn(8, 1024, device=device, dtype=torch.bfloat16)
    w = torch.ones(1024, device=device, dtype=torch.bfloat16)
    rows = {"flashinfer": flashinfer.__version__,
            "flashinfer_rmsnorm_direct_us": per_call_us(flashinfer.rmsnorm, (x, w), calls, repeats, sync)}
    if profile:
        rows["profile_direct"] = _top_functions(flashinfer.rmsnorm, (x, w), calls, sync)
    adapter.install(freeze_probes=False)
    rows["flashinfer_rmsnorm_opaque_unfrozen_us"] = per_call_us(flashinfer.rmsnorm, (x, w), calls, repeats, sync)
    adapter.install()
    rows["flashinfer_rmsnorm_opaque_us"] = per_call_us(flashinfer.rmsnorm, (x, w), calls, repeats, sync)
    rows["flashinfer_rmsnorm_overhead_us"] = rows["flashinfer_rmsnorm_opaque_us"] - rows["flashinfer_rmsnorm_direct_us"]
    if profile:
        rows["profile_opaque"] = _top_functions(flashinfer.rmsnorm, (x, w), calls, sync)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also list where FlashInfer's calls spend time")
    a = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(16, device=device)
    wrapped = opaque(plus_one, fake="like:x", name="overhead_plus_one")
    custom = torch.library.custom_op("piecegraph_overhead::plus_one", mutates_args=())(plus_one)
    custom.register_fake(lambda x: torch.empty_like(x))
    direct = per_call_us(plus_one, (x,), a.calls, a.repeats, sync)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "direct_us": direct,
        "opaque_us": per_call_us(wrapped, (x,), a.calls, a.repeats, sync),
        "custom_op_us": per_call_us(custom, (x,), a.calls, a.repeats, sync),
    }
    result["opaque_overhead_us"] = result["opaque_us"] - direct
    result["custom_op_overhead_us"] = result["custom_op_us"] - direct
    result.update(flashinfer_rows(device, a.calls, a.repeats, sync, a.profile))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
