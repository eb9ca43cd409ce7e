"""serve-bench and its numbers: the command on CPU (its rows, the median of the repeats, the result and capture
tables), the FP8 MoE preset, the engine demo, the sizes it serves, the GPU-bound estimate (its arithmetic, its
engine timer, the rows the cache holds), and ``release`` between modes."""

import json

import pytest
import serve_helpers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import small_engine_config
from typer.testing import CliRunner

from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.cli import app
from piecegraph.results import load_result
from piecegraph.serve import Engine, serve_sizes
from piecegraph.serve.bench import requests_for
from piecegraph.serve.report import results_of

pytestmark = pytest.mark.usefixtures("one_thread")


model = serve_helpers.model  # the module-scoped TINY decoder (seed 3) the serving tests share


def test_serve_sizes():
    assert serve_sizes(1) == (1,)
    assert serve_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert requests_for(1, 3, 4, 1024) == 4 and requests_for(1024, 3, 4, 1024) == 1024
    assert requests_for(2048, 3, 4, 1024) == 2048  # never fewer than one per client


def test_serve_bench_smoke_on_cpu(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = CliRunner().invoke(app, [
        "serve-bench", "--device", "cpu", "--model", "tiny", "--modes", "eager,auto,auto-sync", "--concurrency", "1,3",
        "--requests", "2,4", "--input-len", "12", "--output-len", "4", "--max-batched-tokens", "32",
        "--compiler", "eager", "--warmup", "1", "--repeats", "3", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "serve-bench" and "modes" not in data  # the one result schema
    assert [(r["mode"], r["concurrency"]) for r in data["rows"]] == [
        (m, c) for m in ("eager", "auto", "auto-sync") for c in (1, 3)]
    assert list(data["setup"]) == ["eager", "auto", "auto-sync"] and "rows" not in data["setup"]["auto"]
    per_mode = results_of(load_result(out))  # the per-mode results the tables and the plot take
    modes = {m["mode"]: m for m in per_mode}
    assert data["env"]["repeats"] == 3 and data["env"]["gpu"] == "cpu" and data["env"]["attention"] == "torch"
    assert data["env"]["attention_kernel"] == TorchBackend.kernel  # the kernel the caches ran, named
    for row in data["rows"]:  # three runs each, the median one reported
        runs = row["repeats_output_tok_s"]
        assert len(runs) == 3 and round(row["output_tok_s"], 1) == sorted(runs)[1], row
        assert row["gc_pause_ms"] >= 0 and row["gc_full"] >= 0 and len(row["repeats_gc_pause_ms"]) == 3
    assert set(modes) == {"eager", "auto", "auto-sync"} and png.stat().st_size > 0
    assert [m["rows"][0]["overlap"] for m in per_mode] == [True, True, False]
    assert "decode_reference" not in modes["auto-sync"]  # the same loop as auto's: timed once
    for m in modes.values():
        assert [r["concurrency"] for r in m["rows"]] == [1, 3]
        assert [r["requests"] for r in m["rows"]] == [2, 4]
        assert all(r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 for r in m["rows"])
    assert all(r["graph_share"] == 1.0 for r in modes["auto"]["rows"] + modes["auto-sync"]["rows"])
    assert all(r["max_plans_per_step"] == 1 and r["plan_us"] for r in modes["auto"]["rows"])  # torch: 1 plan/step
    assert "plan us" in result.output and "replays" in result.output and "GC pauses" in result.output
    assert all(r["graph_share"] == 0.0 for r in modes["eager"]["rows"])
    assert modes["auto"]["decode_reference"]["itl_p50_ms"] > 0
    assert modes["auto"]["capture"]["modules"]["full"]["sizes"][-1] == 3


def test_capture_table_shows_each_modules_pool_estimated_and_measured_before_capture():
    from rich.console import Console

    from piecegraph.serve.report import capture_table

    module = {"sizes": [1, 2048], "capture_s": 1.0, "setup_s": 2.0, "startup": {"trace_s": 1.0},
              "graph_memory": {"pool_estimate_bytes": 134 << 20, "pool_measured_bytes": 314 << 20}}
    bare = {**module, "graph_memory": {"pool_estimate_bytes": 5 << 20}}
    results = [{"mode": "piecewise", "capture": {"modules": {"piecewise": module}, "pool_mib": 314.0}},
               {"mode": "auto", "capture": {"modules": {"piecewise": bare}, "pool_mib": 5.0}}]
    console = Console(width=300, record=True)
    console.print(capture_table(results))
    text = console.export_text()
    assert "134 / 314" in text and "5 / -" in text


def test_serve_bench_runs_the_fp8_moe_preset_and_records_the_quantization(tmp_path):
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(app, [
        "serve-bench", "--device", "cpu", "--model", "tiny-moe", "--quant", "fp8", "--modes", "eager",
        "--concurrency", "2", "--requests", "3", "--input-len", "10", "--output-len", "3", "--max-batched-tokens",
        "32", "--warmup", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["env"]["quant"] == "fp8" and data["env"]["model"] == "tiny-moe"
    assert data["rows"][0]["mode"] == "eager" and data["rows"][0]["output_tok_s"] > 0


def test_demo_engine_on_cpu():
    result = CliRunner().invoke(app, ["demo", "--device", "cpu", "--engine", "--steps", "4"])
    assert result.exit_code == 0, result.output
    assert "graphed tokens equal eager tokens" in result.output
    assert "full" in result.output and "piecewise" in result.output


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1.0, 1e5, allow_nan=False), min_size=1, max_size=7))
def test_median_run_reports_the_run_with_the_median_throughput(speeds):
    """Property: every run happens once, in order; the reported row is one of them, the upper median by output
    tok/s, with every run's rate listed in run order (one run: its row as it is)."""
    from piecegraph.serve.bench import median_run

    calls = iter(speeds)
    seen = []

    def run():
        seen.append(next(calls))
        return {"output_tok_s": seen[-1], "run": len(seen) - 1, "ms_per_step": {"full": 1e3 / seen[-1]},
                "gc_pause_ms": float(len(seen))}

    row = median_run(run, len(speeds))
    assert seen == speeds
    assert row["output_tok_s"] == sorted(speeds)[len(speeds) // 2] and speeds[row["run"]] == row["output_tok_s"]
    if len(speeds) > 1:
        assert row["repeats_output_tok_s"] == [round(v, 1) for v in speeds]
        assert row["repeats_ms_per_step"] == [{"full": 1e3 / v} for v in speeds]  # each run's own, in run order
        assert row["repeats_gc_pause_ms"] == [float(i + 1) for i in range(len(speeds))]
    else:
        assert "repeats_output_tok_s" not in row and "repeats_ms_per_step" not in row


def test_serve_table_shows_the_gpu_bound_step_beside_the_itl():
    """The estimate's row carries its decode step (ms) in the ITL p50 column, and each row its share of the
    estimate's tok/s: auto's ITL and its share of the GPU-bound estimate are read off one table."""
    from rich.console import Console

    from piecegraph.serve.report import table

    row = {"mode": "auto", "concurrency": 1, "requests": 4, "request_throughput": 1.0, "output_tok_s": 500.0,
           "itl_p50_ms": 1.6}
    bound = {"concurrency": 1, "gpu_bound_output_tok_s": 625.0, "decode_step_ms": 1.53}
    console = Console(width=400, record=True)
    console.print(table([{"mode": "auto", "rows": [row], "gpu_bound": [bound]}], "t"))
    lines = console.export_text().splitlines()
    auto = next(line for line in lines if line.startswith("│ auto"))
    estimate = next(line for line in lines if "GPU-bound estimate" in line)
    assert "80%" in auto and "1.60" in auto
    cells = [c.strip() for c in estimate.split("│")]
    assert cells[cells.index("625") + 6] == "1.53"  # out tok/s, then total, TTFT x3, ITL mean, ITL p50


def test_gpu_bound_estimate_sums_prefill_and_decode_steps(model, monkeypatch):
    """The estimate's arithmetic on a known timer (one request alone: P prompt tokens at the prefill rate, then
    O - 1 decode steps), and its engine timer's bookkeeping on CPU (wall time, pipelined_ms's CPU branch): it
    times the module the engine would pick and the LM head on the rows that step samples, and frees every page
    it took."""
    from piecegraph.serve.gpu_bound import engine_timer, estimate

    def timer(kind, n, context):
        return 2.0 if kind == "decode" else 0.5 * n  # 2 ms a decode step, 0.5 ms a prefill token

    got = estimate([([1] * 30, 9)], 1, timer, budget=16)
    assert got["gpu_bound_output_tok_s"] == pytest.approx(9 / ((30 * 0.5 + 8 * 2.0) / 1e3))
    assert estimate([([1] * 30, 9)] * 4, 2, timer, 16)["decode_rows"] == 2
    cached = estimate([([1] * 30, 9)], 1, timer, 16, cached_tokens=20)  # a prefix-cache hit is not prefilled
    assert cached["gpu_bound_output_tok_s"] == pytest.approx(9 / ((10 * 0.5 + 8 * 2.0) / 1e3))

    engine = Engine(model, small_engine_config("auto", num_pages=15))
    picked = []
    pick = engine.executor.pick
    monkeypatch.setattr(engine.executor, "pick", lambda meta: picked.append(pick(meta).kind) or pick(meta))
    rows = []
    logits = engine.model.logits
    monkeypatch.setattr(engine.model, "logits", lambda hidden: rows.append(hidden.shape[0]) or logits(hidden))
    time_step = engine_timer(engine, repeats=2)
    assert time_step("decode", 2, 10) > 0 and time_step("prefill", 8, 0) > 0 and time_step("decode", 4, 5) > 0
    assert picked == ["full", "piecewise", "piecewise"]  # 4 decode rows: above the full sizes (1, 2)
    assert rows == [2] * 3 + [1] * 3 + [4] * 3  # the LM head on the rows each step samples, warm call included
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_gpu_bound_estimate_runs_only_the_rows_the_cache_holds(model):
    """A concurrency beyond the cache's room is estimated at the rows that fit at the mean context (the engine
    runs no more at once), not refused: at c=1024 the FP8 MoE's 30,000 pages failed to reserve 1024 rows."""
    from piecegraph.serve.gpu_bound import engine_fits, engine_timer, estimate

    engine = Engine(model, small_engine_config("auto", num_pages=15))  # 14 free pages of 4 tokens
    fits = engine_fits(engine)
    assert fits(10) == 4 and fits(14) == 3 and fits(3) == 4  # 3 pages each; 4 pages each; max_num_seqs=4
    work = [([1] * 12, 5)] * 8  # mean context 14: 4 pages a row, so 3 rows at once
    got = estimate(work, 8, engine_timer(engine, repeats=1), 16, fits)
    assert got["decode_rows"] == 3 and got["gpu_bound_output_tok_s"] > 0
    assert estimate(work, 8, lambda kind, n, context: 1.0, 16)["decode_rows"] == 8  # no limit given: as before
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == 14


def test_release_frees_what_dynamos_reset_leaves_in_reference_cycles(monkeypatch):
    """An engine Dynamo's caches held until the reset, in a reference cycle: freed by the time the next mode
    starts. Collected before the reset instead, it stayed alive until some later collection, and an FP8
    MoE engine's KV cache allocation ran out beside the previous mode's 88 GiB."""
    import gc
    import weakref

    from piecegraph.serve.sweep import release

    class Held:
        pass

    engine = Held()
    engine.cycle, engine.cache = engine, torch.zeros(8)
    dynamo_caches = [engine]
    alive = weakref.ref(engine.cache)
    del engine
    monkeypatch.setattr(torch._dynamo, "reset", dynamo_caches.clear)
    gc.disable()  # only release's own collection may free it
    try:
        release()
        assert alive() is None
    finally:
        gc.enable()
