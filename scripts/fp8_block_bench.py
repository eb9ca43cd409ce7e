"""Time the FP8 block (scripts/fp8_block.py) side by side: eager, breakable, auto (automatic opaque: piecewise
with Inductor pieces) and auto with static compiles per size (compile_sizes="auto"), at 1 / 16 / 256 / 2048
tokens. Median of CUDA-event-timed calls after warm-up (``bench.harness.time_ms``, as the bench times); each
mode's error against eager; JSON written after every mode (a run cut short keeps what it measured).
``moe`` times the FP8 mixture-of-experts block (scripts/fp8_moe_block.py: FlashInfer's sm90 grouped GEMM through
a method of a FlashInfer object) instead, compiled with ``token_mixing="pad"`` (its sort is padding-safe).
Usage: fp8_block_bench.py OUT.json [dense|moe] [MODES, comma-separated; default all]"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_block import Block  # noqa: E402
from fp8_moe_block import MoEBlock  # noqa: E402

import piecegraph  # noqa: E402
from piecegraph.adapters import flashinfer as adapter  # noqa: E402
from piecegraph.bench.harness import time_ms  # noqa: E402

SIZES = (1, 16, 256, 2048)
MODES = {"eager": None, "breakable": {"mode": "breakable"}, "auto": {"mode": "auto"},
         "auto-static": {"mode": "auto", "compile_sizes": "auto"}}


def main(out: str, block: str = "dense", modes: str = ",".join(MODES)) -> None:
    import flashinfer

    torch.manual_seed(0)
    model = (MoEBlock if block == "moe" else Block)().eval()
    extra = {"token_mixing": "pad"} if block == "moe" else {}
    inputs = {n: torch.randn(n, model.hidden, device="cuda", dtype=torch.bfloat16) for n in SIZES}
    result = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                      "flashinfer": flashinfer.__version__, "sizes": SIZES, "block": block}, "modes": {}}
    with torch.no_grad():
        reference = {n: model(x) for n, x in inputs.items()}
        for name in modes.split(","):
            options = MODES[name]
            start = time.perf_counter()
            fn = model if options is None else piecegraph.compile(model, capture_sizes=SIZES, **options, **extra)
            row = {"ms": {}, "rel_err": {}}
            for n, x in inputs.items():
                out_n = fn(x)  # the first call traces, compiles and captures (setup)
                row["rel_err"][n] = ((out_n.float() - reference[n].float()).norm() / reference[n].float().norm()
                                     ).item()
            row["setup_s"] = time.perf_counter() - start
            for n, x in inputs.items():
                row["ms"][n] = time_ms(lambda i, fn=fn, x=x: fn(x), warmup=5, repeats=50)
            if options is not None:
                stats = fn.stats()
                row["stats"] = {k: stats.get(k) for k in ("mode", "replays", "fallbacks", "auto_opaque",
                                                           "static_compile_s", "static_sizes")}
            result["modes"][name] = row
            print(name, json.dumps(row, default=str), flush=True)
            Path(out).write_text(json.dumps(result, indent=1, default=str))
            del fn
            adapter.uninstall()
            piecegraph.unfreeze()
            torch._dynamo.reset()
    ratios = {n: {m: result["modes"]["breakable"]["ms"][n] / result["modes"][m]["ms"][n]
                  for m in ("auto", "auto-static") if m in result["modes"]} for n in SIZES
              } if "breakable" in result["modes"] else {}
    result["speedup_over_breakable"] = ratios
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print("speedup over breakable", json.dumps(ratios))


if __name__ == "__main__":
    main(*sys.argv[1:4])
