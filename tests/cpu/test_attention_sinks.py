"""Learned attention sinks (gpt-oss's ``s_aux``): one logit per query head that joins the softmax denominator only.

The torch backend is checked against a float64 reference written here (dense keys per sequence, an explicit
softmax over the scores and the head's sink, the sink's column dropped), over prefill, mixed and decode steps in a
padded bucket, with and without a sliding window. Hugging Face models whose attention takes sinks run with
transformers' exact greedy tokens; the FlashInfer backend refuses sinks naming the torch backend as the fix.
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
STEPS = [  # (seq, cached, new): prompts; decode rows with a new prompt and a chunk (two groups); pure decode
    [("a", 0, 9), ("b", 0, 3)],
    [("a", 9, 1), ("b", 3, 4), ("c", 0, 6)],
    [("a", 10, 1), ("b", 7, 1), ("c", 6, 1)],
]


def reference_step(keys: dict, values: dict, seqs, q, k, v, sinks, window) -> torch.Tensor:
    """Float64 attention with sinks, token by token: softmax over ``[scores, sink_h]``, the sink's column dropped
    (transformers' gpt-oss eager attention). ``window`` > 0: keys at positions <= the query's minus it are hidden."""
    out, row, group = [], 0, H // HKV
    for seq, cached, new in seqs:
        keys[seq] = torch.cat([keys.get(seq, k.new_zeros(0, HKV, D)), k[row:row + new]])
        values[seq] = torch.cat([values.get(seq, v.new_zeros(0, HKV, D)), v[row:row + new]])
        for i in range(new):
            pos = cached + i
            first = max(0, pos - window + 1) if window > 0 else 0
            for h in range(H):
                scores = keys[seq][first:pos + 1, h // group] @ q[row + i, h] / D ** 0.5
                weights = torch.softmax(torch.cat([scores, sinks[h:h + 1]]), dim=0)[:-1]
                out.append(weights @ values[seq][first:pos + 1, h // group])
        row += new
    return torch.stack(out).view(-1, H, D)


def run_op(cache, seqs, q, k, v, sinks, window, pad) -> torch.Tensor:
    meta = AttentionMetadata.for_batch(cache, seqs)
    n = meta.num_tokens
    padded = [torch.cat([x.reshape(n, -1).float(), torch.randn(pad, x[0].numel())]) for x in (q, k, v)]
    out = torch.full((n + pad, H * D), float("nan"))
    with forward_context(meta):
        torch.ops.piecegraph_models.attention(*padded, out, 0, 0.0, window, 0.0, sinks)
    assert (out[n:] == 0).all()  # pad rows come out zero
    return out[:n].view(n, H, D)


@pytest.mark.parametrize("window", [-1, 4])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_with_sinks_matches_float64_reference(window, sink_dtype):
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(CFG, num_pages=40, page_size=4, max_seq_len=32)
    sinks = (torch.randn(H, generator=gen) * 2).to(sink_dtype)  # large enough to move real probability mass
    keys, values, keys_plain, values_plain = {}, {}, {}, {}
    for seqs in STEPS:
        n = sum(new for _, _, new in seqs)
        q, k, v = (torch.randn(n, h, D, generator=gen, dtype=torch.float64) * 2 for h in (H, HKV, HKV))
        got = run_op(cache, seqs, q, k, v, sinks, window, pad=3)
        want = reference_step(keys, values, seqs, q, k, v, sinks.double(), window)
        plain = reference_step(keys_plain, values_plain, seqs, q, k, v, torch.full((H,), -torch.inf), window)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
        assert ((plain - want).norm() / want.norm()).item() > 1e-2  # the sinks matter: the test can fail


def test_sinks_of_another_head_count_are_refused():
    cache = KVCache(CFG, num_pages=8, page_size=4, max_seq_len=16)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 2)])
    q, k, v, out = torch.randn(2, H * D), torch.randn(2, HKV * D), torch.randn(2, HKV * D), torch.empty(2, H * D)
    with forward_context(meta), pytest.raises(ValueError, match="5 values for 6 query heads"):
        torch.ops.piecegraph_models.attention(q, k, v, out, 0, 0.0, -1, 0.0, torch.zeros(5))


def test_flashinfer_backend_refuses_sinks_naming_the_torch_backend():
    backend = object.__new__(FlashInferBackend)  # refused before anything FlashInfer (or CUDA) is touched
    cache = KVCache(CFG, num_pages=8, page_size=4, max_seq_len=16)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 2)])
    q, k, v, out = torch.randn(2, H, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D), torch.empty(2, H, D)
    with pytest.raises(ValueError, match=r"layer 0 takes attention sinks.*attention_backend='torch'"):
        backend.forward(q, k, v, out, 0, meta, sinks=torch.zeros(H))


# Hugging Face types whose attention passes per-head sinks (``s_aux``), each with a sliding window shorter than
# the prompts where its config has one (gpt-oss alternates sliding and full layers).
SINK_TYPES = {"gpt_oss": dict(sliding_window=4), "flint": {}, "granite_swa": dict(sliding_window=4),
              "granitemoe_swa": dict(sliding_window=4)}
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1]]


def tiny_sinks_model(model_type):
    transformers = pytest.importorskip("transformers")
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    from test_hf_support import tiny_config

    config = tiny_config(model_type)
    for key, value in SINK_TYPES[model_type].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif "embed" in name:
                param.normal_(0, 0.1)
            elif name.endswith("sinks"):
                param.normal_(0, 2.0)  # some types initialise sinks to zero: make them matter
    return model


@pytest.mark.parametrize("model_type", list(SINK_TYPES))
def test_hf_models_with_sinks_give_transformers_greedy_tokens(model_type):
    from test_hf_support import NEW, hf_greedy  # transformers' greedy tokens (NEW of them), cut after an EOS

    import piecegraph.hf as pghf

    model = tiny_sinks_model(model_type)
    assert any(name.endswith("sinks") for name, _ in model.named_parameters())
    expected = [hf_greedy(model, p) for p in PROMPTS]
    mode = {"mode": "graphs", "emulate_graphs": True} if model_type == "gpt_oss" else {"mode": "none"}
    session = pghf.Session(model, max_seqs=len(PROMPTS), max_len=32, prefill_tokens=32, compiler="eager",
                           backend="torch", **mode)
    assert session.generate(PROMPTS, NEW) == expected
    if model_type == "gpt_oss":  # decode ran as captured full graphs (emulated): the sinks are static there
        assert session.decode.stats()["replays"] > 0
