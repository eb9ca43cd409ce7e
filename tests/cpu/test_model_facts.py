"""A model describes itself once (``piecegraph.models.ModelFacts``): each fact checked against a count made
without it. Weights are counted by hand from the config (every matrix, bias, norm and scale named below); the KV
bytes per token are read off a built :class:`~piecegraph.attention.KVCache`'s tensors."""

from __future__ import annotations

import pytest
import torch

from piecegraph.attention import KVCache
from piecegraph.models import TINY, TINY_MOE, Decoder, MoEDecoder, model_facts, quantize_fp8


def _cache_bytes_per_token(facts, dtype: torch.dtype) -> int:
    cache = KVCache.for_sequences(facts.config, 2, 32, page_size=4, dtype=dtype, backend="torch")
    held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    return held // (cache.num_pages * cache.page_size)


def _attention(c, weight: int, per_matrix: int = 0) -> int:
    """Bytes of one layer's q/k/v/o: ``weight`` bytes a matrix element, ``per_matrix`` more bytes a matrix (an
    FP8 one's scales), float32 biases."""
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    biases = 4 * (q + 2 * kv) if c.qkv_bias else 0
    return weight * (h * q + 2 * h * kv + q * h) + 4 * per_matrix + biases


def _expected(c, dense_layer: int, experts: int, item: int = 4) -> dict[str, int]:
    """``weight_bytes`` and ``weight_bytes_read(1)`` from per-layer byte counts: ``dense_layer`` (everything one
    token reads but its experts) and ``experts`` (all of a layer's experts); embeddings, lm_head, final norm and
    the rotary ``inv_freq`` buffer (float32, ``head_dim / 2``) added here."""
    embed = c.vocab_size * c.hidden_size * item
    tail = c.hidden_size * item + 4 * (c.head_dim // 2)  # final norm, inv_freq
    total = embed * (1 if c.tie_embeddings else 2) + c.num_layers * (dense_layer + experts) + tail
    top_k, num_experts = getattr(c, "top_k", 1), getattr(c, "num_experts", 1)
    read_one = c.num_layers * (dense_layer + experts * top_k // num_experts) + tail + c.hidden_size * item
    return {"weight_bytes": total, "read_one": read_one}


def test_a_dense_decoder_describes_itself():
    c = TINY
    facts = Decoder.random(c).facts()
    layer = _attention(c, 4) + 4 * 3 * c.hidden_size * c.intermediate_size + 4 * 2 * c.hidden_size
    want = _expected(c, layer, 0)
    assert (facts.device, facts.dtype, facts.quant) == (torch.device("cpu"), torch.float32, None)
    assert (facts.vocab_size, facts.num_layers, facts.num_experts) == (c.vocab_size, c.num_layers, 0)
    assert facts.weight_bytes == want["weight_bytes"]
    assert facts.weight_bytes_read(1) == want["read_one"]
    embed_row = 4 * c.hidden_size
    assert facts.weight_bytes_read(9) - facts.weight_bytes_read(1) == 8 * embed_row  # only the rows gathered
    for dtype in (torch.float32, torch.bfloat16):
        assert facts.kv_bytes_per_token(dtype) == _cache_bytes_per_token(facts, dtype)


def _moe_layer(c, weight: int, scale: int = 0) -> tuple[int, int]:
    """(dense part, experts) of one MoE layer: matrices of ``weight`` bytes an element, ``scale`` bytes of
    per-tensor scales (and FP8Linear's unit) a quantized matrix; router, gate and norms stay float32."""
    h, e, w, s = c.hidden_size, c.num_experts, c.expert_width, c.shared_expert_width
    dense = _attention(c, weight, scale) + 4 * e * h + 4 * 2 * h  # + router + norms
    dense += weight * 3 * h * s + scale * 3 + 4 * h  # shared expert + its float32 gate
    experts = weight * e * 3 * h * w + (2 * 4 * e if scale else 0)  # FP8: a float32 scale per expert and matrix
    return dense, experts


def test_a_mixture_of_experts_describes_itself_and_its_routing_reach():
    c = TINY_MOE
    facts = MoEDecoder.random(c).facts()
    dense, experts = _moe_layer(c, 4)
    want = _expected(c, dense, experts)
    assert (facts.num_experts, facts.top_k, facts.quant) == (c.num_experts, c.top_k, None)
    assert facts.weight_bytes == want["weight_bytes"] == 4 * c.parameter_counts()[0] + 4 * (c.head_dim // 2)
    assert facts.weight_bytes_read(1) == want["read_one"]
    every = c.num_experts // c.top_k  # tokens enough to reach every expert: no more expert bytes after
    assert facts.weight_bytes_read(every + 5) - facts.weight_bytes_read(every) == 5 * 4 * c.hidden_size
    assert facts.kv_bytes_per_token() == _cache_bytes_per_token(facts, torch.float32)


def test_an_fp8_mixture_of_experts_counts_its_e4m3_buffers_and_scales():
    c = TINY_MOE
    model = quantize_fp8(MoEDecoder.random(c), kernel="torch")
    facts = model.facts()
    dense, experts = _moe_layer(c, 1, scale=8)  # a 0-d float32 scale and a one-element unit per FP8Linear
    want = _expected(c, dense, experts)
    assert (facts.quant, facts.dtype) == ("fp8", torch.float32)  # embeddings, norms and router stay float32
    assert facts.weight_bytes == want["weight_bytes"]
    assert facts.weight_bytes_read(1) == want["read_one"]
    assert facts.kv_bytes_per_token() == _cache_bytes_per_token(facts, torch.float32)


def test_any_module_falls_back_to_every_parameter():
    plain = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2, bias=False))
    facts = model_facts(plain)
    assert facts.weight_bytes == facts.weight_bytes_read(1) == facts.weight_bytes_read(100) == 4 * (8 * 4 + 4 + 8)
    assert facts.config is None
    with pytest.raises(ValueError, match="no ModelConfig"):
        facts.kv_bytes_per_token()
    assert model_facts(Decoder.random(TINY)) == Decoder.random(TINY).facts()  # a model's own description first


def test_a_hugging_face_mixture_of_experts_describes_itself():
    transformers = pytest.importorskip("transformers")
    from piecegraph.hf import HFDecoder

    v, h, i, layers, heads, kv_heads, e, k = 128, 64, 32, 2, 4, 2, 4, 2
    config = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=e, num_experts_per_tok=k,
        max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                       experts_implementation="batched_mm").eval()
    buffers = sum(b.numel() * b.element_size() for b in hf.buffers() if b.is_floating_point())  # rotary tables
    hd = h // heads
    dense = 4 * (2 * h * h + 2 * h * kv_heads * hd + e * h + 2 * h)  # q, o, k, v, router, norms
    experts = 4 * e * 3 * h * i
    with HFDecoder(hf) as model:
        facts = model.facts()
    assert (facts.vocab_size, facts.num_layers, facts.num_experts, facts.top_k) == (v, layers, e, k)
    assert facts.weight_bytes == 4 * 2 * v * h + layers * (dense + experts) + 4 * h + buffers
    assert facts.weight_bytes_read(1) == layers * (dense + experts * k // e) + 4 * h + buffers + 4 * h
    assert facts.kv_bytes_per_token() == _cache_bytes_per_token(facts, torch.float32) == 4 * 2 * layers * 2 * hd
