"""Start in seconds, on a GPU: a second process with the artifact cache warm loads the traced
programs and their AOTInductor packages (no Dynamo, no Inductor) and is ready (every capture size captured) in
<= 5 s; a cold start without FlashInfer's first JIT build in <= 30 s; the graph memory estimated before capture
within 10% of the pool capture used; each size's capture milliseconds. Writes ``startup_gpu.json`` under
``$PIECEGRAPH_OUT``. The 0.5B shape of the reference decoder, bf16, FlashInfer attention when it imports (else
torch's). ``PIECEGRAPH_START_MODEL=tiny`` for a quick run; the start script runs on CPU too
(``PIECEGRAPH_START_DEVICE=cpu``, graphs emulated), a dry run of it. The three starts take over 300 s on a fresh
H200 (the first builds FlashInfer's kernels, the second packages): give the part a call of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]

START = REPO / "scripts" / "startup.py"



def _start(cache_dir: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, str(START), "modules", str(cache_dir)], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_warm_start_and_cold_start_without_jit_build(tmp_path, record_result):
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    # FlashInfer's JIT workspace stays where it is (not under the fresh cache): its first build is timed on its
    # own by the first start, the cold start then measures piecegraph's and torch's work only.
    env.setdefault("FLASHINFER_WORKSPACE_BASE", str(Path.home()))
    jit = _start(tmp_path / "jit", env)
    cold = _start(tmp_path / "cache", {**env, "PIECEGRAPH_START_WAIT_PACKAGING": "1"})  # ready, then packaged
    warm = _start(tmp_path / "cache", env)
    record_result("startup_gpu.json", "jit_first", jit)
    record_result("startup_gpu.json", "cold", cold)
    record_result("startup_gpu.json", "warm", warm)
    summary = {"first_process_ready_s": jit["ready_s"], "cold_ready_s": cold["ready_s"],
               "cold_without_jit_s": cold["ready_s"] - sum(s["prewarm_s"] for s in cold["startup"].values()),
               "warm_ready_s": warm["ready_s"], "warm_from_interpreter_s": warm["from_interpreter_s"],
               "import_piecegraph_s": warm["import_piecegraph_s"],
               "background_packaging_s": {k: s.get("seconds") for k, s in cold["packaging"].items()}}
    record_result("startup_gpu.json", "summary", summary)
    assert [s["cache"] for s in cold["startup"].values()] == ["cold", "cold"]
    assert [s["cache"] for s in warm["startup"].values()] == ["warm", "warm"]
    # the AOTInductor packages (Config.aot_package, on by default on CUDA): no Dynamo, Inductor or sympy imported
    assert [s["trace"] for s in warm["startup"].values()] == ["packaged", "packaged"]
    assert warm["compiler_imported"] == []
    assert [s["state"] for s in cold["packaging"].values()] == ["done", "done"], cold["packaging"]
    # The cold start ran Inductor's code, the warm one AOTInductor's of the same graphs: equal to bf16 rounding.
    assert torch.allclose(torch.tensor(warm["out_head"]), torch.tensor(cold["out_head"]), rtol=2e-2, atol=2e-2)
    assert summary["cold_without_jit_s"] <= 30, summary
    assert summary["warm_ready_s"] <= 5, summary


def test_graph_memory_estimate_within_ten_percent_and_capture_ms(record_result):
    import piecegraph
    from piecegraph.attention import KVCache, flashinfer_available
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder, dummy_inputs

    shape = TINY if os.environ.get("PIECEGRAPH_START_MODEL") == "tiny" else QWEN2_5_0_5B
    backend = "torch" if flashinfer_available(torch.device("cuda")) else "flashinfer"
    model = Decoder.random(shape, dtype=torch.bfloat16, device="cuda")
    cache = KVCache.for_sequences(shape, 8, 640, dtype=torch.bfloat16, device="cuda", backend=backend)
    result = {}
    for compiler in ("inductor", "eager"):
        graphed = piecegraph.compile(model, mode="piecewise", max_tokens=512, compiler=compiler)
        graphed.capture(lambda n: dummy_inputs(model, cache, n))
        stats = graphed.stats()
        memory = stats["graph_memory"]
        result[compiler] = {
            "pool_bytes": stats["pool_bytes"], "estimate_bytes": memory["pool_estimate_bytes"],
            "ratio": stats["pool_bytes"] / max(memory["pool_estimate_bytes"], 1),
            "workspace_bytes": memory["workspace_bytes"],  # the cuBLAS workspace counted in the estimate
            "ratio_without_workspace": stats["pool_bytes"] / max(
                memory["pool_estimate_bytes"] - memory["workspace_bytes"], 1),
            "per_size_estimate": memory["estimate_bytes"], "live_bytes": memory["live_bytes"],
            "measured_bytes": memory.get("pool_measured_bytes"),  # before the first capture, in a pool of its own
            "measured_ratio": stats["pool_bytes"] / max(memory.get("pool_measured_bytes") or 0, 1),
            "capture_ms": {n: round(s * 1e3, 2) for n, s in stats["capture_s"].items()},
            "startup": stats["startup"],
        }
        del graphed
        torch.cuda.empty_cache()
    record_result("startup_gpu.json", "graph_memory", result)
    for compiler, r in result.items():
        assert 0.9 <= r["ratio"] <= 1.1, (compiler, r["pool_bytes"], r["estimate_bytes"])
        assert 0.9 <= r["measured_ratio"] <= 1.1, (compiler, r["pool_bytes"], r["measured_bytes"])


def test_a_pool_measured_in_an_eager_run_matches_the_capture_of_the_same_code(record_result):
    """graphs/memory.py's measured_pool_bytes against a second measurement: the same function captured into a graph
    pool of its own (pool_bytes from the allocator's segments). Blocks of all three classes: small, mid, large."""
    from piecegraph.graphs.capture import pool_bytes
    from piecegraph.graphs.memory import measured_pool_bytes

    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3000, device="cuda", dtype=torch.bfloat16)

    def step():
        h = (x @ w).float()  # 48 MiB: large
        g = torch.nn.functional.silu(h[:, :1500]) * h[:, 1500:]
        small = g[:64].sum(0)  # small blocks
        mid = g[:512].to(torch.bfloat16).clone()  # ~1.5 MiB: a mid block
        return small, mid.sum(), g.amax()

    step()
    torch.cuda.synchronize()
    measured = measured_pool_bytes(step)
    stream, handle, graph = torch.cuda.Stream(), torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # the side stream's cuBLAS workspace, outside the pool (as the measurement's stream has it)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, pool=handle, stream=stream):
        step()
    captured = pool_bytes(handle)
    record_result("startup_gpu.json", "measured_pool_unit", {"measured": measured, "captured": captured})
    assert measured and 0.9 <= captured / measured <= 1.1, (measured, captured)
