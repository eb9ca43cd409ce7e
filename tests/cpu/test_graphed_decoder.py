"""The engine on the reference decoder: split count, no-graph equality, greedy generation through graphs."""

import pytest
import torch

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs, generate

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [200, 13, 54, 2, 8, 31, 77]]


def _model():
    return Decoder.random(TINY, seed=3).eval()


def test_reference_model_splits_into_layers_plus_one_pieces():
    model = _model()
    graphed = piecegraph.compile(model, mode="none", compiler="eager", max_tokens=16)
    cache = KVCache.for_sequences(TINY, 2, 32)
    (ids, pos), meta = dummy_inputs(model, cache, 5)
    with piecegraph.forward_context(meta):
        graphed(ids, pos)
    stats = graphed.stats()
    assert stats["pieces"] == TINY.num_layers + 1
    assert stats["split_ops"] == TINY.num_layers


def test_none_mode_hidden_states_equal_eager_for_a_mixed_batch():
    model = _model()
    graphed = piecegraph.compile(model, mode="none", compiler="inductor", capture_sizes=(4, 8))
    for n_seq, lens in ((1, (3,)), (2, (6, 1)), (3, (5, 4, 2))):
        outs = []
        for fn in (model, graphed):
            cache = KVCache.for_sequences(TINY, 3, 32, page_size=4)
            meta = AttentionMetadata.for_batch(cache, [(i, 0, n) for i, n in enumerate(lens)])
            ids = torch.randint(0, TINY.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(n_seq))
            with piecegraph.forward_context(meta), torch.no_grad():
                outs.append(fn(ids, meta.positions))
        rel = (outs[1] - outs[0]).norm() / outs[0].norm()
        assert rel < 1e-5, (lens, rel)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_generation_through_graphs_equals_eager(page_size):
    """Paged cache, piecewise prefill and full-graph decode (emulated on CPU), token for token."""
    model = _model()
    longest = max(map(len, PROMPTS)) + 8

    def cache():
        return KVCache.for_sequences(TINY, len(PROMPTS), longest, page_size=page_size)

    expected = generate(model, PROMPTS, max_new_tokens=8, cache=cache())
    prefill = piecegraph.compile(model, mode="piecewise", compiler="eager", max_tokens=16, emulate_graphs=True)
    decode = piecegraph.compile(model, mode="full", compiler="eager", max_tokens=4, emulate_graphs=True)
    got = generate(model, PROMPTS, max_new_tokens=8, prefill_fn=prefill, decode_fn=decode, cache=cache())
    assert got == expected
    assert decode.stats()["replays"] >= 6 and decode.stats()["sizes"] == [4]
    assert prefill.stats()["sizes"] == [16] and prefill.stats()["fallbacks"] == 0


def test_greedy_generation_in_none_mode_equals_eager():
    model = _model()
    expected = generate(model, PROMPTS, max_new_tokens=6)
    graphed = piecegraph.compile(model, mode="none", compiler="inductor", max_tokens=16)
    assert generate(model, PROMPTS, max_new_tokens=6, prefill_fn=graphed, decode_fn=graphed) == expected


def test_generate_frees_its_sequences_and_keeps_the_callers():
    model = _model()
    cache = KVCache.for_sequences(TINY, 4, 32)
    AttentionMetadata.for_batch(cache, [("mine", 0, 5)])
    free = cache.num_free_pages
    generate(model, PROMPTS, max_new_tokens=3, cache=cache)
    assert cache.sequences() == ["mine"] and cache.num_free_pages == free
