"""Per-call overhead of an opaque op against calling the function directly.

Usage: python scripts/opaque_overhead.py [OUTDIR] [--calls 2000] [--repeats 30] [--profile] [--tag TAG]
Times a trivial one-kernel function (``x + 1`` on a small tensor, CUDA when available) called directly, through
``piecegraph.opaque`` (torch.library DEF/impl), and through ``torch.library.custom_op`` for reference; with
FlashInfer installed, also ``flashinfer.rmsnorm`` called directly against the adapter of
``adapters.flashinfer.install()``, first with FlashInfer's probes not frozen, then frozen (``--profile`` adds
the functions that take the most time per call).
Each figure is the median over ``repeats`` of (wall time of ``calls`` calls, synchronized) / calls, in µs; the
variants compared are timed in turns, and each overhead is the median of the per-turn differences. Prints the
figures; with OUTDIR, also writes them there as ``<date>_<gpu>_opaque_overhead[_TAG].json``.
"""

import argparse
import json
import statistics
import time

import torch

from piecegraph.ops import opaque


def per_call_us(variants, calls, repeats, sync):
    """Median µs per call of each ``name -> (fn, args)``, timed in turns (A B A B ...), so that a machine that
    slows down or speeds up during the run shifts every variant alike; also the median per-turn difference of
    each variant against the first one (``<name>_minus_first``)."""
    for fn, args in variants.values():
        for _ in range(50):
            fn(*args)
    sync()
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fn, args) in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            sync()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    first = next(iter(samples.values()))
    result = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in list(samples.items())[1:]:
        result[f"{name}_minus_first"] = statistics.median(v - f for v, f in zip(values, first))
    return result


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
    """flashinfer.rmsnorm direct against the adapter's opaque op: probes not frozen, then frozen (which the
    direct call then goes through too)."""
    try:
        import flashinfer

        from piecegraph.adapters import flashinfer as adapter
    except ImportError:
        return {}
    x = torch.randn(8, 1024, device=device, dtype=torch.bfloat16)
    w = torch.ones(1024, device=device, dtype=torch.bfloat16)
    direct = flashinfer.rmsnorm
    adapter.install(freeze_probes=False)
    pair = {"direct": (direct, (x, w)), "opaque": (flashinfer.rmsnorm, (x, w))}
    rows = {"flashinfer": flashinfer.__version__}
    unfrozen = per_call_us(pair, calls, repeats, sync)
    adapter.install()
    frozen = per_call_us(pair, calls, repeats, sync)
    rows.update({
        "flashinfer_rmsnorm_direct_us": unfrozen["direct"],
        "flashinfer_rmsnorm_opaque_us": unfrozen["opaque"],
        "flashinfer_rmsnorm_overhead_us": unfrozen["opaque_minus_first"],
        "flashinfer_rmsnorm_direct_frozen_probes_us": frozen["direct"],
        "flashinfer_rmsnorm_opaque_frozen_probes_us": frozen["opaque"],
        "flashinfer_rmsnorm_overhead_frozen_probes_us": frozen["opaque_minus_first"],
    })
    if profile:
        rows["profile_direct"] = _top_functions(direct, (x, w), calls, sync)
        rows["profile_opaque"] = _top_functions(flashinfer.rmsnorm, (x, w), calls, sync)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", nargs="?", help="write the result file here (default: print only)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also list where FlashInfer's calls spend time")
    parser.add_argument("--tag", default="", help="appended to the result file's name (e.g. a FlashInfer version)")
    a = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(16, device=device)
    wrapped = opaque(plus_one, fake="like:x", name="overhead_plus_one")
    custom = torch.library.custom_op("piecegraph_overhead::plus_one", mutates_args=())(plus_one)
    custom.register_fake(lambda x: torch.empty_like(x))
    timed = per_call_us({"direct": (plus_one, (x,)), "opaque": (wrapped, (x,)), "custom_op": (custom, (x,))},
                        a.calls, a.repeats, sync)
    result = {
        "direct_us": timed["direct"],
        "opaque_us": timed["opaque"],
        "custom_op_us": timed["custom_op"],
        "opaque_overhead_us": timed["opaque_minus_first"],
        "custom_op_overhead_us": timed["custom_op_minus_first"],
    }
    result.update(flashinfer_rows(device, a.calls, a.repeats, sync, a.profile))
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result, indent=2))
    if a.outdir:
        from pathlib import Path

        from piecegraph.results.schema import environment, result_name, write_result

        env = environment(attention=None, model=None, dtype=None, quant=None, calls=a.calls, repeats=a.repeats)
        what = "opaque_overhead" + (f"_{a.tag}" if a.tag else "")
        path = Path(a.outdir) / result_name(env, what)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiles = {k: result.pop(k) for k in ("profile_direct", "profile_opaque") if k in result}
        rows = [{"figure": k, "value": v} for k, v in result.items()]
        write_result(path, "opaque_overhead", env, rows, **profiles)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
