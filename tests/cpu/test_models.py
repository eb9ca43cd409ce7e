"""The reference decoder against an independent float64 implementation (no KV cache, whole sequences)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import (
    TINY,
    Decoder,
    ModelConfig,
    dummy_inputs,
    generate,
    load_hf,
    save_hf,
)

REL_TOL = 1e-5


# ---------------------------------------------------------------- independent float64 reference
def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, theta):
    """x [L, heads, D]; pairs are (i, i + D/2), as in Hugging Face's rotate_half."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _linear(sd, name, x):
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if name + ".bias" in sd else y


def ref_hidden(sd, cfg: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """Final-norm hidden states [L, hidden] of one whole sequence, full causal attention, float64."""
    n, heads, kvh, dim = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = torch.arange(n)
    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    causal = torch.ones(n, n).tril().bool()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], cfg.rms_eps)
        q = _rope(_linear(sd, p + "self_attn.q_proj", h).view(n, heads, dim), pos, cfg.rope_theta)
        k = _rope(_linear(sd, p + "self_attn.k_proj", h).view(n, kvh, dim), pos, cfg.rope_theta)
        v = _linear(sd, p + "self_attn.v_proj", h).view(n, kvh, dim)
        k, v = k.repeat_interleave(heads // kvh, dim=1), v.repeat_interleave(heads // kvh, dim=1)
        attn = torch.empty(n, heads, dim, dtype=torch.float64)
        for head in range(heads):
            scores = q[:, head] @ k[:, head].T / math.sqrt(dim)
            scores = scores.masked_fill(~causal, float("-inf"))
            attn[:, head] = torch.softmax(scores, dim=-1) @ v[:, head]
        x = x + _linear(sd, p + "self_attn.o_proj", attn.reshape(n, heads * dim))
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_eps)
        gate, up = _linear(sd, p + "mlp.gate_proj", h), _linear(sd, p + "mlp.up_proj", h)
        x = x + _linear(sd, p + "mlp.down_proj", gate / (1 + torch.exp(-gate)) * up)
    return _rms(x, sd["model.norm.weight"], cfg.rms_eps)


def ref_logits(sd, hidden):
    return hidden @ sd["lm_head.weight"].T


def _state(model):
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def _close(actual, expected, tol=REL_TOL):
    err = (actual.double() - expected).abs().max() / expected.abs().max()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def _cache(num_seqs, max_len, dtype=torch.float32, config=TINY):
    """A paged cache with small pages (4 tokens), so sequences span several pages."""
    return KVCache.for_sequences(config, num_seqs, max_len, page_size=4, dtype=dtype)


def _run(model, cache, seqs, ids, pad_to=None):
    """Run ``model`` on a mixed batch ``seqs`` = [(seq, num_cached, num_new)]; returns hidden rows of real tokens."""
    meta = AttentionMetadata.for_batch(cache, seqs)
    ids = torch.tensor(ids)
    pos = meta.positions
    if pad_to is not None:  # the caller pads: metadata covers only the real tokens
        ids = torch.cat([ids, torch.zeros(pad_to - len(ids), dtype=torch.int64)])
        pos = torch.cat([pos, torch.zeros(pad_to - len(pos), dtype=torch.int64)])
    with forward_context(meta):
        return model(ids, pos)


@pytest.fixture(scope="module")
def model64():
    return Decoder.random(TINY, seed=1, dtype=torch.float64)


# ---------------------------------------------------------------- correctness against the reference
@torch.inference_mode()
def test_prefill_decode_and_mixed_batches_match_reference(model64):
    sd, gen = _state(model64), torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for s, n in [(1, 5), (2, 3), (3, 7)]}
    cache = _cache(4, 32, torch.float64)

    hidden = _run(model64, cache, [(s, 0, len(t)) for s, t in seqs.items()], sum(seqs.values(), []))
    _close(hidden, torch.cat([ref_hidden(sd, TINY, t) for t in seqs.values()]))

    for _ in range(3):  # decode: one token per sequence
        new = {s: int(torch.randint(0, TINY.vocab_size, (1,), generator=gen)) for s in seqs}
        meta = AttentionMetadata.for_decode(cache, [(s, len(t)) for s, t in seqs.items()])
        for s in seqs:
            seqs[s].append(new[s])
        with forward_context(meta):
            hidden = model64(torch.tensor(list(new.values())), meta.positions)
        _close(hidden, torch.stack([ref_hidden(sd, TINY, t)[-1] for t in seqs.values()]))

    # Mixed: slot 1 continues with 4 tokens, 2 and 3 decode one, slot 4 starts a fresh 6-token prompt.
    adds = {1: [11, 12, 13, 14], 2: [15], 3: [16], 4: [17, 18, 19, 20, 21, 22]}
    batch = [(s, len(seqs.get(s, [])), len(a)) for s, a in adds.items()]
    for s, a in adds.items():
        seqs[s] = seqs.get(s, []) + a
    hidden = _run(model64, cache, batch, sum(adds.values(), []))
    _close(hidden, torch.cat([ref_hidden(sd, TINY, seqs[s])[-len(a):] for s, a in adds.items()]))


@torch.inference_mode()
def test_float32_model_matches_reference():
    model = Decoder.random(TINY, seed=2)
    sd, tokens = _state(model), [3, 1, 4, 1, 5, 9, 2, 6]
    hidden = _run(model, _cache(2, 16), [(2, 0, len(tokens))], tokens)
    _close(hidden, ref_hidden(sd, TINY, tokens), tol=1e-5)


@torch.inference_mode()
def test_logits_are_not_degenerate(model64):
    hidden = _run(model64, _cache(1, 16, torch.float64), [(1, 0, 6)], [1, 2, 3, 4, 5, 6])
    logits = model64.logits(hidden)
    assert logits.shape == (6, TINY.vocab_size) and torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1e-2
    assert len(set(logits.argmax(-1).tolist())) > 1


# ---------------------------------------------------------------- padding
def _filled_cache(model, tokens):
    cache = _cache(3, 16, torch.float64)
    _run(model, cache, [(s + 1, 0, len(t)) for s, t in enumerate(tokens)], sum(tokens, []))
    return cache


@torch.inference_mode()
def test_padded_batches_keep_real_rows(model64):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    plain, padded = _filled_cache(model64, prompts), _filled_cache(model64, prompts)
    # Varlen path, model called with more tokens than the metadata covers.
    batch = [(1, 3, 2), (3, 4, 1)]
    want = _run(model64, plain, batch, [1, 2, 3])
    got = _run(model64, padded, batch, [1, 2, 3], pad_to=6)
    # Not bitwise: a GEMM with more rows may block differently (seen: 1e-15 apart in float64).
    _close(got[:3], want, tol=1e-12)
    # Decode path, padded the way full-graph mode pads metadata: every token-aligned field zero-filled.
    ids = torch.tensor([4, 4, 0, 0])
    meta = AttentionMetadata.for_decode(plain, [(2, 2), (1, 5)])
    with forward_context(meta):
        want = model64(ids[:2], meta.positions)
    meta = AttentionMetadata.for_decode(padded, [(2, 2), (1, 5)])
    meta = _zero_padded(meta, 4)
    with forward_context(meta):
        got = model64(ids, meta.positions)
    _close(got[:2], want, tol=1e-12)
    assert torch.isfinite(got).all()
    for layer in range(TINY.num_layers):  # real pages of the cache agree; only the scratch page differs
        _close(padded.k[layer][1:], plain.k[layer][1:].double(), tol=1e-12)


def _zero_padded(meta, size):
    """``meta`` with every tensor field whose dim 0 is the token count zero-padded to ``size`` rows."""
    n, changes = meta.num_tokens, {}
    for name in ("positions", "slot_mapping", "page_table", "kv_lens", "mask"):
        t = getattr(meta, name)
        changes[name] = torch.cat([t, t.new_zeros((size - n, *t.shape[1:]))])
    return meta.replace(**changes)


@torch.inference_mode()
def test_attention_op_zeroes_pad_rows():
    cache = _cache(2, 8)
    cache.reserve([(2, 4)])
    q_size, kv_size = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    q, k, v = torch.randn(5, q_size), torch.randn(5, kv_size), torch.randn(5, kv_size)
    for meta in (AttentionMetadata.for_decode(cache, [(1, 0), (2, 3)]),
                 AttentionMetadata.for_batch(cache, [(1, 0, 2), (2, 4, 1)])):
        out = torch.full((5, q_size), float("nan"))
        with forward_context(meta):
            torch.ops.piecegraph_models.attention(q, k, v, out, 0)
        n = meta.num_tokens
        assert torch.isfinite(out[:n]).all() and (out[n:] == 0).all()


@torch.inference_mode()
def test_dummy_inputs_touch_only_the_scratch_page(model64):
    cache = _filled_cache(model64, [[1, 2], [3]])
    before = [t.clone() for t in cache.k]
    (ids, pos), meta = dummy_inputs(model64, cache, 4)
    with forward_context(meta):
        hidden = model64(ids, pos)
    assert hidden.shape == (4, TINY.hidden_size) and torch.isfinite(hidden).all()
    assert all(torch.equal(a[1:], b[1:]) for a, b in zip(cache.k, before))


# ---------------------------------------------------------------- weights, config, generation
def test_tied_and_untied_lm_head():
    tied = Decoder.random(TINY)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = Decoder.random(TINY.replace(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    names = dict(untied.named_parameters())
    assert "model.layers.1.self_attn.q_proj.bias" in names and "lm_head.weight" in names
    assert untied.model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize("config", [TINY, TINY.replace(tie_embeddings=False, qkv_bias=False)],
                         ids=["qwen2-tied", "llama-untied"])
@torch.inference_mode()
def test_save_load_round_trip(tmp_path, config):
    model = Decoder.random(config, seed=3)
    save_hf(model, tmp_path)
    assert ("lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))) != config.tie_embeddings
    loaded = load_hf(tmp_path)
    assert loaded.config == config
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == config.tie_embeddings
    tokens = [9, 8, 7, 6]
    a = _run(model, _cache(1, 8, config=config), [(1, 0, 4)], tokens)
    b = _run(loaded, _cache(1, 8, config=config), [(1, 0, 4)], tokens)
    assert torch.equal(a, b)


@torch.inference_mode()
def test_load_sharded_and_clear_errors(tmp_path):
    model = Decoder.random(TINY, seed=4)
    save_hf(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(load_hf(tmp_path).model.norm.weight, model.model.norm.weight)

    with pytest.raises(FileNotFoundError, match="nowhere.*config.json"):
        load_hf(tmp_path / "nowhere")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.9.extra"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \[model.layers.1.mlp.up_proj.weight\].*layers.9.extra"):
        load_hf(tmp_path)


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("head_dim", 15), ("rms_eps", -1.0),
                                         ("vocab_size", 2.5), ("num_heads", 5), ("qkv_bias", 1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        TINY.replace(**{field: value})


def test_config_from_hf():
    qwen = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    from piecegraph.models import QWEN2_5_0_5B
    assert ModelConfig.from_hf(qwen) == QWEN2_5_0_5B
    llama = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    cfg = ModelConfig.from_hf(llama)
    assert (cfg.head_dim, cfg.qkv_bias, cfg.tie_embeddings) == (8, False, False)
    assert ModelConfig.from_hf({**llama, "attention_bias": True, "head_dim": 16}).qkv_bias
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in llama.items() if k != "hidden_size"})


@torch.inference_mode()
def test_generate_matches_reference_greedy(model64):
    sd, prompts = _state(model64), [[1, 2, 3, 4], [200, 100]]
    want = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(5):
            tokens.append(int(ref_logits(sd, ref_hidden(sd, TINY, tokens)[-1]).argmax()))
        want.append(tokens[len(prompt):])
    assert generate(model64, prompts, 5) == want


# ---------------------------------------------------------------- tracing
@torch.inference_mode()
def test_compile_fullgraph_dynamic_tokens_equals_eager(model64):
    torch._dynamo.reset()
    compiled = torch.compile(model64, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):  # T is dynamic: one graph for every size
        _compare_compiled(model64, compiled)


def _compare_compiled(model64, compiled):
    for tokens in ([3, 4, 5, 6, 7], [8, 9, 10]):
        ids = torch.tensor(tokens)
        results = []
        for fn in (model64, compiled):
            cache = _cache(1, 8, torch.float64)
            meta = AttentionMetadata.for_batch(cache, [(1, 0, len(tokens))])
            pos = meta.positions.clone()
            if fn is compiled:
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)
            with forward_context(meta):
                results.append(fn(ids, pos))
        assert torch.equal(results[0], results[1])
