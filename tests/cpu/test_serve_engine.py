"""The serving engine's tokens: every request's tokens equal the request generated alone by eager greedy decoding,
in every mode, at any concurrency, with preemption; nothing lost or duplicated; pages returned; the dispatch (full
graphs for pure decode steps, piecewise otherwise, no graph above the largest size) read from the step stats. Also
seeded sampling that does not depend on the batch, EOS, refused requests, and a Hugging Face model on the same
engine."""

import pytest
import serve_helpers
import torch
from serve_helpers import MAX_NEW, PROMPTS, small_engine_config

from piecegraph.models import generate
from piecegraph.serve import ENGINE_MODES, Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
model, expected = serve_helpers.model, serve_helpers.expected  # module-scoped fixtures: built once in this module


@pytest.fixture(scope="module", params=ENGINE_MODES)
def engine(request, model):
    """One engine per mode (graphs captured once), shared by the runs below; its cache has 14 pages of 4 tokens,
    too few for four requests of up to 38 tokens: running them together preempts."""
    return Engine(model, small_engine_config(request.param, num_pages=15))


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
    engine = Engine(model, small_engine_config("auto"))
    report = engine.capture_report()
    assert report["modules"]["full"]["sizes"] == [1, 2]
    assert report["modules"]["piecewise"]["sizes"] == [1, 2, 4, 8]
    assert report["setup_s"] > 0 and report["pool_mib"] == 0.0  # emulated on CPU: no CUDA pool
    assert engine.executor.mixed.module.config.pool is engine.executor.decode.module.config.pool


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    engine = Engine(model, small_engine_config("eager", num_pages=15))
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=s) for s in range(len(PROMPTS))]
    together = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], params[i])[0] for i, p in enumerate(PROMPTS)]
    assert together == alone
    other = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=99))
    assert other[0] != together[0]


def test_eos_stops_a_request_and_frees_its_pages(model, expected):
    engine = Engine(model, small_engine_config("auto"))
    eos = expected[0][3]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, eos_token_id=eos))
    for got, want in zip(out, expected):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_requests_that_cannot_fit_or_repeat_an_id_are_refused(model):
    engine = Engine(model, small_engine_config("eager", num_pages=5))  # 16 tokens of pages
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
    engine = Engine(model, small_engine_config("auto", num_pages=15))
    assert engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW)) == want
    assert {"full", "piecewise"} <= {s.kind for s in engine.steps} and engine.stats()["preemptions"] > 0
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1
