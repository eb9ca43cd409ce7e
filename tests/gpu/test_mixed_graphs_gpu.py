"""Auto's full-mixed graphs on a GPU: steps with prompt tokens replayed as whole CUDA graphs on FlashInfer's
CUDA-graph prefill wrapper (``piecegraph/attention/backends/flashinfer_mixed.py``).

Random mixed steps (prompts fresh or continued, decode rows with context, any count of sequences up to the
graph's slots, any token count up to the size) through the full-mixed graph give the hidden states of the same
step through the piecewise module and of the model run eagerly, within bf16 rounding; the schedule FlashInfer baked
into each graph never changes (the backend raises if it does); and served tokens of auto equal those of auto
without full-mixed graphs, or differ only where the reference's top two logits are a bf16 tie."""

from __future__ import annotations

import random

import pytest
import torch

from piecegraph.attention import AttentionMetadata
from piecegraph.attention.backends import flashinfer_available
from piecegraph.context import forward_context
from piecegraph.models import Decoder, ModelConfig
from piecegraph.serve import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
# the 0.5B model's attention shape (14 query heads over 2 KV heads of 64), small otherwise
SHAPE = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=14,
                    num_kv_heads=2, head_dim=64, max_seq_len=512, qkv_bias=True)


@pytest.fixture(scope="module")
def engine():
    reason = flashinfer_available(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    model = Decoder.random(SHAPE, seed=7, device="cuda", dtype=torch.bfloat16).eval()
    return Engine(model, EngineConfig(mode="auto", max_num_seqs=16, max_num_batched_tokens=512, page_size=16,
                                      max_seq_len=512, attention_backend="flashinfer"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def _random_step(rng: random.Random, cache, size: int, slots: int, trial: int) -> list[tuple]:
    """``(seq, cached, new)`` of one step of at most ``size`` tokens over at most ``slots`` sequences: a prompt
    (fresh or continued) of two tokens or more, then rows of one token (decode) or a few (another prompt chunk),
    each after up to 200 cached tokens whose pages are reserved here (holding whatever earlier steps left)."""
    count = rng.randint(1, min(slots, size - 1))
    first = rng.randint(2, size - (count - 1))
    news, left = [first], size - first
    for _ in range(count - 1):
        new = 1 if rng.random() < 0.7 or left < 2 else rng.randint(1, max(1, left - (count - len(news))))
        news.append(new)
        left -= new
    seqs = []
    for i, new in enumerate(news):
        cached = rng.choice([0, rng.randint(1, min(200, SHAPE.max_seq_len - new))])
        seq = ("step", trial, i)
        if cached:
            cache.reserve([(seq, cached)])
        seqs.append((seq, cached, new))
    return seqs


def test_random_mixed_steps_in_full_graphs_equal_piecewise_and_eager(engine, record_result):
    executor, cache, model = engine.executor, engine.cache, engine.model
    assert executor.prefill is not None, "FlashInfer captures mixed steps: auto must build its full-mixed module"
    rng, worst, rows = random.Random(0), {"full-mixed": 0.0, "piecewise": 0.0}, []
    for trial in range(60):
        size = rng.choice(executor.prefill.sizes[2:])
        slots = cache.backend.mixed_graph_seqs(size)
        seqs = _random_step(rng, cache, size, slots, trial)
        ids = torch.randint(SHAPE.vocab_size, (sum(n for _, _, n in seqs),), device="cuda")
        outs = {}
        try:
            for name, run in (("full-mixed", executor.prefill.module), ("piecewise", executor.mixed.module),
                              ("eager", model)):
                meta = AttentionMetadata.for_batch(cache, seqs)
                before = executor.prefill.replays()
                with forward_context(meta), torch.no_grad():
                    outs[name] = run(ids, meta.positions)[: meta.num_tokens].clone()
                if name == "full-mixed":
                    assert executor.prefill.replays() == before + 1  # a replay, not a run without graphs
        finally:
            for seq, _, _ in seqs:
                cache.discard(seq)
        for name in worst:
            worst[name] = max(worst[name], _rel(outs[name], outs["eager"]))
        rows.append({"size": size, "seqs": len(seqs), "tokens": ids.numel(),
                     "rel_full_mixed": _rel(outs["full-mixed"], outs["eager"]),
                     "rel_piecewise": _rel(outs["piecewise"], outs["eager"])})
    record_result("mixed_graphs_gpu.json", "random_mixed_steps", {"worst": worst, "steps": rows})
    assert worst["full-mixed"] < 2e-2 and worst["full-mixed"] < 3 * worst["piecewise"] + 5e-3, worst
    assert cache.num_free_pages == cache.num_pages - 1


def test_served_tokens_with_full_mixed_graphs_equal_those_without(engine, record_result):
    """Arrivals beside running decode rows: auto's tokens with full-mixed graphs against auto without them
    (``mixed_graphs=False``), same model and requests; any difference must start at a bf16 tie of the reference."""
    from bf16_ties import first_divergences

    rng = random.Random(3)
    prompts = [[rng.randrange(SHAPE.vocab_size) for _ in range(rng.randint(20, 300))] for _ in range(24)]
    params = SamplingParams(max_new_tokens=24)
    got = engine.generate(prompts, params)
    kinds = engine.stats()["by_kind"]
    plain = Engine(engine.model, engine.config.replace(mixed_graphs=False))
    want = plain.generate(prompts, params)

    def logits_of(tokens):
        return plain.model.logits(_hidden(plain, tokens))[-1].float()

    ties = first_divergences(prompts, got, want, logits_of)
    record_result("mixed_graphs_gpu.json", "served_tokens", {"kinds": kinds, "differing": ties})
    assert "full-mixed" in kinds or not any(c["pick"] == "full-mixed" for c in engine.capture_report()[
        "mixed_choice"].values())
    assert all(t["bf16_steps_apart"] <= 4 for t in ties), ties  # as test_attention_gpu.py's greedy test


def _hidden(engine: Engine, tokens: list[int]) -> torch.Tensor:
    cache = engine.cache
    meta = AttentionMetadata.for_batch(cache, [("reference", 0, len(tokens))])
    try:
        with forward_context(meta), torch.no_grad():
            return engine.model(torch.tensor(tokens, device="cuda"), meta.positions)
    finally:
        cache.discard("reference")
