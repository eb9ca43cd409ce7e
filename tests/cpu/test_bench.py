"""``piecegraph bench`` on CPU: valid JSON with the documented keys, a real PNG, skipped rows with reasons."""

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from piecegraph.bench import modes as bench_modes
from piecegraph.bench import sweep
from piecegraph.bench.cases import capture_inputs, decode_cache, decode_cases, prefill_cases, prefill_lengths
from piecegraph.bench.harness import Row
from piecegraph.bench.report import compact
from piecegraph.cli import app
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder

runner = CliRunner()
ENV_KEYS = {"gpu", "torch", "model", "dtype", "date", "bandwidth_gbs", "context", "repeats"}
ROW_KEYS = {"mode", "phase", "ms", "tok_s", "hbm_frac", "setup_s", "pool_mib", "rel_err"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    return Decoder.random(TINY, seed=0)


def test_smoke_run_writes_json_png_and_profile(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--batches", "1,2", "--prefill", "16,40", "--context",
                                 "8", "--repeats", "2", "--json", str(out), "--plot", str(png), "--profile", "none:1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert ENV_KEYS <= set(data["env"]) and data["env"]["gpu"] == "cpu" and data["env"]["bandwidth_gbs"] > 0
    assert {(r["mode"], r["phase"], r.get("batch", r.get("tokens"))) for r in data["rows"]} == {
        (m, p, s) for m in ("eager", "none") for p, sizes in (("decode", (1, 2)), ("prefill", (16, 40))) for s in sizes}
    for row in data["rows"]:
        assert ROW_KEYS <= set(row) and "skipped" not in row
        assert ("batch" in row) == (row["phase"] == "decode") and ("tokens" in row) == (row["phase"] == "prefill")
        assert row["ms"] > 0 and row["tok_s"] > 0 and 0 < row["hbm_frac"] and row["rel_err"] < 1e-5
    assert data["modes"]["none"]["pieces"] == TINY.num_layers + 1  # split at each attention op
    profile = data["profile"]
    assert profile["split_calls_per_step"] == TINY.num_layers and profile["aten_ops_per_split"] > 5
    bytes_ = png.read_bytes()
    assert bytes_.startswith(PNG_SIGNATURE) and len(bytes_) > 10_000  # two drawn panels, not an empty canvas
    assert "prefill" in compact(data) and "skip" not in compact(data)


def test_modes_that_cannot_run_here_are_skipped_with_a_reason(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--modes", "eager,piecewise,meta-pcg", "--batches", "1",
                                 "--prefill", "8", "--context", "4", "--repeats", "1", "--json", str(out),
                                 "--plot", str(png)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    skipped = {r["mode"]: r["skipped"] for r in rows if "skipped" in r}
    assert set(skipped) == {"piecewise", "meta-pcg"} and "GPU" in skipped["piecewise"]
    assert all(r["ms"] is None for r in rows if "skipped" in r)
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_full_graph_modes_skip_varlen_prefill(tiny, monkeypatch):
    # Force "full" to build on CPU (it falls back to running the traced ops): its prefill row must be a skip.
    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    cache = decode_cache(tiny, [2], context=4)
    cases = decode_cases(tiny, cache, [2], 4) + prefill_cases(tiny, [12])
    sweep._references(tiny, cases)
    with pytest.warns(UserWarning):
        rows, facts = sweep._run_mode("full", tiny, cases, capture_inputs(tiny, cache), 1, 10.0, lambda s: None)
    decode, prefill = rows
    assert decode.ms > 0 and decode.rel_err < 1e-5 and decode.skipped is None
    assert prefill.skipped == bench_modes.FULL_PREFILL and prefill.ms is None
    assert "setup_s" in facts


def test_a_mode_that_fails_to_build_is_a_skipped_result(tiny, monkeypatch):
    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    monkeypatch.setattr(bench_modes, "prepare", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom\nmore")))
    cache, logged = decode_cache(tiny, [1], context=4), []
    rows, facts = sweep._run_mode("piecewise", tiny, decode_cases(tiny, cache, [1], 4), None, 1, 10.0, logged.append)
    assert rows[0].skipped == facts["skipped"] == "failed: RuntimeError: boom"
    assert "Traceback" in logged[0]  # the log keeps the frames a one-line reason drops


@pytest.mark.parametrize("total", [1, 2, 7, 8, 16, 40, 128, 511, 2048])
def test_prefill_lengths_are_mixed_and_sum_to_the_total(total):
    lengths = prefill_lengths(total)
    assert sum(lengths) == total and min(lengths) >= 1 and len(lengths) <= 8
    if total >= 16:
        assert len(set(lengths)) > 1  # mixed lengths: the varlen path, not a uniform batch


def test_prefill_case_packs_sequences_with_correct_layout(tiny):
    (case,) = prefill_cases(tiny, [40])
    assert case.meta.seq_bounds[-1] == 40 and case.seqs == len(prefill_lengths(40))
    with torch.no_grad(), forward_context(case.meta):
        assert tiny(*case.args(1)).shape == (40, TINY.hidden_size)


def test_row_json_names_the_size_by_phase():
    assert Row("eager", "decode", 4, ms=1.0).to_json()["batch"] == 4
    prefill = Row("full", "prefill", 64, skipped="why").to_json()
    assert prefill["tokens"] == 64 and prefill["skipped"] == "why" and "batch" not in prefill
    assert "skipped" not in Row("eager", "decode", 1).to_json()


def test_meta_adapter_marks_attention_no_graph_and_restores_it(tiny, monkeypatch):
    # A stand-in for piecewise_cuda_graphs (CUDA-only): its no_graph outside a capture just calls the function.
    calls = []
    fake = types.ModuleType("piecewise_cuda_graphs")
    fake.no_graph = lambda fn: (lambda *a, **k: (calls.append(a[-1]), fn(*a, **k))[1])
    monkeypatch.setitem(sys.modules, "piecewise_cuda_graphs", fake)
    from piecegraph.bench.meta_pcg import attention_as_no_graph

    original = torch.ops.piecegraph_models.attention
    (case,) = decode_cases(tiny, decode_cache(tiny, [2], 4), [2], 4)
    with torch.no_grad(), forward_context(case.meta):
        expected = tiny(*case.args(0))
        with attention_as_no_graph():
            got = tiny(*case.args(0))
    assert calls == list(range(TINY.num_layers))  # every layer's attention went through no_graph
    torch.testing.assert_close(got, expected)
    assert torch.ops.piecegraph_models.attention is original


def test_bad_sizes_and_profile_spec_name_their_option():
    for args, option in ((["--prefill", "16,x"], "--prefill"), (["--batches", "0"], "--batches"),
                         (["--profile", "piecewise"], "--profile"), (["--profile", "nope:1"], "--profile"),
                         (["--modes", "nope"], "--modes")):
        result = runner.invoke(app, ["bench", "--device", "cpu", *args])
        assert result.exit_code != 0 and option in result.output, result.output
