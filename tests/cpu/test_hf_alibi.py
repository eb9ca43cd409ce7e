"""ALiBi: per-head slopes times the key's distance behind the query, added to the scaled attention scores.

The op's ``alibi_slopes`` on the torch backend is checked against a float64 reference
(``hf_reference.dense_attention``: dense keys per sequence, an explicit softmax of the scores plus the bias) over
prefill, a chunk over pages, mixed and decode steps in a padded bucket, with and without a sliding window; the
FlashInfer backend refuses it by name. BLOOM and MPT, whose attention is written out in their modeling code, run
through it while wrapped with transformers' exact greedy tokens and are their own again after; a sabotaged slope is
refused by the numeric self-check; Falcon's ALiBi (built into the attention mask) is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import ATTENTION_CFG as CFG
from hf_reference import STEPS, dense_attention, run_attention_op, two_token_prompt
from hf_tiny import NEW, PROMPTS, hf_greedy, random_causal_lm, sized_config

from piecegraph.attention import KVCache
from piecegraph.attention.backends.flashinfer import FlashInferBackend
from piecegraph.context import forward_context

pytestmark = pytest.mark.usefixtures("one_thread")

H, HKV, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim


def with_alibi(slopes, absolute=False):
    """Attention weights with ALiBi: softmax of ``scores + slope_h * (j - i)`` (``absolute``: ``slope_h * j``,
    BLOOM's form)."""
    def weights(scores, h, first, pos):
        distance = torch.arange(first, pos + 1, dtype=torch.float64) - (0 if absolute else pos)
        return torch.softmax(scores + slopes[h] * distance, dim=0)

    return weights


@pytest.mark.parametrize("window", [-1, 4])
def test_torch_backend_with_alibi_matches_float64_reference(window):
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(CFG, num_pages=40, page_size=4, max_seq_len=32)
    slopes = 2.0 ** -torch.arange(1.0, H + 1)  # BLOOM's slopes for 8 heads, first 6: 1/2 .. 1/64
    keys, values, keys_abs, values_abs, keys_plain, values_plain = {}, {}, {}, {}, {}, {}
    for seqs in STEPS:
        n = sum(new for _, _, new in seqs)
        q, k, v = (torch.randn(n, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        got = run_attention_op(cache, seqs, q, k, v, window, None, slopes, pad=3)
        want = dense_attention(keys, values, seqs, q, k, v, with_alibi(slopes.double()), window)
        absolute = dense_attention(keys_abs, values_abs, seqs, q, k, v, with_alibi(slopes.double(), absolute=True),
                                   window)
        plain = dense_attention(keys_plain, values_plain, seqs, q, k, v, with_alibi(torch.zeros(H)), window)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
        assert ((absolute - want).norm() / want.norm()).item() < 1e-12  # BLOOM's slope * j: the same softmax
        assert ((plain - want).norm() / want.norm()).item() > 1e-2  # the bias matters: the test can fail


def test_alibi_slopes_of_another_head_count_are_refused():
    meta, q, k, v, out = two_token_prompt(flat=True)
    with forward_context(meta), pytest.raises(ValueError, match="alibi_slopes: 5 values for 6 query heads"):
        torch.ops.piecegraph_models.attention(q, k, v, out, 0, 0.0, -1, 0.0, None, torch.ones(5))


def test_flashinfer_backend_refuses_alibi_naming_the_torch_backend():
    backend = object.__new__(FlashInferBackend)  # refused before anything FlashInfer (or CUDA) is touched
    meta, q, k, v, out = two_token_prompt(flat=False)
    with pytest.raises(ValueError, match=r"layer 0 takes alibi_slopes.*attention_backend='torch'"):
        backend.forward(q, k, v, out, 0, meta, alibi_slopes=torch.ones(H))


# -- Hugging Face models ------------------------------------------------------------------------------------------

SIZES = dict(vocab_size=128, hidden_size=64, n_embed=64, d_model=64, n_layer=2, n_layers=2, num_hidden_layers=2,
             n_head=4, n_heads=4, num_attention_heads=4, max_seq_len=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# what wrapping sets on the attention modules and base models, removed after
ADAPTED = {"BloomAttention": {"config", "is_causal", "scaling", "forward"}, "BloomModel": {"build_alibi_tensor"},
           "MptAttention": {"config", "is_causal", "scaling", "forward"}, "MptModel": {"forward"}}
GAIN = {"bloom": 4.0, "mpt": 2.0}  # weights large enough that greedy tokens vary (tied embeddings repeat otherwise)


def model(model_type, **fields):
    """A float32 tiny random ``model_type`` causal LM, embeddings ~N(0, 1/dim) and other matrices
    ~N(0, GAIN/fan_in), so that every layer matters and greedy tokens vary with the context (fields its config
    does not have are dropped)."""
    pytest.importorskip("transformers")

    def init(name, param):
        if param.dim() >= 2:
            gain = 1.0 if "embed" in name or "wte" in name else GAIN.get(model_type, 1.0)
            param.normal_(0, gain * param.shape[-1] ** -0.5)

    return random_causal_lm(sized_config(model_type, **{**SIZES, **fields}), init)


@pytest.fixture(scope="module", params=["bloom", "mpt"])
def alibi_model(request):
    hf = model(request.param)
    return hf, hf_greedy(hf)


def test_alibi_models_give_transformers_greedy_tokens_and_are_their_own_after(alibi_model):
    import piecegraph.hf as pghf

    hf, want = alibi_model
    pghf.check_supported(hf.config)
    assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == want
    adapted = [m for m in hf.modules() if type(m).__name__ in ADAPTED]
    assert len(adapted) == 3  # the base model and one attention per layer
    assert all(not ADAPTED[type(m).__name__] & m.__dict__.keys() for m in adapted)  # their own forward again
    assert hf_greedy(hf) == want


def test_alibi_models_run_exactly_traced(alibi_model):
    """Dynamo traces the adapted attention (and MPT's base model forward) into pieces; decode steps replay."""
    import piecegraph.hf as pghf

    hf, want = alibi_model
    session = pghf.Session(hf, max_seqs=len(PROMPTS), max_len=32, prefill_tokens=32, compiler="eager",
                           backend="torch", mode="none")
    assert session.generate(PROMPTS, NEW) == want
    session.close()


def test_flashinfer_is_refused_for_alibi_models_naming_the_model(alibi_model):
    import piecegraph.hf as pghf

    hf, _ = alibi_model
    with pghf.HFDecoder(hf) as decoder:
        decoder.check_backend("torch")
        with pytest.raises(ValueError, match=f"'{hf.config.model_type}'.*alibi_slopes.*attention_backend='torch'"):
            decoder.check_backend("flashinfer")


def test_alibi_slopes_of_the_wrong_sign_are_refused_by_the_self_check(alibi_model, monkeypatch):
    import piecegraph.hf as pghf
    import piecegraph.hf.adapters_alibi as adapters_alibi

    real = adapters_alibi._piecegraph_attention
    monkeypatch.setattr(adapters_alibi, "_piecegraph_attention",
                        lambda module, qkv, mask, scaling, slopes: real(module, qkv, mask, scaling, -slopes))
    hf = model(alibi_model[0].config.model_type)  # a new instance: a model's verdict is reached once
    with pytest.raises(pghf.UnsupportedModelError, match="decoder layer 0"):
        pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert not hasattr(hf, "_piecegraph_hf"), "a refused model stays wrapped"


def test_falcon_with_alibi_in_its_mask_is_refused_naming_alibi():
    import piecegraph.hf as pghf

    hf = model("falcon", alibi=True, num_kv_heads=4, new_decoder_architecture=False, multi_query=False)
    with pytest.raises(pghf.UnsupportedModelError, match="'falcon'.*ALiBi"):
        pghf.check_supported(hf.config)
