"""The serving engine: every request's tokens equal the request generated alone by eager greedy decoding, in
every mode, at any concurrency, with preemption; nothing lost or duplicated; pages returned; the dispatch (full
graphs for pure decode steps, piecewise otherwise, no graph above the largest size) read from the step stats."""

import json
import logging
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.cli import app
from piecegraph.models import TINY, Decoder, generate
from piecegraph.models.config import ModelConfig
from piecegraph.results import load_result
from piecegraph.serve import ENGINE_MODES, Engine, EngineConfig, SamplingParams, serve_sizes
from piecegraph.serve.bench import Workload, closed_loop, requests_for
from piecegraph.serve.report import results_of

MAX_NEW = 8
PAGE_SIZE = 4
MAX_SEQ_LEN = 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3).eval()


def _prompts(n, seed=0, longest=30):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, longest))] for _ in range(n)]


PROMPTS = _prompts(7)


@pytest.fixture(scope="module")
def expected(model):
    """Each prompt alone, eager greedy decoding, its own fresh cache: the independent reference."""
    return [generate(model, [p], MAX_NEW)[0] for p in PROMPTS]


def _config(mode, **changes):
    # Small sizes, so that the dispatch meets every case: decode batches above the full sizes go piecewise,
    # prefill steps above the piecewise sizes run without graphs.
    base = dict(mode=mode, max_num_seqs=4, max_num_batched_tokens=16, page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN,
                decode_sizes=(1, 2), prefill_sizes=(1, 2, 4, 8), compiler="eager", emulate_graphs=True)
    return EngineConfig(**{**base, **changes})


@pytest.fixture(scope="module", params=ENGINE_MODES)
def engine(request, model):
    """One engine per mode (graphs captured once), shared by the runs below; its cache has 14 pages of 4 tokens,
    too few for four requests of up to 38 tokens: running them together preempts."""
    return Engine(model, _config(request.param, num_pages=15))


def _check_run(engine, finished, submitted, expected_tokens):
    ids = [r.id for r in finished]
    assert len(ids) == len(set(ids)) == len(submitted), "a request was lost or finished twice"
    assert set(ids) == {r.id for r in submitted}
    for request, want in zip(submitted, expected_tokens):
        assert request.finished and request.output == want, (request.id, request.output, want)
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("concurrency", [1, 3, len(PROMPTS)])
def test_engine_tokens_equal_each_request_alone(engine, expected, concurrency):
    engine.reset_stats()
    submitted, finished, todo = [], [], list(range(len(PROMPTS)))

    def submit():
        i = todo.pop(0)
        submitted.append(engine.add_request(PROMPTS[i], SamplingParams(max_new_tokens=MAX_NEW)))

    for _ in range(concurrency):
        submit()
    while engine.has_work():
        for request in engine.step():
            finished.append(request)
            if todo:
                submit()
    _check_run(engine, finished, submitted, expected)
    _check_dispatch(engine, every_case=concurrency == len(PROMPTS))
    if concurrency == len(PROMPTS):
        assert engine.stats()["preemptions"] > 0, "the page budget was meant to force preemption"


def _check_dispatch(engine, every_case):
    """Every step used the graph kind the mode promises for its shape (decode sizes 1-2, piecewise 1-8)."""
    mode = engine.config.mode
    for s in engine.steps:
        if mode == "eager":
            want, pad = "eager", s.tokens
        elif s.tokens > 8:
            want, pad = "none", s.tokens  # above the largest size: compiled pieces, no graph
        elif mode == "auto" and s.is_decode and s.tokens <= 2:
            want, pad = "full", s.tokens
        else:
            want = "breakable" if mode == "breakable" else "piecewise"
            pad = next(b for b in (1, 2, 4, 8) if b >= s.tokens)
        assert (s.kind, s.padded) == (want, pad), (mode, s)
    kinds = {s.kind for s in engine.steps}
    if mode == "auto" and every_case:
        assert {"full", "piecewise", "none"} <= kinds
        assert any(s.kind == "piecewise" and s.is_decode for s in engine.steps), "a decode batch above size 2"


def test_auto_engine_reports_what_it_captured(model):
    engine = Engine(model, _config("auto"))
    report = engine.capture_report()
    assert report["modules"]["full"]["sizes"] == [1, 2]
    assert report["modules"]["piecewise"]["sizes"] == [1, 2, 4, 8]
    assert report["setup_s"] > 0 and report["pool_mib"] == 0.0  # emulated on CPU: no CUDA pool
    assert engine.executor.mixed.module.config.pool is engine.executor.decode.module.config.pool


def test_auto_replays_the_decode_module_measured_faster_per_size(model, expected):
    """On CPU the rule (full everywhere) is recorded; a timer that finds piecewise faster at size 2 makes decode
    steps of 2 rows replay piecewise graphs and size 1 keep full graphs, with the same tokens."""
    engine = Engine(model, _config("auto", num_pages=15))
    choice = engine.capture_report()["decode_choice"]
    assert {n: c["pick"] for n, c in choice.items()} == {1: "full", 2: "full"}
    assert all(c["by"] == "rule" and c["full_ms"] is None for c in choice.values())
    times = {("full", 1): 1.0, ("piecewise", 1): 2.0, ("full", 2): 3.0, ("piecewise", 2): 2.5}
    engine.executor.choose_decode(lambda slot, n: times[slot.kind, n])
    choice = engine.capture_report()["decode_choice"]
    assert choice[2] == {"pick": "piecewise", "full_ms": 3.0, "piecewise_ms": 2.5, "by": "measured",
                         "when": "capture"}
    assert choice[1]["pick"] == "full"
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW)) == expected
    decode = [s for s in engine.steps if s.is_decode and s.tokens <= 2]
    assert {s.kind for s in decode if s.tokens == 1} == {"full"}
    assert {s.kind for s in decode if s.tokens == 2} == {"piecewise"}


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    engine = Engine(model, _config("eager", num_pages=15))
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=s) for s in range(len(PROMPTS))]
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], params[i])[0] for i, p in enumerate(PROMPTS)]
    assert together == alone
    other = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=99))
    assert other[0] != together[0]


def test_eos_stops_a_request_and_frees_its_pages(model, expected):
    engine = Engine(model, _config("auto"))
    eos = expected[0][3]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, eos_token_id=eos))
    for got, want in zip(out, expected):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_requests_that_cannot_fit_or_repeat_an_id_are_refused(model):
    engine = Engine(model, _config("eager", num_pages=5))  # 16 tokens of pages
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        engine.add_request(list(range(10)), SamplingParams(max_new_tokens=8))
    engine.add_request([1, 2], SamplingParams(max_new_tokens=4), id="a")
    with pytest.raises(ValueError, match="already submitted"):
        engine.add_request([3], SamplingParams(max_new_tokens=4), id="a")
    with pytest.raises(ValueError, match="mode"):
        EngineConfig(mode="full")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    for field, bad in (("graph_memory_limit", 0), ("graph_memory_limit", 2.5), ("cache_dir", 3), ("cache_dir", ""),
                       ("auto_opaque", 1), ("auto_opaque", "yes")):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
            EngineConfig(**{field: bad})
    vocab = model.config.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request(bad, SamplingParams(max_new_tokens=2), id="b")
    engine.add_request([1], SamplingParams(max_new_tokens=2), id="b")  # a refusal took neither the id nor pages


def test_serve_sizes():
    assert serve_sizes(1) == (1,)
    assert serve_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert requests_for(1, 3, 4, 1024) == 4 and requests_for(1024, 3, 4, 1024) == 1024
    assert requests_for(2048, 3, 4, 1024) == 2048  # never fewer than one per client


def test_engine_serves_a_hugging_face_model():
    """The same engine on an unmodified transformers model (piecegraph.hf's flat-token wrapper)."""
    transformers = pytest.importorskip("transformers")
    pghf = pytest.importorskip("piecegraph.hf")
    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = pghf.HFDecoder(hf, max_seq_len=64, attention_backend="torch")
    prompts = [[t % 128 for t in p] for p in PROMPTS]
    want = [generate(model, [p], MAX_NEW)[0] for p in prompts]
    engine = Engine(model, _config("auto", num_pages=15))
    assert engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)) == want
    assert {"full", "piecewise"} <= {s.kind for s in engine.steps} and engine.stats()["preemptions"] > 0
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


# -- the scheduler, property-tested on a model whose next token is a known function of (token, position) ---------
class Arithmetic(torch.nn.Module):
    """A flat-token "model": the next token after ``t`` at position ``p`` is ``(31 t + 7 p + 1) % V``; its
    outputs depend on nothing else, so any scheduling (chunks, batches, preemption) must give the same tokens."""

    V = 97
    config = ModelConfig(vocab_size=V, hidden_size=2, intermediate_size=2, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=2, max_seq_len=64, attention_backend="torch")

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # device and dtype for the engine's cache

    def forward(self, input_ids, positions):
        return torch.stack([input_ids, positions], -1)

    def logits(self, hidden):
        nxt = (31 * hidden[:, 0] + 7 * hidden[:, 1] + 1) % self.V
        return torch.nn.functional.one_hot(nxt, self.V).float()

    @classmethod
    def expect(cls, prompt, n):
        tokens = list(prompt)
        for _ in range(n):
            tokens.append((31 * tokens[-1] + 7 * (len(tokens) - 1) + 1) % cls.V)
        return tokens[len(prompt):]


requests_st = st.lists(st.tuples(st.lists(st.integers(0, Arithmetic.V - 1), min_size=1, max_size=24),
                                 st.integers(1, 10), st.integers(0, 12)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, budget=st.integers(1, 24), seqs=st.integers(1, 5), page_size=st.integers(1, 6),
       spare=st.integers(0, 6))
def test_scheduler_loses_nothing_and_returns_every_page(reqs, budget, seqs, page_size, spare):
    longest = max(len(p) + n for p, n, _ in reqs)
    pages = -(-longest // page_size) + spare + 1  # the longest request fits alone, barely
    engine = Engine(Arithmetic(), EngineConfig(mode="eager", max_num_seqs=seqs, max_num_batched_tokens=budget,
                                               num_pages=pages, page_size=page_size, max_seq_len=64))
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])  # (index, (prompt, max_new, arrival step))
    submitted, finished, step = {}, [], 0
    while pending or engine.has_work():
        while pending and pending[0][1][2] <= step:
            i, (prompt, n, _) = pending.pop(0)
            submitted[i] = engine.add_request(prompt, SamplingParams(max_new_tokens=n), id=i)
        finished += engine.step()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert sorted(r.id for r in finished) == list(range(len(reqs)))
    for i, (prompt, n, _) in enumerate(reqs):
        assert submitted[i].output == Arithmetic.expect(prompt, n)
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == pages - 1
    assert all(s.tokens <= budget and s.seqs <= seqs for s in engine.steps)


def test_closed_loop_keeps_the_concurrency():
    engine = Engine(Arithmetic(), EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=32,
                                               max_seq_len=64))
    work = Workload(input_len=10, output_len=6, range_ratio=0.5, seed=1).requests(9, Arithmetic.V)
    done = closed_loop(engine, work, concurrency=3)
    assert len(done) == 9 and max(s.seqs for s in engine.steps) == 3
    assert [len(r.output) for r in sorted(done, key=lambda r: r.id[1])] == [n for _, n in work]


# -- the command line ----------------------------------------------------------------------------------------
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
    assert "plan us" in result.output and "decode replays" in result.output and "GC pauses" in result.output
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

    engine = Engine(model, _config("auto", num_pages=15))
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


def test_auto_times_decode_steps_on_rows_that_spread_over_a_routers_experts():
    """Auto's timing rows differ as served rows do: each its own token and page, so through a mixture of experts
    they reach more experts than pad rows (all reading the one scratch slot: one top-k set for every row) do, as a
    served batch's rows would (the FP8 MoE's 16-row step timed 4.8 ms on pad rows against ~10 ms served, on the H200).
    With too few free pages it falls back to pad rows; either way the cache ends as it began."""
    from piecegraph.context import forward_context
    from piecegraph.models.moe import MoEDecoder
    from piecegraph.models.moe_config import TINY_MOE
    from piecegraph.serve import executor

    moe = MoEDecoder.random(TINY_MOE, seed=1).eval()
    engine = Engine(moe, _config("auto", num_pages=40))
    cache, chosen, seen = engine.cache, [], []
    experts = moe.model.layers[0].mlp.experts  # forward(x, ids [T, k], weights): the ids the router chose
    hook = experts.register_forward_pre_hook(lambda mod, args: chosen.append(args[1]))

    def module(ids, positions):
        seen.append(ids)
        return moe(ids, positions)

    try:
        with torch.no_grad():
            executor.time_replays(module, moe, cache, 16, overlap=False, repeats=1)
            varied = chosen[-1]
            pad = executor.dummy_inputs(moe, cache, 16)
            with forward_context(pad[1]):
                moe(*pad[0])
            alike = chosen[-1]
            executor.time_replays(module, moe, cache, 64, overlap=False, repeats=1)  # 64 rows > 39 free pages
    finally:
        hook.remove()
    assert torch.equal(seen[0], executor.varied_ids(16, TINY_MOE.vocab_size, cache.device))
    assert len(set(alike.flatten().tolist())) == TINY_MOE.top_k < len(set(varied.flatten().tolist()))
    assert torch.equal(seen[-1], torch.zeros(64, dtype=torch.int64))  # the fallback: pad rows
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1


def test_auto_timing_rows_attend_over_half_the_max_seq_len_as_far_as_free_pages_allow(model):
    """Each timing row holds half of max_seq_len cached tokens (its position), fewer when the free pages cannot
    give every row that many, pad rows when they cannot give each row a page; the pages come back either way. On
    one-token rows the FP8 MoE's 1024-row step timed 30 ms where served ones took 42 (H200)."""
    from piecegraph.serve import executor

    engine = Engine(model, _config("auto", num_pages=40, max_seq_len=24))  # 39 free pages of 4 tokens
    cache = engine.cache
    expected = {2: 12, 8: 12, 16: 7, 39: 3, 40: None}  # rows -> cached tokens (min(24 // 2, pages/row * 4 - 1))
    for rows, context in expected.items():
        with executor.timing_rows(model, cache, rows) as make:
            (ids, positions), meta = make()
            held = cache.num_free_pages
            make()  # a second step reserves nothing more
            assert cache.num_free_pages == held
        if context is None:
            assert torch.equal(ids, torch.zeros(rows, dtype=torch.int64))  # pad rows on the scratch page
        else:
            assert positions.tolist() == [context] * rows, rows
            assert held == 39 - rows * (context // PAGE_SIZE + 1)
        assert cache.sequences() == [] and cache.num_free_pages == 39


def test_gpu_bound_estimate_runs_only_the_rows_the_cache_holds(model):
    """A concurrency beyond the cache's room is estimated at the rows that fit at the mean context (the engine
    runs no more at once), not refused: at c=1024 the FP8 MoE's 30,000 pages failed to reserve 1024 rows."""
    from piecegraph.serve.gpu_bound import engine_fits, engine_timer, estimate

    engine = Engine(model, _config("auto", num_pages=15))  # 14 free pages of 4 tokens
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


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 40), seed=st.integers(0, 2**16), top_p=st.floats(0.01, 1.0), spread=st.floats(0.1, 8.0))
def test_nucleus_keeps_exactly_the_most_likely_tokens_reaching_top_p(vocab, seed, top_p, spread):
    from piecegraph.serve.sampling import nucleus

    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * spread, -1)
    kept = nucleus(probs, top_p)
    # float64 reference, one token at a time: walk the tokens from the most likely, stop once the mass reaches top_p
    order, mass, want = sorted(range(vocab), key=lambda i: -float(probs[i])), 0.0, set()
    for i in order:
        if mass >= top_p:
            break
        want.add(i)
        mass += float(probs[i])
    assert {i for i in range(vocab) if kept[i] > 0} == want
    assert torch.equal(kept[sorted(want)], probs[sorted(want)])


def test_top_p_samples_only_inside_the_nucleus_and_is_checked():
    model = Decoder.random(TINY, seed=2).eval()
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, max_num_batched_tokens=64, max_seq_len=64))
    tiny_p = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3,
                                                                top_p=1e-9))
    assert tiny_p == generate(model, [[1, 2, 3], [4, 5]], 6)  # a nucleus of one token: the argmax
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="SamplingParams.top_p"):
            SamplingParams(top_p=bad)


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


def test_auto_times_its_decode_choice_again_after_the_full_module_swapped_its_program(model, expected,
                                                                                       monkeypatch, caplog):
    """A step first lets the full module look for its background package (a stand-in swap here; the real one is
    tests/cpu/test_aot_background.py's), then, once it swapped, times the decode choice again: full graphs were
    slower than piecewise before, faster after, and the steps follow. Without a swap nothing is timed again."""
    engine = Engine(model, _config("auto", num_pages=15))
    module = engine.executor.decode.module
    timings = []

    def timer(cache):
        def time_one(slot, n):
            timings.append((slot.kind, n))
            return 1.0 if slot.kind == "piecewise" else (0.5 if module.swaps else 2.0)
        return time_one

    monkeypatch.setattr(engine.executor, "decode_timer", timer)
    engine.executor.choose_decode(timer(None))
    params = SamplingParams(max_new_tokens=MAX_NEW)
    assert engine.generate(PROMPTS, params) == expected
    assert len(timings) == 4  # two sizes, two modules, once: no swap, no timing again
    assert {s.kind for s in engine.steps if s.is_decode and s.tokens <= 2} == {"piecewise"}
    looks, swapped = [], [1]

    def poll_upgrade():  # a worker's package appears: the next look swaps it in
        looks.append(module.swaps)
        module.swaps = swapped[0]
        return True

    monkeypatch.setattr(module, "poll_upgrade", poll_upgrade)
    steps = len(engine.steps)
    assert engine.generate(PROMPTS, params) == expected
    assert looks and len(timings) == 8  # looked at every step; timed again once, after the swap
    choice = engine.capture_report()["decode_choice"]
    assert {(c["pick"], c["when"]) for c in choice.values()} == {("full", "swap")}
    assert {s.kind for s in engine.steps[steps:] if s.is_decode and s.tokens <= 2} == {"full"}

    def failing(cache):  # a timing that fails after a later swap: the step goes on with the choice it had
        def time_one(slot, n):
            raise RuntimeError("CUDA error: out of memory (timing)")
        return time_one

    monkeypatch.setattr(engine.executor, "decode_timer", failing)
    swapped[0] = 2
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        assert engine.generate(PROMPTS, params) == expected
    assert "timing the decode choice again after the full module's swap failed (RuntimeError" in caplog.text
    assert engine.capture_report()["decode_choice"] == choice
    assert caplog.text.count("timing the decode choice again") == 1  # once per swap, not once per step


class _Swapping:
    """A full module stand-in: its program is swapped (``swaps`` counts) when the next look is told to."""

    def __init__(self):
        self.swaps, self.pending = 0, False

    def poll_upgrade(self):
        swapped, self.pending = self.pending, False
        self.swaps += swapped
        return swapped


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.sampled_from([None, 0, 1, 2, 3]), st.booleans()), max_size=12))
def test_refresh_times_the_decode_choice_once_per_swap_and_keeps_the_last_one_when_a_timing_fails(events):
    """Any sequence of steps, each maybe after a swap (first flag), whose timing may fail at its k-th of four
    measurements (second) and may find piecewise faster (third): the choice is the last successful timing's, each
    swap is timed once, at the first step after it, and a failed timing leaves the whole choice as it was.
    Checked against a plain model of that rule, on :meth:`Executor.refresh` with stand-in modules."""
    from piecegraph.serve.executor import Executor, Slot

    executor = Executor.__new__(Executor)
    module = _Swapping()
    executor.decode, executor.mixed = Slot("full", module, (1, 2)), Slot("piecewise", object(), (1, 2, 4))
    executor.decode_choice, executor._timed_swaps = {}, 0
    timings, expected_picks, expected_timings = [], None, 0
    for swapped, fails, piecewise_faster in events:
        module.pending = swapped

        def timer(cache, fails=fails, faster=piecewise_faster):
            calls = []

            def time_one(slot, n):
                timings.append((slot.kind, n))
                calls.append(n)
                if fails is not None and len(calls) > fails:
                    raise RuntimeError("timing failed")
                return 1.0 if (slot.kind == "piecewise") == faster else 2.0
            return time_one

        executor.decode_timer = timer
        executor.refresh(None)
        if swapped:  # the model: timed once after a swap; kept as it was when the timing failed
            expected_timings += 1
            if fails is None:
                expected_picks = "piecewise" if piecewise_faster else "full"
        picks = {c["pick"] for c in executor.decode_choice.values()} or None
        assert picks == (None if expected_picks is None else {expected_picks})
        assert executor._timed_swaps == module.swaps  # looked at: not timed again at the next step
    assert sum(1 for kind, n in timings if kind == "full" and n == 1) == expected_timings


def test_decode_choice_times_steps_back_to_back_with_their_own_plan_when_overlapped(model, monkeypatch):
    """The overlapped engine's pace is the slower of host and device per step, so its decode choice times steps
    launched back to back, each with fresh metadata (the attention plan is host work a step pays); the
    synchronous engine times each step alone, also with fresh metadata. Checked on the timer's arithmetic with a
    fake clock (each call costs 3 ms of host time; warm-up calls are not counted) and on which timer each loop
    asks for."""
    from piecegraph.graphs import capture
    from piecegraph.serve import executor

    clock = [0.0]
    monkeypatch.setattr(capture.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn(i):
        calls.append(i)
        clock[0] += 0.003

    assert capture.pipelined_ms(fn, warmup=2, repeats=5) == pytest.approx(3.0)
    assert calls == [0, 1, 0, 1, 2, 3, 4]
    monkeypatch.undo()

    engine = Engine(model, _config("auto", num_pages=15))
    built = []
    for_batch = executor.AttentionMetadata.for_batch
    monkeypatch.setattr(executor.AttentionMetadata, "for_batch",
                        lambda cache, seqs: built.append(len(seqs)) or for_batch(cache, seqs))
    seen = {}
    monkeypatch.setattr(executor, "pipelined_ms", lambda step, repeats: seen.setdefault("pipelined", step(0)) or 1.0)
    monkeypatch.setattr(executor, "time_ms", lambda step, warmup, repeats: seen.setdefault("alone", step(0)) or 2.0)
    decode = engine.executor.decode
    assert executor.time_replays(decode.module, engine.model, engine.cache, 2) == 1.0
    assert built == [2]  # each timed step builds its own inputs and metadata
    assert executor.time_replays(decode.module, engine.model, engine.cache, 4, overlap=False) == 2.0
    assert built == [2, 4] and set(seen) == {"pipelined", "alone"}
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_the_engine_passes_full_compile_to_its_full_module_and_checks_it():
    """``EngineConfig.full_compile`` reaches auto's full (decode) module only (piecewise compiles by pieces
    anyway); serve-bench's ``auto-pieces`` row sets it with ``share_trace``; other values are refused naming the
    field."""
    model = Decoder.random(TINY, seed=1).eval()
    config = EngineConfig(mode="auto", max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32, compiler="eager",
                          emulate_graphs=True, decode_sizes=(1, 2), prefill_sizes=(4, 16), full_compile="pieces")
    executor = Engine(model, config).executor
    assert executor.decode.module.config.full_compile == "pieces"
    assert executor.mixed.module.config.full_compile == "auto"  # the default: piecewise compiles by pieces anyway
    from piecegraph.serve.sweep import engine_config

    pieces = engine_config("auto-pieces", EngineConfig())
    assert pieces.full_compile == "pieces" and pieces.share_trace
    assert (EngineConfig().share_trace, EngineConfig().full_compile) == (True, "auto")  # the defaults
    shared = engine_config("auto-shared", EngineConfig())
    assert (shared.mode, shared.share_trace, shared.full_compile) == ("auto", True, "whole")
    with pytest.raises(ValueError, match="EngineConfig.full_compile='layers'"):
        EngineConfig(full_compile="layers")
    with pytest.raises(ValueError, match="EngineConfig.share_trace='yes' must be True or False"):
        EngineConfig(share_trace="yes")
    static = Engine(model, config.replace(decode_compile_sizes="auto")).executor  # auto-static's change
    assert static.decode.module.config.compile_sizes == "auto" and static.mixed.module.config.compile_sizes is None
    assert engine_config("auto-static", EngineConfig()).decode_compile_sizes == "auto"
    with pytest.raises(ValueError, match="EngineConfig.decode_compile_sizes=4"):
        EngineConfig(decode_compile_sizes=4)


@pytest.mark.parametrize("share", [True, False])
def test_auto_traces_the_model_once_for_both_modules_when_sharing(monkeypatch, share):
    """``EngineConfig(share_trace=True)``: auto's full module builds its program from the piecewise module's trace
    (``trace_from``): one Dynamo trace per engine (two without), tokens equal to the model's own greedy decoding
    either way, and the decode module says ``"shared"``."""
    from piecegraph.graphed import module as graphed_module

    traced = []
    real = graphed_module.trace_model
    monkeypatch.setattr(graphed_module, "trace_model", lambda *a, **k: traced.append(1) or real(*a, **k))
    model = Decoder.random(TINY, seed=4).eval()
    engine = Engine(model, EngineConfig(mode="auto", max_num_seqs=3, max_num_batched_tokens=16, max_seq_len=48,
                                        compiler="eager", emulate_graphs=True, decode_sizes=(1, 2, 4),
                                        prefill_sizes=(4, 8, 16), share_trace=share))
    assert len(traced) == (1 if share else 2)
    shared = engine.executor.decode.module.stats()["startup"].get("trace") == "shared"
    assert shared == share
    prompts = [[3, 1, 4, 1], [5, 9], [2, 6, 5, 3, 5]]
    assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == generate(model, prompts, 6)
    assert {s.kind for s in engine.steps} >= {"full", "piecewise"}


def test_trace_from_needs_the_same_model_before_setup_and_falls_back_to_tracing(monkeypatch):
    """A module whose source has no trace to share (breakable: no Dynamo) traces by itself; another model or a
    module already set up is refused."""
    import piecegraph
    from piecegraph.attention import KVCache
    from piecegraph.graphed import module as graphed_module
    from piecegraph.models import dummy_inputs

    model, other = Decoder.random(TINY, seed=4).eval(), Decoder.random(TINY, seed=5).eval()
    cache = KVCache.for_sequences(TINY, 2, 32)
    make = lambda n: dummy_inputs(model, cache, n)  # noqa: E731
    source = piecegraph.compile(model, mode="breakable", capture_sizes=(2,), emulate_graphs=True)
    full = piecegraph.compile(model, mode="full", capture_sizes=(2,), emulate_graphs=True, compiler="eager")
    with pytest.raises(ValueError, match="same model"):
        full.trace_from(piecegraph.compile(other, mode="piecewise"))
    with pytest.raises(ValueError, match=r"Config.token_dim=1 differs from this module's 0"):
        full.trace_from(piecegraph.compile(model, mode="piecewise", token_dim=1))
    with pytest.raises(ValueError, match=r"Config.static_inputs=\('positions',\) differs"):
        full.trace_from(piecegraph.compile(model, mode="piecewise", static_inputs=("positions",)))
    full.trace_from(source)
    source.capture(make)
    traced = []
    real = graphed_module.trace_model
    monkeypatch.setattr(graphed_module, "trace_model", lambda *a, **k: traced.append(1) or real(*a, **k))
    full.capture(make)
    assert traced == [1] and full.stats()["startup"].get("trace") != "shared"
    with pytest.raises(RuntimeError, match="before this module's first call"):
        full.trace_from(source)
