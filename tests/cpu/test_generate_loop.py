"""The one greedy loop (models.generate.greedy_loop) behind piecegraph.models.generate and piecegraph.hf: EOS stops
a sequence (kept, as Hugging Face keeps it), the decode batch shrinks as sequences finish (one step late: the loop
launches a step before reading the last one's tokens), and their pages are freed at once. The reference is the
same model decoded one prompt at a time without EOS, cut at the first EOS."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, generate

PROMPTS = [[3, 7, 1, 9], [11, 2], [5, 5, 5, 8, 13, 2, 1], [42]]
NEW = 8


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder.random(TINY).eval()


def _alone(model: Decoder, prompt: list[int]) -> list[int]:
    return generate(model, [prompt], NEW)[0]


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_without_eos_each_prompt_equals_decoding_it_alone():
    model = _model()
    assert generate(model, PROMPTS, NEW) == [_alone(model, p) for p in PROMPTS]


def test_eos_stops_each_sequence_and_the_batch_shrinks_with_pages_freed_at_once():
    model = _model()
    alone = [_alone(model, p) for p in PROMPTS]
    # An EOS id that one prompt emits early and another never: the batch must shrink mid-run.
    eos = {alone[0][2]}
    expected = [_cut(t, eos) for t in alone]
    assert len({len(t) for t in expected}) > 1, "the chosen EOS must finish sequences at different steps"
    cache = KVCache.for_sequences(model.config, len(PROMPTS), 32)
    rows, held = [], []

    def decode(ids, positions):
        rows.append(ids.shape[0])
        held.append(len(cache.sequences()))
        return model(ids, positions)

    out = generate(model, PROMPTS, NEW, cache=cache, decode_fn=decode, eos_token_id=eos)
    assert out == expected
    # The step making token m+1 is launched before token m is read (overlapped): its rows are the sequences not
    # known to have stopped, i.e. those that made token m (one that stops at m runs once more, its token dropped).
    running = [sum(len(t) >= made for t in expected) for made in range(1, NEW)]
    assert rows == [r for r in running if r]
    assert held == rows  # a finished sequence's pages are gone as soon as the host learns it finished
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1


def test_eos_as_several_ids_and_an_error_frees_every_page():
    model = _model()
    alone = [_alone(model, p) for p in PROMPTS]
    eos = [alone[1][0], alone[2][3]]
    assert generate(model, PROMPTS, NEW, eos_token_id=eos) == [_cut(t, set(eos)) for t in alone]
    cache = KVCache.for_sequences(model.config, len(PROMPTS), 32)

    def failing(ids, positions):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        generate(model, PROMPTS, NEW, cache=cache, decode_fn=failing, eos_token_id=eos)
    assert cache.sequences() == []


@pytest.mark.parametrize("eos", ["2", 2.0, True, [3, "x"], object(), torch.tensor(2.5)])
def test_an_eos_id_that_is_not_an_int_is_refused_naming_it(eos):
    model = _model()
    with pytest.raises(TypeError, match=r"eos_token_id=.* must be an int token id or a list of them"):
        generate(model, PROMPTS, NEW, eos_token_id=eos)


@functools.cache
def _alone_cached(prompt: tuple[int, ...]) -> list[int]:
    return _alone(_MODEL, list(prompt))


_MODEL = _model()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=5), limit=st.integers(1, NEW),
       stops=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, NEW - 1)), max_size=3))
def test_overlapped_loop_equals_each_prompt_alone_cut_at_its_stops(picks, limit, stops):
    """Property: whatever the batch, the stop ids (taken from tokens the prompts really emit, so sequences stop at
    different steps, several in one step, or at the first token) and the limit, each output equals that prompt
    decoded alone and cut at its first stop id and at the limit; every page is free after."""
    prompts = [PROMPTS[i] for i in picks]
    eos = {_alone_cached(tuple(PROMPTS[i]))[step] for i, step in stops}
    cache = KVCache.for_sequences(_MODEL.config, len(prompts), 32)
    rows = []

    def decode(ids, positions):
        rows.append(ids.shape[0])
        return _MODEL(ids, positions)

    out = generate(_MODEL, prompts, limit, cache=cache, decode_fn=decode, eos_token_id=eos)
    expected = [_cut(_alone_cached(tuple(p))[:limit], eos) for p in prompts]
    assert out == expected
    assert rows == [n for n in (sum(len(t) >= made for t in expected) for made in range(1, limit)) if n]
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1
