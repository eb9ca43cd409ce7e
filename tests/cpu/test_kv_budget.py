"""A default KV cache is sized to the device's free memory (serve/kv_budget.py): every sequence at its longest
when that fits in ``kv_cache_memory`` of it, else what fits (the scheduler preempts), and a clear refusal when not
one sequence fits. The engine-level test fakes the free memory (CPU has none to measure) and checks the trimmed
engine's tokens against each prompt decoded alone."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import piecegraph.serve.engine as engine_module
from piecegraph.attention.pages import pages_for
from piecegraph.models import QWEN1_5_MOE_A2_7B, TINY, Decoder, MoEDecoder, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.kv_budget import kv_budget

pytestmark = pytest.mark.usefixtures("one_thread")


@given(seqs=st.integers(1, 2048), max_len=st.integers(1, 4096), page_size=st.sampled_from([1, 4, 16, 64]),
       bytes_per_page=st.integers(1, 2**24), fraction=st.floats(0.01, 1.0), free=st.integers(0, 2**38))
def test_the_budget_never_exceeds_its_share_and_trims_only_when_it_must(seqs, max_len, page_size, bytes_per_page,
                                                                         fraction, free):
    per_seq = -(-max_len // page_size)
    wanted = seqs * per_seq + 1
    share = int(fraction * free)
    try:
        budget = kv_budget(max_num_seqs=seqs, max_seq_len=max_len, page_size=page_size, page_bytes=bytes_per_page,
                           fraction=fraction, free_bytes=free)
    except ValueError as err:
        assert (per_seq + 1) * bytes_per_page > share  # refused only when one sequence does not fit
        assert "max_seq_len" in str(err) and "kv_cache_memory" in str(err)
        return
    assert budget.wanted == wanted and per_seq + 1 <= budget.pages <= wanted
    assert budget.pages * bytes_per_page <= share
    assert budget.trimmed == (wanted * bytes_per_page > share)  # every sequence whenever it fits
    assert (budget.pages + 1) * bytes_per_page > share or not budget.trimmed  # and as many pages as fit


def test_without_a_measured_device_every_sequence_gets_room():
    budget = kv_budget(max_num_seqs=8, max_seq_len=100, page_size=16, page_bytes=1, fraction=0.5, free_bytes=None)
    assert budget.pages == 8 * pages_for(100, 16) + 1 and not budget.trimmed


def test_page_bytes_counts_keys_and_values_of_every_layer():
    # The Qwen1.5-MoE-A2.7B shape: 24 layers, 16 KV heads of 128, bf16, 16-token pages -> 3 MiB a page
    with torch.device("meta"):  # the shape only: nothing allocated
        facts = MoEDecoder(QWEN1_5_MOE_A2_7B).to(torch.bfloat16).facts()
    assert 16 * facts.kv_bytes_per_token() == 2 * 24 * 16 * 16 * 128 * 2 == 3 * 2**20


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9", None])
def test_a_bad_kv_cache_memory_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"EngineConfig.kv_cache_memory=.* must be a fraction in \(0, 1\]"):
        EngineConfig(kv_cache_memory=bad)


def _config(**changes):
    base = dict(mode="piecewise", max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_seq_len=48,
                decode_sizes=(1, 2), prefill_sizes=(1, 2, 4, 8), compiler="eager", emulate_graphs=True)
    return EngineConfig(**{**base, **changes})


def test_a_trimmed_cache_preempts_and_every_request_still_equals_its_prompt_alone(monkeypatch, caplog):
    model = Decoder.random(TINY, seed=3).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(10, 30))] for _ in range(6)]
    expected = [generate(model, [p], 8)[0] for p in prompts]
    per_page = 4 * model.facts().kv_bytes_per_token()
    # Free memory for 30 pages at the default 0.85 share: 4 sequences of 48 tokens would need 49
    monkeypatch.setattr(engine_module, "free_device_bytes", lambda device: int(30 * per_page / 0.85) + 1)
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        engine = Engine(model, _config())
    assert engine.cache.num_pages == 30 and engine.capture_report()["kv_cache"] == {"pages": 30, "trimmed_from": 49}
    assert any("requests beyond it wait or are preempted" in r.getMessage() for r in caplog.records)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=8)) == expected
    assert engine.stats()["preemptions"] > 0  # the trimmed budget made the scheduler preempt
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_an_engine_refuses_a_device_that_cannot_hold_one_sequence(monkeypatch):
    model = Decoder.random(TINY, seed=3).eval()
    monkeypatch.setattr(engine_module, "free_device_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_seq_len=48"):
        Engine(model, _config())
