"""ALiBi: per-head slopes times the key's distance behind the query, added to the scaled attention scores.

The op's ``alibi_slopes`` on the torch backend is checked against a float64 reference written here (dense keys per
sequence, an explicit softmax of the scores plus the bias) over prefill, a chunk over pages, mixed and decode steps
in a padded bucket, with and without a sliding window; the FlashInfer backend refuses it by name. BLOOM and MPT,
whose attention is written out in their modeling code, run through it while wrapped with transformers' exact
greedy tokens and are their own again after; a sabotaged slope is refused by the numeric self-check; Falcon's ALiBi
(built into the attention mask) is refused naming it.
"""

from __future__ import annotations

import pytest
import torch

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.attention.backends.flashinfer import FlashInferBackend
from piecegraph.context import forward_context
from piecegraph.models import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = TINY.replace(num_heads=6, num_kv_heads=2, head_dim=8, attention_backend="torch")
H, HKV, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
STEPS = [  # (seq, cached, new): prompts; decode rows with a chunk over pages and a new prompt; pure decode
    [("a", 0, 9), ("b", 0, 3)],
    [("a", 9, 1), ("b", 3, 4), ("c", 0, 6)],
    [("a", 10, 1), ("b", 7, 1), ("c", 6, 1)],
]


def reference_step(keys: dict, values: dict, seqs, q, k, v, slopes, window, absolute=False) -> torch.Tensor:
    """Float64 attention with ALiBi, token by token: softmax of ``scores + slope_h * (j - i)`` (``absolute``:
    ``slope_h * j``, BLOOM's form). ``window`` > 0: keys at positions <= the query's minus it are hidden."""
    out, row, group = [], 0, H // HKV
    for seq, cached, new in seqs:
        keys[seq] = torch.cat([keys.get(seq, k.new_zeros(0, HKV, D)), k[row:row + new]])
        values[seq] = torch.cat([values.get(seq, v.new_zeros(0, HKV, D)), v[row:row + new]])
        for i in range(new):
            pos = cached + i
            first = max(0, pos - window + 1) if window > 0 else 0
            distance = torch.arange(first, pos + 1, dtype=torch.float64) - (0 if absolute else pos)
            for h in range(H):
                scores = keys[seq][first:pos + 1, h // group] @ q[row + i, h] / D ** 0.5
                weights = torch.softmax(scores + slopes[h] * distance, dim=0)
                out.append(weights @ values[seq][first:pos + 1, h // group])
        row += new
    return torch.stack(out).view(-1, H, D)


def run_op(cache, seqs, q, k, v, slopes, window, pad) -> torch.Tensor:
    meta = AttentionMetadata.for_batch(cache, seqs)
    n = meta.num_tokens
    padded = [torch.cat([x.reshape(n, -1).float(), torch.randn(pad, x[0].numel())]) for x in (q, k, v)]
    out = torch.full((n + pad, H * D), float("nan"))
    with forward_context(meta):
        torch.ops.piecegraph_models.attention(*padded, out, 0, 0.0, window, 0.0, None, slopes)
    assert (out[n:] == 0).all()  # pad rows come out zero
    return out[:n].view(n, H, D)


@pytest.mark.parametrize("window", [-1, 4])
def test_torch_backend_with_alibi_matches_float64_reference(window):
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(CFG, num_pages=40, page_size=4, max_seq_len=32)
    slopes = 2.0 ** -torch.arange(1.0, H + 1)  # BLOOM's slopes for 8 heads, first 6: 1/2 .. 1/64
    keys, values, keys_abs, values_abs, keys_plain, values_plain = {}, {}, {}, {}, {}, {}
    for seqs in STEPS:
        n = sum(new for _, _, new in seqs)
        q, k, v = (torch.randn(n, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        got = run_op(cache, seqs, q, k, v, slopes, window, pad=3)
        want = reference_step(keys, values, seqs, q, k, v, slopes.double(), window)
        absolute = reference_step(keys_abs, values_abs, seqs, q, k, v, slopes.double(), window, absolute=True)
        plain = reference_step(keys_plain, values_plain, seqs, q, k, v, torch.zeros(H), window)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
        assert ((absolute - want).norm() / want.norm()).item() < 1e-12  # BLOOM's slope * j: the same softmax
        assert ((plain - want).norm() / want.norm()).item() > 1e-2  # the bias matters: the test can fail


def test_alibi_slopes_of_another_head_count_are_refused():
    cache = KVCache(CFG, num_pages=8, page_size=4, max_seq_len=16)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 2)])
    q, k, v, out = torch.randn(2, H * D), torch.randn(2, HKV * D), torch.randn(2, HKV * D), torch.empty(2, H * D)
    with forward_context(meta), pytest.raises(ValueError, match="alibi_slopes: 5 values for 6 query heads"):
        torch.ops.piecegraph_models.attention(q, k, v, out, 0, 0.0, -1, 0.0, None, torch.ones(5))


def test_flashinfer_backend_refuses_alibi_naming_the_torch_backend():
    backend = object.__new__(FlashInferBackend)  # refused before anything FlashInfer (or CUDA) is touched
    cache = KVCache(CFG, num_pages=8, page_size=4, max_seq_len=16)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 2)])
    q, k, v, out = torch.randn(2, H, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D), torch.empty(2, H, D)
    with pytest.raises(ValueError, match=r"layer 0 takes alibi_slopes.*attention_backend='torch'"):
        backend.forward(q, k, v, out, 0, meta, alibi_slopes=torch.ones(H))


# -- Hugging Face models ------------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64, 30]]
NEW = 8
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
    transformers = pytest.importorskip("transformers")
    default = transformers.CONFIG_MAPPING[model_type]()
    sizes = {k: v for k, v in {**SIZES, **fields}.items() if hasattr(default, k)}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **sizes),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() >= 2:
                gain = 1.0 if "embed" in name or "wte" in name else GAIN.get(model_type, 1.0)
                param.normal_(0, gain * param.shape[-1] ** -0.5)
    return hf


def hf_greedy(hf):
    from hf_reference import transformers_greedy

    return [transformers_greedy(hf, prompt, NEW) for prompt in PROMPTS]


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
