"""``piecegraph bench`` on CPU: valid JSON with the documented keys, a real PNG, skipped rows with reasons, the
paged-cache cases checked against independent references, ``--attention``, graph-partition and the op cost."""

import json
import sys
import time
import types

import pytest
import torch
from typer.testing import CliRunner

from piecegraph.attention import SCRATCH_PAGE, AttentionMetadata, KVCache
from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.attention.kv_cache import pages_for
from piecegraph.bench import command as bench_command
from piecegraph.bench import modes as bench_modes
from piecegraph.bench import sweep
from piecegraph.bench.cases import capture_inputs, decode_cache, decode_cases, prefill_cases, prefill_lengths
from piecegraph.bench.harness import Row
from piecegraph.bench.profile import attention_op_us
from piecegraph.bench.report import compact, result_stem, rich_table
from piecegraph.cli import app
from piecegraph.cli_common import load_model
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder
from piecegraph.results import load_result

runner = CliRunner()
ENV_KEYS = {"gpu", "torch", "flashinfer", "model", "dtype", "quant", "world_size", "date", "commit", "bandwidth_gbs",
            "context", "repeats", "attention", "attention_option", "inductor_graph_partition"}
ROW_KEYS = {"mode", "phase", "ms", "tok_s", "hbm_frac", "setup_s", "pool_mib", "rel_err"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny():
    return Decoder.random(TINY, seed=0)


@pytest.fixture(scope="module")
def tiny_facts(tiny):
    return tiny.facts()


def _backend_name(requested: str) -> str:
    """What the models package resolves ``requested`` to on CPU: the reference for the bench's env."""
    return KVCache(TINY, 2, backend=requested).backend.name


def test_smoke_run_writes_json_png_and_profile(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--batches", "1,2", "--prefill", "16,40", "--context",
                                 "8", "--repeats", "2", "--json", str(out), "--plot", str(png), "--profile", "none:1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert load_result(out).benchmark == data["benchmark"] == "bench"  # the one result schema
    env = data["env"]
    assert ENV_KEYS <= set(env) and env["gpu"] == "cpu" and env["bandwidth_gbs"] > 0 and env["world_size"] == 1
    assert env["attention_option"] == "auto" and env["attention"] == _backend_name("auto")
    assert {(r["mode"], r["phase"], r.get("batch", r.get("tokens"))) for r in data["rows"]} == {
        (m, p, s) for m in ("eager", "none") for p, sizes in (("decode", (1, 2)), ("prefill", (16, 40))) for s in sizes}
    for row in data["rows"]:
        assert ROW_KEYS <= set(row) and "skipped" not in row
        assert ("batch" in row) == (row["phase"] == "decode") and ("tokens" in row) == (row["phase"] == "prefill")
        assert row["ms"] > 0 and row["tok_s"] > 0 and 0 < row["hbm_frac"] and row["rel_err"] < 1e-5
        if row["phase"] == "decode":  # the loop's pace beside the synchronized step, over the same HBM floor
            assert row["loop_ms"] > 0
            assert row["loop_hbm_frac"] == pytest.approx(row["hbm_frac"] * row["ms"] / row["loop_ms"])
        else:
            assert "loop_ms" not in row and "loop_hbm_frac" not in row
        assert Row.from_json(row).to_json() == row
    prefill_seqs = {r["tokens"]: r["seqs"] for r in data["rows"] if r["phase"] == "prefill"}
    assert prefill_seqs == {t: len(prefill_lengths(t)) for t in (16, 40)}
    assert data["setup"]["none"]["pieces"] == TINY.num_layers + 1  # split at each attention op
    startup = data["setup"]["none"]["startup"]  # the setup split into its stages
    assert startup["trace_s"] > 0 and startup["compile_s"] >= 0 and startup["prewarm_s"] >= 0
    assert startup["diagnose_s"] == 0  # the reference decoder traces at once: nothing to diagnose
    profile = data["profile"]
    assert profile["split_calls_per_step"] == TINY.num_layers and profile["aten_ops_per_split"] > 5
    assert profile["attention_backend"] == env["attention"]
    op_us = data["attention_op_us"]
    assert "failed" not in op_us and op_us["decode_1"] > 0 and op_us["prefill_512"] > 0
    bytes_ = png.read_bytes()
    assert bytes_.startswith(PNG_SIGNATURE) and len(bytes_) > 10_000  # two drawn panels, not an empty canvas
    text = compact(data)
    assert "prefill" in text and "skip" not in text and f"{env['attention']} attention" in text
    assert "attention op CPU us per call" in text
    assert [line.split()[:2] for line in text.splitlines() if line.startswith("loop ")] == [["loop", "1"],
                                                                                          ["loop", "2"]]


def test_attention_flag_picks_the_backend_and_the_json_records_it(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--attention", "torch", "--modes", "eager", "--batches",
                                 "1", "--prefill", "", "--context", "4", "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    env = json.loads(out.read_text())["env"]
    assert env["attention_option"] == "torch" and env["attention"] == _backend_name("torch") == TorchBackend.name
    assert f"{TorchBackend.name} attention" in result.output  # the table title names the backend


def test_moe_preset_in_fp8_is_benched_and_the_json_records_the_quantization(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(bench_command, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)) or loaded[-1])
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--model", "tiny-moe", "--quant", "fp8", "--modes",
                                 "eager", "--batches", "2", "--prefill", "12", "--context", "4", "--repeats", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["env"]["quant"] == "fp8" and "tiny-moe float32 fp8" in result.output
    kinds = {type(m).__name__ for m in loaded[0].modules()}
    assert {"MoEDecoder", "FP8Experts", "FP8Linear"} <= kinds and "Experts" not in kinds
    # ... and judged against the same weights unquantized: a second load, float (the same seeded weights)
    assert len(loaded) == 2 and "FP8Experts" not in {type(m).__name__ for m in loaded[1].modules()}
    fp8_expert = next(m for m in loaded[0].modules() if type(m).__name__ == "FP8Experts")
    float_expert = next(m for m in loaded[1].modules() if type(m).__name__ == "Experts")
    assert fp8_expert.num_experts == float_expert.gate_up_proj.shape[0]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["rel_err"] == 0 and 0 < r["rel_err_float"] < 1 for r in rows)  # eager FP8 vs its float weights


def test_rel_err_float_is_the_distance_to_the_float_models_output(tiny):
    """A float model that is the model itself gives 0; a different one, its own relative distance."""
    other = Decoder.random(TINY, seed=1).eval()
    rows = {}
    for name, float_model in (("same", tiny), ("other", other)):
        result = sweep.run_sweep(tiny, ["eager"], [2], [8], context=4, repeats=1, log=lambda _: None,
                                 float_model=float_model)
        rows[name] = result.rows
    assert all(r.rel_err_float == 0 for r in rows["same"])
    assert all(r.rel_err_float > 0.1 for r in rows["other"])  # another model's output: far off
    bad = runner.invoke(app, ["bench", "--device", "cpu", "--quant", "int4"])
    assert bad.exit_code != 0 and "--quant" in bad.output


@pytest.mark.parametrize("value", ["flashinfer", "nope"])
def test_an_attention_backend_that_cannot_run_here_names_the_flag(value, tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--attention", value, "--json", str(out)])
    assert result.exit_code != 0 and "--attention" in result.output, result.output
    assert not out.exists()  # refused before any work


def test_modes_that_cannot_run_here_are_skipped_with_a_reason(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--modes", "eager,piecewise,meta-pcg,graph-partition",
                                 "--batches", "1", "--prefill", "8", "--context", "4", "--repeats", "1",
                                 "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    skipped = {r["mode"]: r["skipped"] for r in rows if "skipped" in r}
    assert set(skipped) == {"piecewise", "meta-pcg", "graph-partition"}
    assert "GPU" in skipped["piecewise"] and "GPU" in skipped["graph-partition"]
    assert all(r["ms"] is None for r in rows if "skipped" in r)
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_graph_partition_without_the_inductor_config_is_skipped_naming_it(tiny, tiny_facts, monkeypatch):
    import torch._inductor.config as inductor_config

    for name in bench_modes.GRAPH_PARTITION_CONFIG:  # this torch has them: the row is skipped for the GPU only
        assert hasattr(inductor_config, name)
    monkeypatch.setitem(bench_modes.GRAPH_PARTITION_CONFIG, "no_such_partition_option", True)
    assert not hasattr(inductor_config, "no_such_partition_option")
    (case,) = decode_cases(tiny_facts, decode_cache(tiny_facts, [1], 4), [1], 4)
    rows, facts = sweep._run_mode("graph-partition", tiny, [case], None, 1, 10.0, lambda s: None)
    assert "no_such_partition_option" in rows[0].skipped and rows[0].skipped == facts["skipped"]
    assert "custom_should_partition_ops" not in rows[0].skipped  # only the missing names


def test_graph_partition_patches_inductor_only_for_its_own_calls(tiny, tiny_facts, monkeypatch):
    # Forced onto CPU (Inductor skips CUDA graphs there): the rows must match eager, every call must run under
    # the partition config, and the config must be back to what it was once the mode is done.
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    before = {k: getattr(inductor_config, k) for k in bench_modes.GRAPH_PARTITION_CONFIG}
    seen, compile_kwargs, real_compile = [], [], torch.compile

    def spy_compile(model, **kwargs):
        compile_kwargs.append(kwargs)
        compiled = real_compile(model, **kwargs)

        def call(*args):
            seen.append({k: getattr(inductor_config, k) for k in bench_modes.GRAPH_PARTITION_CONFIG})
            return compiled(*args)
        return call

    monkeypatch.setattr(torch, "compile", spy_compile)
    cache = decode_cache(tiny_facts, [2], context=4)
    cases = decode_cases(tiny_facts, cache, [2], 4) + prefill_cases(tiny_facts, [12])
    sweep._references(tiny, cases)
    make_inputs = capture_inputs(tiny_facts, cache)
    rows, _ = sweep._run_mode("graph-partition", tiny, cases, make_inputs, 1, 10.0, lambda s: None)
    decode, prefill = rows
    assert decode.skipped is None and prefill.skipped is None, (decode.skipped, prefill.skipped)
    assert decode.rel_err < 1e-4 and prefill.rel_err < 1e-4
    assert prefill.note == bench_modes.GRAPH_PARTITION_PREFILL and decode.note is None
    assert compile_kwargs and all(kw["mode"] == "reduce-overhead" for kw in compile_kwargs)
    assert seen and all(s == bench_modes.GRAPH_PARTITION_CONFIG for s in seen)
    assert {k: getattr(inductor_config, k) for k in before} == before


def test_full_graph_modes_skip_varlen_prefill(tiny, tiny_facts, monkeypatch):
    # Force "full" to build on CPU (it falls back to running the traced ops): its prefill row must be a skip.
    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    cache = decode_cache(tiny_facts, [2], context=4)
    cases = decode_cases(tiny_facts, cache, [2], 4) + prefill_cases(tiny_facts, [12])
    sweep._references(tiny, cases)
    with pytest.warns(UserWarning):
        rows, facts = sweep._run_mode("full", tiny, cases, capture_inputs(tiny_facts, cache), 1, 10.0, lambda s: None)
    decode, prefill = rows
    assert decode.ms > 0 and decode.rel_err < 1e-5 and decode.skipped is None
    assert prefill.skipped == bench_modes.FULL_PREFILL and prefill.ms is None
    assert "setup_s" in facts


def test_a_mode_that_fails_to_build_is_a_skipped_result(tiny, tiny_facts, monkeypatch):
    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    monkeypatch.setattr(bench_modes, "prepare", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom\nmore")))
    cache, logged = decode_cache(tiny_facts, [1], context=4), []
    cases = decode_cases(tiny_facts, cache, [1], 4)
    rows, facts = sweep._run_mode("piecewise", tiny, cases, None, 1, 10.0, logged.append)
    assert rows[0].skipped == facts["skipped"] == "failed: RuntimeError: boom"
    assert "Traceback" in logged[0]  # the log keeps the frames a one-line reason drops
    # A tensor-parallel rank raises instead: its peers would pair their collectives with its next mode's.
    with pytest.raises(RuntimeError, match="boom"):
        sweep._run_mode("piecewise", tiny, decode_cases(tiny_facts, cache, [1], 4), None, 1, 10.0, logged.append,
                        keep_going=False)


@pytest.mark.parametrize("total", [1, 2, 7, 8, 16, 40, 128, 511, 2048])
def test_prefill_lengths_are_mixed_and_sum_to_the_total(total):
    lengths = prefill_lengths(total)
    assert sum(lengths) == total and min(lengths) >= 1 and len(lengths) <= 8
    if total >= 16:
        assert len(set(lengths)) > 1  # mixed lengths: the varlen path, not a uniform batch


def _attend(q, keys, values):
    """Plain softmax attention of one query ``[H, D]`` over ``[L, Hkv, D]`` keys and values (GQA by repeat)."""
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    weights = torch.einsum("hd,lhd->hl", q, keys).mul(q.shape[-1] ** -0.5).softmax(-1)
    return torch.einsum("hl,lhd->hd", weights, values)


def test_decode_cases_attend_their_reserved_random_context(tiny_facts):
    context, batches = 20, [1, 3]
    cache = decode_cache(tiny_facts, batches, context)
    assert cache.max_pages_per_seq == pages_for(context + 8, cache.page_size)  # narrow decode page tables
    free = cache.num_free_pages
    case = decode_cases(tiny_facts, cache, batches, context)[1]
    assert cache.num_free_pages == free  # every sequence's pages were reserved up front
    tables = [cache.page_table(i) for i in range(3)]
    assert all(len(t) == pages_for(context + 1, cache.page_size) for t in tables)
    assert len({p for t in tables for p in t}) == sum(map(len, tables)) and SCRATCH_PAGE not in tables[0]
    assert case.seqs == 3 and case.meta.page_table.shape == (3, cache.max_pages_per_seq)
    assert case.positions.tolist() == [context] * 3
    h, hkv, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, heads * d, generator=gen) for heads in (h, hkv, hkv))
    cached = [(cache.k[0][t].reshape(-1, hkv, d)[:context].clone(), cache.v[0][t].reshape(-1, hkv, d)[:context].clone())
              for t in tables]
    assert all(keys.std() > 0.5 for keys, _ in cached)  # random contents, not the zeroed storage
    out = torch.empty_like(q)
    with torch.no_grad(), forward_context(case.meta):
        torch.ops.piecegraph_models.attention(q, k, v, out, 0)
    for i, (keys, values) in enumerate(cached):
        keys = torch.cat([keys, k[i].view(1, hkv, d)])  # the cached context plus the token decoded now
        values = torch.cat([values, v[i].view(1, hkv, d)])
        torch.testing.assert_close(out[i].view(h, d), _attend(q[i].view(h, d), keys, values), rtol=1e-4, atol=1e-5)


def test_prefill_case_equals_each_prompt_run_alone(tiny, tiny_facts):
    (case,) = prefill_cases(tiny_facts, [40])
    lengths = prefill_lengths(40)
    assert case.seqs == len(lengths) and case.meta.layout.num_new == tuple(lengths)
    assert case.positions.tolist() == [p for n in lengths for p in range(n)]
    ids = case.args(1)[0]
    with torch.no_grad():
        with forward_context(case.meta):
            packed = tiny(ids, case.positions)
        assert packed.shape == (40, TINY.hidden_size)
        start = 0
        for n in lengths:  # the reference: one prompt, its own fresh cache
            solo = KVCache.for_sequences(TINY, 1, n)
            meta = AttentionMetadata.for_batch(solo, [("alone", 0, n)])
            with forward_context(meta):
                alone = tiny(ids[start:start + n], meta.positions)
            torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-4, atol=1e-5)
            start += n


def test_attention_op_cost_is_the_median_of_the_timed_calls_after_warm_up(tiny_facts, monkeypatch):
    real = attention_op_us(tiny_facts, "torch", context=8, calls=3)
    assert "failed" not in real and real["decode_1"] > 0 and real["prefill_512"] > 0
    # Reference: a fake clock that only the backend's forward advances, by a known cost per call. The first 3
    # calls of each case (warm-up) cost a second each; the timed ones 1, 5, 2, 4, 100 ms: the median is 4 ms.
    import piecegraph.bench.profile as bench_profile

    clock, costs, tokens = [0.0], [1.0] * 3 + [1e-3, 5e-3, 2e-3, 4e-3, 100e-3], []

    def forward(self, q, k, v, out, layer, meta):
        calls = [t for t in tokens if t == meta.num_tokens]
        clock[0] += costs[len(calls)] * (2 if meta.num_tokens > 1 else 1)  # prefill calls cost twice as much
        tokens.append(meta.num_tokens)

    monkeypatch.setattr(TorchBackend, "forward", forward)
    monkeypatch.setattr(bench_profile, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    result = attention_op_us(tiny_facts, "torch", context=8, calls=5)
    assert sorted(set(tokens)) == [1, 512]  # the two cases: decode batch 1, the 512-token packed prefill
    assert result["decode_1"] == pytest.approx(4e3) and result["prefill_512"] == pytest.approx(8e3)


def test_attention_op_cost_records_a_failure_as_a_reason(tiny_facts, monkeypatch):
    forward = TorchBackend.forward

    def prefill_breaks(self, q, k, v, out, layer, meta):
        if not meta.is_decode:
            raise RuntimeError("no prefill today\nsecond line")
        return forward(self, q, k, v, out, layer, meta)

    monkeypatch.setattr(TorchBackend, "forward", prefill_breaks)
    result = attention_op_us(tiny_facts, "torch", context=8, calls=2)
    assert result["decode_1"] > 0 and result["prefill_512"] is None
    assert result["failed"] == {"prefill_512": "failed: RuntimeError: no prefill today"}


def test_row_json_names_the_size_by_phase():
    assert Row("eager", "decode", 4, ms=1.0).to_json()["batch"] == 4
    prefill = Row("full", "prefill", 64, skipped="why").to_json()
    assert prefill["tokens"] == 64 and prefill["skipped"] == "why" and "batch" not in prefill
    assert "skipped" not in Row("eager", "decode", 1).to_json()


def test_time_case_paces_back_to_back_decode_calls_and_leaves_prefill_without(tiny, tiny_facts):
    """A mode whose calls each take at least 3 ms: the decode loop pace is at least that, over the case's own floor,
    its calls rotate the inputs; a prefill row runs no loop."""
    cache = decode_cache(tiny_facts, [2], 4)
    decode, prefill = decode_cases(tiny_facts, cache, [2], 4) + prefill_cases(tiny_facts, [8])
    sweep._references(tiny, [decode, prefill])
    calls = []

    def slow(ids, positions):
        calls.append(ids)
        time.sleep(0.003)
        return tiny(ids, positions)

    prep = bench_modes.Prepared("slow", slow)
    row, _ = sweep._time_case(prep, decode, repeats=4, bandwidth_gbs=1.0)
    assert row.ms >= 3 and row.loop_ms >= 3 and row.rel_err < 1e-6
    assert row.loop_hbm_frac == pytest.approx(decode.floor_bytes / 1e6 / row.loop_ms)  # 1 GB/s: bytes / 1e6 ms
    assert len(calls) == 1 + (3 + 4) + (2 + 4)  # accuracy, synchronized (warm-up + repeats), loop (the same)
    assert all(a is decode.ids[i % len(decode.ids)] for i, a in enumerate(calls[-4:]))
    calls.clear()
    row, _ = sweep._time_case(prep, prefill, repeats=4, bandwidth_gbs=1.0)
    assert row.ms >= 3 and row.loop_ms is None and row.loop_hbm_frac is None and len(calls) == 1 + 3 + 4


def test_rich_table_shows_loop_columns_only_when_a_row_has_loop_ms():
    decode = Row("none", "decode", 2, ms=2.0, tok_s=1e3, hbm_frac=0.4, loop_ms=1.6, loop_hbm_frac=0.5)
    prefill = Row("none", "prefill", 16, ms=3.0, tok_s=5e3, hbm_frac=0.2)

    def headers(rows):
        return [c.header for c in rich_table(rows, "t").columns]

    with_loop = headers([decode, prefill])
    assert with_loop[with_loop.index("HBM floor") + 1:][:2] == ["loop ms", "loop HBM"]
    assert not {"loop ms", "loop HBM"} & set(headers([prefill]))
    cells = {c.header: list(c.cells) for c in rich_table([decode, prefill], "t").columns}
    assert cells["loop ms"] == ["1.600", "-"] and cells["loop HBM"] == ["50.0%", "-"]


def test_result_stem_names_the_date_gpu_and_attention_backend():
    env = {"date": "2026-01-02", "gpu": "NVIDIA H200", "torch": "2.13.0+cu130", "flashinfer": None,
           "attention": TorchBackend.name, "model": "qwen2.5-0.5b", "dtype": "bfloat16", "quant": "bf16",
           "world_size": 1, "commit": None}
    data = {"benchmark": "bench", "env": env, "rows": []}
    assert result_stem(data) == f"2026-01-02_h200_bench_modes_{TorchBackend.name}"  # scripts add .json and .png
    fp8 = {**data, "env": {**env, "model": "tiny-moe", "quant": "fp8", "world_size": 2}}
    assert result_stem(fp8) == f"2026-01-02_h200_bench_modes_tiny-moe_{TorchBackend.name}_fp8_tp2"


def test_report_module_keeps_name_and_plot_for_scripts(tmp_path, capsys):
    """``python -m piecegraph.bench.report FILE --name | --plot``: what the GPU scripts call on a saved sweep."""
    from piecegraph.bench.report import main, payload
    from piecegraph.results.schema import environment, write_result

    env = environment(attention="torch", model="tiny", dtype="float32", quant="bf16", gpu="cpu", context=4)
    rows = [Row(m, "decode", b, ms=ms, tok_s=b / ms * 1e3) for m, ms in (("eager", 2.0), ("none", 1.0))
            for b in (1, 2)]
    path = tmp_path / "raw.json"
    write_result(path, **payload(env, rows, {"eager": {"setup_s": 0.1, "pool_mib": None}}))
    main([str(path), "--name"])
    assert capsys.readouterr().out.strip() == f"{env['date']}_cpu_bench_modes_tiny_torch"
    main([str(path), "--plot", str(tmp_path / "p.png")])
    assert "ms per step, median" in capsys.readouterr().out
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)


def test_meta_adapter_marks_attention_no_graph_and_restores_it(tiny, tiny_facts, monkeypatch):
    # A stand-in for piecewise_cuda_graphs (CUDA-only): its no_graph outside a capture just calls the function.
    calls = []
    fake = types.ModuleType("piecewise_cuda_graphs")
    fake.no_graph = lambda fn: (lambda *a, **k: (calls.append(a[-1]), fn(*a, **k))[1])
    monkeypatch.setitem(sys.modules, "piecewise_cuda_graphs", fake)
    from piecegraph.bench.meta_pcg import attention_as_no_graph

    original = torch.ops.piecegraph_models.attention
    (case,) = decode_cases(tiny_facts, decode_cache(tiny_facts, [2], 4), [2], 4)
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
                         (["--profile", "none:1,piecewise"], "--profile"),
                         (["--modes", "nope"], "--modes")):
        result = runner.invoke(app, ["bench", "--device", "cpu", *args])
        assert result.exit_code != 0 and option in result.output, result.output


def test_the_auto_row_runs_decode_on_the_measured_module_and_prefill_piecewise(tiny, tiny_facts, monkeypatch):
    # Built on CPU (no graphs: the modules run their compiled code): every row equals eager, each decode size
    # records its choice with both timings, and a decode call replays the module it chose.
    monkeypatch.setattr(bench_modes, "unavailable", lambda name: None)
    cache = decode_cache(tiny_facts, [1, 3], context=4)
    cases = decode_cases(tiny_facts, cache, [1, 3], 4) + prefill_cases(tiny_facts, [12])
    sweep._references(tiny, cases)
    with pytest.warns(UserWarning):
        rows, facts = sweep._run_mode("auto", tiny, cases, capture_inputs(tiny_facts, cache), 1, 10.0, lambda s: None)
    assert [r.skipped for r in rows] == [None, None, None]
    assert all(r.rel_err < 1e-5 for r in rows), [r.rel_err for r in rows]
    choice = facts["decode_choice"]
    assert set(choice) == {1, 3} and all(c["pick"] in ("full", "piecewise") and c["full_ms"] > 0
                                         and c["piecewise_ms"] > 0 for c in choice.values())
    prep = bench_modes.prepare("auto", tiny, [3], [12], capture_inputs(tiny_facts, cache))
    calls = []
    for name in ("full", "mixed"):  # record which module each call reaches
        module = getattr(prep.fn, name)
        setattr(prep.fn, name, lambda *a, m=module, name=name: (calls.append(name), m(*a))[1])
    decode, prefill = decode_cases(tiny_facts, cache, [3], 4)[0], prefill_cases(tiny_facts, [12])[0]
    with torch.no_grad():
        for pick in ("full", "piecewise"):
            prep.fn.choice[3]["pick"] = pick
            with forward_context(decode.meta):
                torch.testing.assert_close(prep.fn(*decode.args(0)), tiny(*decode.args(0)), rtol=1e-5, atol=1e-5)
        with forward_context(prefill.meta):
            torch.testing.assert_close(prep.fn(*prefill.args(0)), tiny(*prefill.args(0)), rtol=1e-5, atol=1e-5)
    assert calls == ["full", "mixed", "mixed"]


def test_weight_bytes_read_counts_fp8_weight_buffers_and_only_the_experts_routing_reaches():
    """The bench's floor (and moe_step_profile's) counts what a forward must read: an FP8 model's weights are
    buffers (once left out: its floor was the norms and the bf16 router alone), and a mixture of experts reads
    only the experts top-k routing can reach. Reference: bytes counted by hand from the config."""
    from piecegraph.models import TINY_MOE, MoEDecoder, quantize_fp8

    c = TINY_MOE
    expert = 3 * c.hidden_size * c.expert_width  # gate, up and down of one expert: numbers of weights
    for quant, item, scales in (("float32", 4, 0), ("fp8", 1, 2 * 4)):  # FP8: a float32 scale per expert matrix
        model = MoEDecoder.random(c, seed=0).eval()
        if quant == "fp8":
            model = quantize_fp8(model, kernel="torch")
        facts = model.facts()
        everything = facts.weight_bytes_read(c.num_experts)  # enough rows to reach every expert
        one_row = facts.weight_bytes_read(1)  # top_k experts a layer
        row = c.hidden_size * model.model.embed_tokens.weight.element_size()
        unread = c.num_layers * (c.num_experts - c.top_k) * (expert * item + scales)
        assert everything - one_row == unread + (c.num_experts - 1) * row, quant
        assert everything > c.num_layers * c.num_experts * expert * item, quant  # all experts, the rest on top


def _logits_one_sequence_at_a_time(model, ids, lengths):
    """Each sequence alone on its own cache (no packing): the reference for the bench's teacher-forced logits."""
    out, start = [], 0
    for n in lengths:
        cache = KVCache.for_sequences(model.config, 1, n, page_size=4)
        meta = AttentionMetadata.for_batch(cache, [(0, 0, n)])
        with torch.no_grad(), forward_context(meta):
            out.append(model.logits(model(ids[start:start + n], meta.positions)).float())
        start += n
    return torch.cat(out)


def test_a_comma_list_of_quants_benches_each_model_once_into_one_result_with_accuracy(tmp_path, monkeypatch):
    """``--quant bf16,fp8``: one model per quant (no float twin), every row labelled with its quant, setup facts
    per mode and quant, and one accuracy row: the FP8 model's teacher-forced logits against the bf16 model's,
    checked against each sequence run alone."""
    from piecegraph.bench import accuracy as bench_accuracy
    from piecegraph.bench.plot import plot_result

    loaded = []
    monkeypatch.setattr(bench_command, "load_model",
                        lambda *a, **k: loaded.append((k.get("quant", "bf16"), load_model(*a, **k))) or loaded[-1][1])
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--model", "tiny-moe", "--quant", "fp8,bf16", "--modes",
                                 "eager", "--batches", "2", "--prefill", "12", "--context", "4", "--repeats", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert [q for q, _ in loaded] == ["bf16", "fp8"]  # bf16 first: its logits are the reference
    data = json.loads(out.read_text())
    assert data["env"]["quant"] == "bf16,fp8" and set(data["setup"]) == {"eager bf16", "eager fp8"}
    timed = [r for r in data["rows"] if r["phase"] != "accuracy"]
    assert sorted((r["quant"], r["phase"], r.get("batch", r.get("tokens"))) for r in timed) == sorted(
        (q, p, s) for q in ("bf16", "fp8") for p, s in (("decode", 2), ("prefill", 12)))
    assert all("rel_err_float" not in r and r["rel_err"] == 0 for r in timed)
    [acc] = [r for r in data["rows"] if r["phase"] == "accuracy"]
    assert acc["key"] == "accuracy" and acc["quant"] == "fp8" and acc["against"] == "bf16"
    # the reference: the same seeded tokens, each sequence alone, the two models the bench built
    lengths = [bench_accuracy.TOKENS // bench_accuracy.SEQS] * bench_accuracy.SEQS
    ids = torch.randint(0, loaded[0][1].config.vocab_size, (bench_accuracy.TOKENS,),
                        generator=torch.Generator().manual_seed(0))
    ref, fp8 = (_logits_one_sequence_at_a_time(model, ids, lengths) for _, model in loaded)
    assert acc["tokens"] == bench_accuracy.TOKENS >= 256
    assert acc["logits_rel_err"] == pytest.approx(((fp8 - ref).norm() / ref.norm()).item(), rel=1e-4)
    assert acc["top1_agreement"] == pytest.approx((fp8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                                                  abs=2 / bench_accuracy.TOKENS)  # a near tie may flip
    assert 0 < acc["logits_rel_err"] < 1 and 0.5 < acc["top1_agreement"] < 1
    assert "accuracy fp8 vs bf16" in result.output and "eager fp8" in result.output
    plot_result(load_result(out), tmp_path / "r.png")  # the accuracy row is not a timed point
    bad = runner.invoke(app, ["bench", "--device", "cpu", "--quant", "bf16,int4"])
    assert bad.exit_code != 0 and "--quant" in bad.output and "int4" in bad.output


def test_decode_batches_whose_kv_cache_cannot_fit_are_skipped_with_the_reason(monkeypatch):
    """On a GPU the decode cache is one allocation for the largest batch: batches whose cache would not fit 70% of
    the free memory are left out largest first, each with its reason (a row per mode), instead of every row
    failing on an out-of-memory error; none fitting is refused naming --batches."""
    from types import SimpleNamespace

    from piecegraph.bench.sweep import fitting_batches

    per_token = 1000
    facts = SimpleNamespace(device=torch.device("cuda", 0), config=object(), kv_bytes_per_token=lambda: per_token)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 264 * per_token, 10**12))
    lines = []
    kept, dropped = fitting_batches(facts, [1, 10, 256, 1024], 256, lines.append)  # 70 sequences of 264 fit
    assert kept == [1, 10] and [b for b, _ in dropped] == [1024, 256]
    assert "does not fit" in dropped[0][1] and "--context" in dropped[0][1] and len(lines) == 2
    with pytest.raises(ValueError, match="--batches"):
        fitting_batches(facts, [256], 256, lines.append)
    cpu = SimpleNamespace(device=torch.device("cpu"), config=object(), kv_bytes_per_token=lambda: per_token)
    assert fitting_batches(cpu, [4096], 10**6, lines.append) == ([4096], [])


def test_step_timeline_orders_the_last_steps_kernels_and_sums_their_gaps_by_kind():
    """A profile of two steps of three kernels each: the timeline is the second step's, in start order, each
    kernel's gap after the previous one; GEMM, attention and other time add up per kind."""
    from types import SimpleNamespace

    from piecegraph.bench.profile import is_gemm_kernel, step_timeline

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    step = [("nvjet_sm90_tst_64x8", 0.0, 10.0), ("BatchPrefillWithPagedKVCacheKernel", 12.0, 15.0),
            ("triton_poi_fused_add_0", 16.5, 17.0)]
    kernels = [kernel(n, s + 100 * i, e + 100 * i) for i in (1, 0) for n, s, e in step]  # out of order on purpose
    timeline = step_timeline(kernels, 3)
    assert [row[0] for row in timeline["rows"]] == [n for n, _, _ in step]
    assert [row[2] for row in timeline["rows"]] == [0.0, 2.0, 1.5]
    assert timeline["kernels"] == 3 and timeline["span_us"] == 17.0 and timeline["gaps_us"] == 3.5
    assert timeline["us_by_kind"] == {"gemm": 10.0, "attention": 3.0, "other": 0.5}
    assert is_gemm_kernel("void cutlass::Kernel2<x>") and not is_gemm_kernel("triton_red_fused_mean_1")
    assert step_timeline(kernels, 0) == {}


def test_a_profile_list_profiles_each_step(tmp_path):
    """``--profile A,B``: the first profile stays the result's ``profile``; ``profiles`` holds both, in order."""
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--modes", "none", "--batches", "1", "--prefill", "",
                                 "--context", "8", "--repeats", "1", "--json", str(out), "--profile", "none:1,eager:2"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(p["mode"], p["batch"]) for p in data["profiles"]] == [("none", 1), ("eager", 2)]
    assert data["profile"] == data["profiles"][0]
    assert all(p["split_calls_per_step"] == TINY.num_layers for p in data["profiles"])  # each step profiled whole
