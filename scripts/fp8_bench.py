"""Time an FP8 block on FlashInfer's kernels: eager, breakable, auto and auto with static compiles per size.

Modes: eager, breakable, auto (automatic opaque: piecewise with Inductor pieces) and auto-static (auto with
``compile_sizes="auto"``), at 1 / 16 / 256 / 2048 tokens.

    python scripts/fp8_bench.py OUTDIR [dense|moe] [--modes eager,breakable,auto,auto-static]

``dense``: rmsnorm -> per-tensor FP8 quantization in torch -> bmm_fp8 -> silu_and_mul -> quantization -> bmm_fp8
-> residual, 4 layers (tests/gpu/fp8_block.py); nothing in it is prepared for piecegraph, so auto must find
bmm_fp8 and wrap it by itself. ``moe``: an FP8 mixture-of-experts block on FlashInfer's sm90 grouped GEMM, called
through a method of a FlashInfer object (tests/gpu/fp8_moe_block.py), compiled with ``token_mixing="pad"`` (its
sort is padding-safe). Median of CUDA-event-timed calls after warm-up (``bench.harness.time_ms``, as the bench
times) and each mode's error against eager. Writes ``<date>_<gpu>_fp8_<block>_bench.json`` under OUTDIR after
every mode (a run cut short keeps what it measured). CUDA (sm90 for ``moe``) and FlashInfer only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MODES = {"eager": None, "breakable": {"mode": "breakable"}, "auto": {"mode": "auto"},
         "auto-static": {"mode": "auto", "compile_sizes": "auto"}}
SIZES = (1, 16, 256, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("block", nargs="?", default="dense", choices=("dense", "moe"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fp8_bench.py needs CUDA and FlashInfer")
    import flashinfer  # noqa: F401  (fails here, before any work, without FlashInfer)

    import piecegraph
    from piecegraph.adapters import flashinfer as adapter
    from piecegraph.bench.harness import time_ms
    from piecegraph.results.schema import environment, result_name, write_result

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))  # the blocks the GPU tests use
    from fp8_block import Block
    from fp8_moe_block import MoEBlock

    torch.manual_seed(0)
    model = (MoEBlock if args.block == "moe" else Block)().eval()
    extra = {"token_mixing": "pad"} if args.block == "moe" else {}
    inputs = {n: torch.randn(n, model.hidden, device="cuda", dtype=torch.bfloat16) for n in SIZES}
    env = environment(attention=None, model=f"fp8_{args.block}_block", dtype="bfloat16", quant="fp8",
                      sizes=list(SIZES))
    what = f"fp8_{args.block}_bench"
    path = Path(args.outdir) / result_name(env, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    ms: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        reference = {n: model(x) for n, x in inputs.items()}
        for name in modes:
            options = MODES[name]
            start = time.perf_counter()
            fn = model if options is None else piecegraph.compile(model, capture_sizes=SIZES, **options, **extra)
            errors = {}
            for n, x in inputs.items():
                out = fn(x)  # the first call traces, compiles and captures (setup)
                errors[n] = ((out.float() - reference[n].float()).norm() / reference[n].float().norm()).item()
            setup_s = time.perf_counter() - start
            stats = {}
            if options is not None:
                full = fn.stats()
                stats = {k: full.get(k) for k in ("mode", "replays", "fallbacks", "auto_opaque", "static_compile_s",
                                                  "static_sizes")}
            ms[name] = {}
            for n, x in inputs.items():
                ms[name][n] = time_ms(lambda i, fn=fn, x=x: fn(x), warmup=5, repeats=50)
                rows.append({"mode": name, "tokens": n, "ms": ms[name][n], "rel_err": errors[n], "setup_s": setup_s,
                             **({"stats": stats} if stats else {})})
            print(name, json.dumps({n: round(v, 4) for n, v in ms[name].items()}), f"setup {setup_s:.1f} s",
                  flush=True)
            write_result(path, what, env, rows)
            del fn
            adapter.uninstall()
            piecegraph.unfreeze()
            torch._dynamo.reset()
    speedup = {n: {m: ms["breakable"][n] / ms[m][n] for m in ("auto", "auto-static") if m in ms}
               for n in SIZES} if "breakable" in ms else {}
    write_result(path, what, env, rows, speedup_over_breakable=speedup)
    print("speedup over breakable", json.dumps(speedup))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
