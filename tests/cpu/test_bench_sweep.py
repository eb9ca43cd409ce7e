"""The bench's sweep on one tiny model built once for the module: each mode's rows against eager (graph-partition
under its own Inductor config, full graphs skipping varlen prefill, auto's per-size choice, a mode that fails to
build as a skipped row), the decode and prefill cases against independent references (plain softmax attention,
each prompt run alone), the float model's distance, the decode loop's pace, the attention op cost and the
meta-PCG adapter."""

import sys
import time
import types

import pytest
import torch
from bench_helpers import runner

from piecegraph.attention import SCRATCH_PAGE, AttentionMetadata, KVCache
from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.attention.kv_cache import pages_for
from piecegraph.bench import modes as bench_modes
from piecegraph.bench import sweep
from piecegraph.bench.cases import capture_inputs, decode_cache, decode_cases, prefill_cases, prefill_lengths
from piecegraph.bench.profile import attention_op_us
from piecegraph.cli import app
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder


@pytest.fixture(scope="module")
def tiny():
    return Decoder.random(TINY, seed=0)


@pytest.fixture(scope="module")
def tiny_facts(tiny):
    return tiny.facts()


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
