"""Where an MoE decode step's GPU time goes, FP8 against bf16 (issue 23: FP8 reads half the weight bytes, yet its
served steps ran at 0.91x bf16's speed). For each quant, the MoE preset (random weights) is compiled piecewise
(Inductor pieces, attention eager, every decode batch captured), then:

1. each batch's step is timed with CUDA events (median after warm-up, no profiler: ``bench.harness.time_ms``);
2. a few steps run under ``torch.profiler`` and the kernels are summed by kind (experts' GEMM, dense GEMMs,
   attention, Inductor's fused kernels, routing sort, the rest), with the top kernels by GPU time.

Kernels inside CUDA graph replays are reported by CUPTI; ``kernels_seen`` says how many per step were, so a profile
that saw none says so instead of summing nothing. The ideal step reads its weights once: ``weight_floor_ms`` is
those bytes (``bench.cases.weight_bytes_read``: the experts only as far as top-k routing reaches) at 4.8 TB/s.

    python scripts/moe_step_profile.py OUT.json [MODEL] [BATCHES]     (defaults: qwen1.5-moe-a2.7b, 1,16,256)

Without CUDA: a dry run of the tiny MoE on the CPU (``none`` mode, torch kernels), to check the script runs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from piecegraph.bench import modes as bench_modes
from piecegraph.bench.cases import capture_inputs, decode_cache, decode_cases, weight_bytes_read
from piecegraph.bench.harness import time_ms
from piecegraph.context import forward_context

CONTEXT = 576  # cached tokens per sequence: the served workload's mean prompt (512) plus half its output
KINDS = (  # first match wins; kernel names as CUPTI reports them (Inductor's fused kernels first: their names
    # hold the ops they fuse, FlashInfer's among them)
    ("fused_triton", re.compile(r"^triton_")),
    ("attention", re.compile(r"BatchPrefill|BatchDecode|flashinfer::.*(Prefill|Decode)|AttentionKernel|flash|fmha",
                             re.I)),
    ("experts_gemm", re.compile(r"grouped|segment|_grouped_mm|GroupProblem|ptr_array|cutlass.*gemm", re.I)),
    ("dense_gemm", re.compile(r"gemm|nvjet|xmma|cublas|sm90_", re.I)),
    ("routing_sort", re.compile(r"sort|radix|topk|scan", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_rows(prof: torch.profiler.profile, steps: int) -> list[dict]:
    """Every device kernel of the profile, summed by name: ``{"name", "kind", "us_per_step", "calls_per_step"}``."""
    rows: dict[str, dict] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name.startswith(("Memcpy", "Memset")):
            continue
        row = rows.setdefault(event.name, {"name": event.name[:120], "kind": kind_of(event.name), "us": 0.0,
                                           "calls": 0})
        row["us"] += event.device_time  # microseconds
        row["calls"] += 1
    out = [{"name": r["name"], "kind": r["kind"], "us_per_step": r["us"] / steps, "calls_per_step": r["calls"] / steps}
           for r in rows.values()]
    return sorted(out, key=lambda r: -r["us_per_step"])


def profile_step(fn, args, meta, steps: int = 5) -> list[dict]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with forward_context(meta):
        fn(*args)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                fn(*args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    return kernel_rows(prof, steps)


def run_quant(model_name: str, quant: str, batches: list[int], cuda: bool) -> dict:
    from piecegraph.cli_common import load_model

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = load_model(model_name, device, dtype, quant=quant)
    cache = decode_cache(model, batches, CONTEXT, backend="flashinfer" if cuda else "torch")
    cases = decode_cases(model, cache, batches, CONTEXT)
    prepared = bench_modes.prepare("piecewise" if cuda else "none", model, batches, [], capture_inputs(model, cache))
    result = {"setup_s": prepared.setup_s, "batches": {}}
    with torch.no_grad():
        for case in cases:
            with forward_context(case.meta):
                ms = time_ms(lambda i, c=case, fn=prepared.fn: fn(*c.args(i)), warmup=5, repeats=30)
            kernels = profile_step(prepared.fn, case.args(0), case.meta)
            kinds: dict[str, float] = {}
            for row in kernels:
                kinds[row["kind"]] = kinds.get(row["kind"], 0.0) + row["us_per_step"]
            floor = weight_bytes_read(model, case.size)
            result["batches"][case.size] = {
                "step_ms": ms, "kernels_seen": sum(r["calls_per_step"] for r in kernels),
                "kernel_ms": sum(kinds.values()) / 1e3, "by_kind_ms": {k: v / 1e3 for k, v in sorted(kinds.items())},
                "weight_floor_ms": floor / 4.8e12 * 1e3, "weight_bytes": floor, "top": kernels[:15]}
            print(quant, case.size, json.dumps({k: v for k, v in result["batches"][case.size].items() if k != "top"},
                                               default=str), flush=True)
    del prepared, cases, cache, model
    bench_modes.release()
    return result


def main(out: str, model_name: str = "qwen1.5-moe-a2.7b", batches: str = "1,16,256") -> None:
    cuda = torch.cuda.is_available()
    if not cuda:
        model_name = "tiny-moe"
    sizes = [int(b) for b in batches.split(",")]
    report: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                            "model": model_name, "context": CONTEXT, "mode": "piecewise" if cuda else "none"}}
    for quant in ("bf16", "fp8"):
        report[quant] = run_quant(model_name, quant, sizes, cuda)
        Path(out).write_text(json.dumps(report, indent=1, default=str))
    for b in sizes:
        bf16, fp8 = report["bf16"]["batches"][b], report["fp8"]["batches"][b]
        report.setdefault("fp8_over_bf16_step", {})[b] = fp8["step_ms"] / bf16["step_ms"]
    Path(out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["fp8_over_bf16_step"]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
