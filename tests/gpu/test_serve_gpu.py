"""The serving engine on a GPU with real CUDA graphs: float32 tokens (torch attention) equal each request alone
with eager greedy decoding in every mode, overlapped and synchronous, with preemption; the dispatch replays full
graphs for pure decode steps and piecewise graphs otherwise; the pool is shared and reported. Decode and mixed
steps (on FlashInfer, full-mixed graphs too) make no device sync but the one intended (the event wait for a
step's tokens), under ``torch.cuda.set_sync_debug_mode("error")``, with torch and FlashInfer attention; auto's
decode choice is measured."""

import contextlib
import random

import pytest
import torch

from piecegraph.attention import KVCache
from piecegraph.attention.backends import flashinfer_available
from piecegraph.models import TINY, Decoder, ModelConfig, generate
from piecegraph.serve import ENGINE_MODES, Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3, device="cuda").eval()


def _prompts(n=9, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_tokens_equal_each_request_alone_on_cuda(model, mode, overlap, record_result):
    prompts = _prompts()
    want = []
    for p in prompts:
        cache = KVCache.for_sequences(TINY, 1, len(p) + NEW, dtype=torch.float32, device="cuda", backend="torch")
        want.append(generate(model, [p], NEW, cache=cache)[0])
    config = EngineConfig(mode=mode, max_num_seqs=6, max_num_batched_tokens=32, num_pages=16, page_size=8,
                          max_seq_len=64, attention_backend="torch", overlap=overlap)
    engine = Engine(model, config)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW)) == want
    stats, report = engine.stats(), engine.capture_report()
    assert stats["preemptions"] > 0 and engine.cache.num_free_pages == engine.cache.num_pages - 1
    kinds = {s.kind for s in engine.steps}
    if mode == "auto":
        picks = {n: c["pick"] for n, c in report["decode_choice"].items()}
        decode = engine.executor.decode
        assert all(s.kind == picks[decode.bucket(s.tokens)] for s in engine.steps if s.is_decode)
        assert all(s.kind == "piecewise" for s in engine.steps if not s.is_decode)
        assert report["pool_mib"] > 0 and set(report["modules"]) == {"piecewise", "full"}
        choice = report["decode_choice"]
        assert choice and all(c["by"] == "measured" and c["full_ms"] > 0 and c["piecewise_ms"] > 0
                              for c in choice.values())
    elif mode != "eager":
        assert kinds == {mode}
    record_result("serve_gpu.json", f"{mode}{'' if overlap else '-sync'}", {"stats": stats, "capture": report})


# -- no hidden syncs on the step path ----------------------------------------------------------------------------
# The 0.5B attention shape for FlashInfer (14 q heads over 2 kv heads, head_dim 64), small otherwise.
FI_SHAPE = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=14,
                       num_kv_heads=2, head_dim=64, max_seq_len=128, qkv_bias=True)


@contextlib.contextmanager
def sync_errors():
    """Every synchronizing CUDA call (``.item()``, ``.tolist()`` of a device tensor, a blocking copy, a stream or
    device sync) raises inside; event waits (the engine's intended one) do not count."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_and_mixed_steps_make_no_unintended_sync(backend, overlap, temperature, record_result):
    """After a warm-up run (lazy allocations, first plans), requests arrive while others decode, so the measured
    steps are full-graph decode steps and piecewise mixed (prefill + decode) steps; none may sync the device."""
    if backend == "flashinfer" and flashinfer_available(torch.device("cuda")) is not None:
        pytest.skip(str(flashinfer_available(torch.device("cuda"))))
    shape, dtype = (FI_SHAPE, torch.bfloat16) if backend == "flashinfer" else (TINY, torch.float32)
    model = Decoder.random(shape, seed=3, device="cuda", dtype=dtype).eval()
    config = EngineConfig(mode="auto", max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_seq_len=96,
                          attention_backend=backend, overlap=overlap)
    engine = Engine(model, config)
    prompts = _prompts(12, seed=1)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=5)
    engine.generate(prompts[:6], params)  # warm-up: every lazy first-use path runs here
    engine.reset_stats()
    for p in prompts[:4]:
        engine.add_request(p, params)
    with sync_errors():
        for i in range(200):
            if i in (3, 6, 9, 12):  # arrivals while others decode: mixed steps
                for p in prompts[4 + (i // 3 - 1) * 2:][:2]:
                    engine.add_request(p, params)
            engine.step()
            if not engine.has_work():
                break
    assert not engine.has_work() and engine.cache.num_free_pages == engine.cache.num_pages - 1
    kinds = {s.kind for s in engine.steps}
    assert any(s.decode_rows and s.prefill_tokens for s in engine.steps), "no mixed step was measured"
    assert any(s.is_decode for s in engine.steps) and kinds <= {"full", "full-mixed", "piecewise"}
    stats = engine.stats()
    if backend == "flashinfer":
        assert stats["max_plans_per_step"] <= 1  # FlashInfer plan() at most once per step
        picks = {c["pick"] for c in engine.capture_report()["mixed_choice"].values()}
        assert "full-mixed" not in picks or "full-mixed" in kinds  # mixed steps on full graphs, where faster
    record_result("serve_gpu.json", f"no_sync_{backend}_{'overlap' if overlap else 'sync'}_t{temperature}",
                  {"by_kind": stats["by_kind"], "plan_us": stats["plan_us"], "phase_ms": stats["phase_ms"]})


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_engines_sharing_a_cache_with_real_graphs_equal_engines_alone(backend):
    """serve-bench --interleave's sharing with real CUDA graphs: an auto and a piecewise engine on one KV cache
    (FlashInfer: one set of per-size graph wrappers, whose buffers both engines' full graphs bake in), batches
    alternating with preemption. Each engine's tokens equal those of the same mode's engine on a cache of its own;
    on torch attention in float32, eager greedy decoding alone too."""
    if backend == "flashinfer" and flashinfer_available(torch.device("cuda")) is not None:
        pytest.skip(str(flashinfer_available(torch.device("cuda"))))
    shape, dtype = (FI_SHAPE, torch.bfloat16) if backend == "flashinfer" else (TINY, torch.float32)
    model = Decoder.random(shape, seed=4, device="cuda", dtype=dtype).eval()
    prompts, params = _prompts(8, seed=2), SamplingParams(max_new_tokens=10)
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=32, num_pages=20, page_size=8, max_seq_len=64,
                          attention_backend=backend)
    alone = {mode: Engine(model, config.replace(mode=mode)).generate(prompts, params)
             for mode in ("auto", "piecewise")}
    if backend == "torch":
        assert alone["auto"] == alone["piecewise"] == [generate(model, [p], 10)[0] for p in prompts]
    auto = Engine(model, config.replace(mode="auto"))
    piecewise = Engine(model, config.replace(mode="piecewise"), cache=auto.cache)
    for mode, engine in (("auto", auto), ("piecewise", piecewise), ("auto", auto), ("piecewise", piecewise)):
        assert engine.generate(prompts, params) == alone[mode], mode
    assert auto.stats()["graph_share"] > 0 and piecewise.stats()["graph_share"] > 0
