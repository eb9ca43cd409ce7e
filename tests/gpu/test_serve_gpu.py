"""The serving engine on a GPU with real CUDA graphs: float32 tokens (torch attention) equal each request alone
with eager greedy decoding in every mode, with preemption; the dispatch replays full graphs for pure decode steps
and piecewise graphs otherwise; the pool is shared and reported."""

import random

import pytest
import torch

from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, generate
from piecegraph.serve import ENGINE_MODES, Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
NEW = 12


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3, device="cuda").eval()


def _prompts(n=9, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_tokens_equal_each_request_alone_on_cuda(model, mode, record_result):
    prompts = _prompts()
    want = []
    for p in prompts:
        cache = KVCache.for_sequences(TINY, 1, len(p) + NEW, dtype=torch.float32, device="cuda", backend="torch")
        want.append(generate(model, [p], NEW, cache=cache)[0])
    config = EngineConfig(mode=mode, max_num_seqs=6, max_num_batched_tokens=32, num_pages=16, page_size=8,
                          max_seq_len=64, attention_backend="torch")
    engine = Engine(model, config)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=NEW)) == want
    stats, report = engine.stats(), engine.capture_report()
    assert stats["preemptions"] > 0 and engine.cache.num_free_pages == engine.cache.num_pages - 1
    kinds = {s.kind for s in engine.steps}
    if mode == "auto":
        assert all(s.kind == "full" for s in engine.steps if s.is_decode)
        assert all(s.kind == "piecewise" for s in engine.steps if not s.is_decode)
        assert report["pool_mib"] > 0 and set(report["modules"]) == {"piecewise", "full"}
    elif mode != "eager":
        assert kinds == {mode}
    record_result("serve_gpu.json", mode, {"stats": stats, "capture": report})
