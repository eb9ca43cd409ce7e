"""Values of another width than keys (``v_head_dim != head_dim``, e.g. DeepSeek-V2 run expanded: keys 192, values
128) through the ordinary ``attention`` op: the cache's v is ``v_head_dim`` wide, and the torch backend and the
FlashInfer backend (its CPU stand-in) equal a float64 reference (per-sequence causal softmax attention, written
here) over mixed prefill, chunked-prefill and decode steps in padded buckets."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.hf.arch import HFCacheShape, cache_config, head_dims

pytestmark = pytest.mark.usefixtures("one_thread")  # two shared cores: one torch thread each

H, HKV, D, DV = 4, 2, 12, 6


@dataclass(frozen=True)
class Shape:
    num_layers: int = 1
    num_heads: int = H
    num_kv_heads: int = HKV
    head_dim: int = D
    v_head_dim: int = DV
    max_seq_len: int = 48
    attention_backend: str = "torch"


def _reference(hist_k, hist_v, q, cached, new):
    """float64 causal attention of ``new`` queries over a sequence's keys/values ``[L, HKV, *]``."""
    out = []
    for i in range(new):
        visible = cached + i + 1
        for h in range(H):
            kv = h // (H // HKV)
            w = torch.softmax(hist_k[:visible, kv] @ q[i, h] * D ** -0.5, dim=0)
            out.append(w @ hist_v[:visible, kv])
    return torch.stack(out).view(new, H, DV)


STEPS = [[("a", 7), ("b", 1)], [("a", 1), ("b", 5), ("c", 11)], [("a", 1), ("b", 1), ("c", 1)],
         [("c", 4), ("a", 1), ("d", 2)], [("a", 1), ("b", 1), ("c", 1), ("d", 1)]]


def _run(cache: KVCache, seed: int, pad: int = 3) -> None:
    gen, hist, lengths = torch.Generator().manual_seed(seed), {}, {}
    for step in STEPS:
        seqs = [(s, lengths.get(s, 0), n) for s, n in step]
        meta = AttentionMetadata.for_batch(cache, seqs)
        n = meta.num_tokens
        q = torch.randn(n, H, D, generator=gen, dtype=torch.float64)
        k = torch.randn(n, HKV, D, generator=gen, dtype=torch.float64)
        v = torch.randn(n, HKV, DV, generator=gen, dtype=torch.float64)
        out = torch.full((n + pad, H * DV), float("nan"))
        rows = [torch.cat([x.reshape(n, -1), torch.randn(pad, x[0].numel(), dtype=x.dtype)]).float()
                for x in (q, k, v)]
        with forward_context(meta):
            torch.ops.piecegraph_models.attention(*rows, out, 0)
        assert (out[n:] == 0).all()
        row = 0
        for s, cached, new in seqs:
            hk, hv = hist.get(s, (k[:0], v[:0]))
            hist[s] = (torch.cat([hk, k[row:row + new]]), torch.cat([hv, v[row:row + new]]))
            want = _reference(*hist[s], q[row:row + new], cached, new)
            torch.testing.assert_close(out[row:row + new].view(new, H, DV).double(), want, rtol=1e-4, atol=1e-5)
            row += new
            lengths[s] = cached + new


def _cache(seed: int, backend: str = "torch") -> KVCache:
    cache = KVCache(Shape(attention_backend=backend), 60, 4)
    random.Random(seed).shuffle(cache._free)
    for t in (*cache.k, *cache.v):
        t.normal_()
    return cache


def test_cache_allocates_values_of_their_own_width():
    cache = _cache(0)
    assert cache.k[0].shape == (60, 4, HKV, D) and cache.v[0].shape == (60, 4, HKV, DV)
    assert cache.v_head_dim == DV and cache.index_k == []
    # the bytes a token costs, as the serving KV budget reads them, are the bytes this cache allocates per slot
    from piecegraph.models.facts import ModelFacts

    facts = ModelFacts(device=torch.device("cpu"), dtype=cache.dtype, config=Shape(), weight_bytes=0, quant=None,
                       fixed_read_bytes=0)
    per_slot = sum(t[0, 0].numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert facts.kv_bytes_per_token() == per_slot


def test_torch_backend_equals_reference_with_narrower_values():
    _run(_cache(1), seed=1)


@pytest.fixture
def fake_flashinfer(fake_flashinfer, monkeypatch):
    """FlashInfer 0.5.3's API stand-in (conftest's fixture), its page reader taught values of their own width."""
    module = fake_flashinfer

    def kv(self, paged_kv_cache, b):
        k_cache, v_cache = paged_kv_cache
        lo, hi = int(self._paged_kv_indptr_buf[b]), int(self._paged_kv_indptr_buf[b + 1])
        pages = self._paged_kv_indices_buf[lo:hi].long()
        length = (hi - lo - 1) * k_cache.shape[1] + int(self._paged_kv_last_page_len_buf[b])
        return (k_cache[pages].flatten(0, 1)[:length], v_cache[pages].flatten(0, 1)[:length])

    monkeypatch.setattr(module._Paged, "_kv", kv)
    return module


def test_flashinfer_backend_plans_value_width_on_prefill_wrappers(fake_flashinfer):
    from piecegraph.attention.backends.flashinfer import FlashInferBackend

    cache = _cache(2)
    cache.backend = FlashInferBackend(cache.config, "cpu")
    # decode steps too: FlashInfer's decode wrapper has no head_dim_vo
    assert isinstance(cache.backend._decode.wrapper, fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper)
    _run(cache, seed=2)


def test_hf_cache_shape_reads_query_key_and_value_head_dims():
    from transformers import DeepseekV2Config, LlamaConfig

    ds = DeepseekV2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                          qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, kv_lora_rank=16, vocab_size=32)
    assert head_dims(ds) == (20, 10)
    shape = cache_config(ds)
    assert isinstance(shape, HFCacheShape) and (shape.head_dim, shape.v_head_dim) == (20, 10)
    assert KVCache(shape, 4, 4).v[0].shape[-1] == 10
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=32)
    assert head_dims(llama) == (16, 16) and type(cache_config(llama)).__name__ == "ModelConfig"


def test_hf_decoder_runs_deepseek_v2_expanded_as_transformers_does():
    """transformers' DeepSeek-V2 calls the attention interface with keys of 20 and values of 10 per head: through
    piecegraph's op (prefill, then a decode step) the logits equal the model's own forward."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from piecegraph.hf.model import HFDecoder

    torch.manual_seed(0)
    cfg = DeepseekV2Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                           num_key_value_heads=4, num_hidden_layers=2, qk_nope_head_dim=12, qk_rope_head_dim=8,
                           v_head_dim=10, kv_lora_rank=16, q_lora_rank=None, vocab_size=64, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1)
    model = DeepseekV2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (10,))
    with HFDecoder(model) as dec, torch.no_grad():
        cache = KVCache.for_sequences(dec.config, 1, 32, backend="torch")
        got = []
        for cached, new in ((0, 9), (9, 1)):
            with forward_context(AttentionMetadata.for_batch(cache, [("a", cached, new)])):
                got.append(dec.logits(dec(ids[cached:cached + new], torch.arange(cached, cached + new))))
        want = model(ids[None]).logits[0]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)
