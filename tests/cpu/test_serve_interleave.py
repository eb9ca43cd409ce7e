"""serve-bench's interleaved sweep: engines of several modes on one shared KV cache, their runs alternating,
each request's tokens equal to eager greedy decoding alone; every mode meets every position in the run order."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from piecegraph.cli import app
from piecegraph.models import TINY, Decoder, generate
from piecegraph.results import load_result
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.interleave import rotation
from piecegraph.serve.report import results_of

pytestmark = pytest.mark.usefixtures("one_thread")


@given(modes=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=5, unique=True),
       repeats=st.integers(1, 12))
def test_rotation_puts_each_mode_in_each_position_equally_often(modes, repeats):
    """Property: every repeat runs each mode once; over the repeats each mode's positions differ by at most one
    in count, and over len(modes) repeats each mode takes each position exactly once."""
    orders = [rotation(modes, r) for r in range(repeats)]
    assert all(sorted(order) == sorted(modes) for order in orders)
    for mode in modes:
        counts = [sum(order.index(mode) == pos for order in orders) for pos in range(len(modes))]
        assert max(counts) - min(counts) <= 1
        if repeats % len(modes) == 0:
            assert len(set(counts)) == 1


def test_engines_sharing_a_cache_alternate_and_each_equals_eager_greedy():
    """Two engines (auto, piecewise) on one KV cache, their batches alternating with preemption: each request's
    tokens equal eager greedy decoding alone, and every page comes back after each batch."""
    model = Decoder.random(TINY, seed=5).eval()
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(3 + 5 * i)] for i in range(6)]
    want = [generate(model, [p], 6)[0] for p in prompts]
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_seq_len=48, num_pages=14,
                decode_sizes=(1, 2, 4), prefill_sizes=(4, 8, 16), compiler="eager", emulate_graphs=True)
    first = Engine(model, EngineConfig(mode="auto", **base))
    second = Engine(model, EngineConfig(mode="piecewise", **base), cache=first.cache)
    assert second.cache is first.cache
    for engine in (first, second, second, first):
        assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == want
        assert first.cache.num_free_pages == first.cache.num_pages - 1 and not first.cache.sequences()
    assert first.stats()["preemptions"] > 0


def test_serve_bench_interleaved_on_cpu(tmp_path):
    """--interleave: one row per mode and concurrency, each with its run order rotated per repeat, medians as in
    the sequential sweep, and the engines' shared cache left empty."""
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(app, [
        "serve-bench", "--device", "cpu", "--model", "tiny", "--modes", "piecewise,auto", "--concurrency", "1,3",
        "--requests", "2,4", "--input-len", "12", "--output-len", "4", "--max-batched-tokens", "32",
        "--compiler", "eager", "--warmup", "1", "--repeats", "3", "--interleave", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["env"]["interleave"] is True
    modes = {m["mode"]: m for m in results_of(load_result(out))}
    assert list(modes) == ["piecewise", "auto"] and all(m["interleaved"] for m in modes.values())
    assert [r["run_order"] for r in modes["piecewise"]["rows"]] == [[0, 1, 0]] * 2
    assert [r["run_order"] for r in modes["auto"]["rows"]] == [[1, 0, 1]] * 2
    for row in (r for m in modes.values() for r in m["rows"]):
        runs = row["repeats_output_tok_s"]
        assert len(runs) == 3 and round(row["output_tok_s"], 1) == sorted(runs)[1], row
        assert row["graph_share"] == 1.0
    for a, b in zip(modes["piecewise"]["rows"], modes["auto"]["rows"]):  # the same requests for every mode
        assert (a["concurrency"], a["prompt_tokens"], a["output_tokens"]) == (
            b["concurrency"], b["prompt_tokens"], b["output_tokens"])
    assert modes["auto"]["decode_reference"]["itl_p50_ms"] > 0
    assert "error" not in modes["auto"] and "error" not in modes["piecewise"]


def test_a_mode_that_fails_to_start_is_recorded_and_the_others_run(monkeypatch):
    from piecegraph.serve import sweep
    from piecegraph.serve.bench import Workload
    from piecegraph.serve.interleave import run_interleaved

    real = sweep.start_mode

    def start(model, mode, *args):
        if mode == "eager":
            raise RuntimeError("no room")
        return real(model, mode, *args)

    monkeypatch.setattr("piecegraph.serve.interleave.start_mode", start)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32, compiler="eager",
                          emulate_graphs=True)
    plan = sweep.Plan(("eager", "piecewise"), (2,), Workload(8, 3, 0.0, 0), config, counts={2: 2}, warmup=0,
                      reference=False, repeats=2)
    got = run_interleaved(Decoder.random(TINY, seed=1).eval(), plan, lambda line: None, lambda mode: None)
    assert [r["mode"] for r in got] == ["eager", "piecewise"]
    assert "no room" in got[0]["error"] and not got[0]["rows"]
    assert got[1]["rows"][0]["run_order"] == [0, 0] and got[1]["rows"][0]["output_tokens"] == 6
    with pytest.raises(RuntimeError, match="no room"):
        run_interleaved(Decoder.random(TINY, seed=1).eval(), plan, lambda line: None, lambda mode: None,
                        keep_going=False)


def test_a_mode_whose_finish_fails_keeps_its_rows_and_the_others_finish(monkeypatch):
    from piecegraph.serve import interleave, sweep
    from piecegraph.serve.bench import Workload
    from piecegraph.serve.interleave import run_interleaved

    real = sweep.finish_mode

    def finish(engine, plan, works, result, log):
        if result["mode"] == "piecewise":
            raise RuntimeError("reference loop broke")
        return real(engine, plan, works, result, log)

    monkeypatch.setattr(interleave, "finish_mode", finish)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32, compiler="eager",
                          emulate_graphs=True)
    plan = sweep.Plan(("piecewise", "auto"), (2,), Workload(8, 3, 0.0, 0), config, counts={2: 2}, warmup=0,
                      reference=True, repeats=1)
    got = run_interleaved(Decoder.random(TINY, seed=1).eval(), plan, lambda line: None)
    assert "reference loop broke" in got[0]["error"] and got[0]["rows"][0]["output_tokens"] == 6
    assert "error" not in got[1] and got[1]["decode_reference"]["itl_p50_ms"] > 0
