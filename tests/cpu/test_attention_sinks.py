"""Learned attention sinks (gpt-oss's ``s_aux``): one logit per query head that joins the softmax denominator only.

The torch backend is checked against a float64 reference (``hf_reference.dense_attention``: dense keys per
sequence, an explicit softmax over the scores and the head's sink, the sink's column dropped), over prefill, mixed
and decode steps in a padded bucket, with and without a sliding window. Hugging Face models whose attention takes
sinks run with transformers' exact greedy tokens; the FlashInfer backend refuses sinks naming the torch backend as
the fix.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import ATTENTION_CFG as CFG
from hf_reference import STEPS, dense_attention, run_attention_op, two_token_prompt
from hf_tiny import random_causal_lm, skip_unless_known

from piecegraph.attention import KVCache
from piecegraph.attention.backends.flashinfer import FlashInferBackend
from piecegraph.context import forward_context

pytestmark = pytest.mark.usefixtures("one_thread")

H, HKV, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim


def with_sinks(sinks):
    """Attention weights with sinks: softmax over ``[scores, sink_h]``, the sink's column dropped (transformers'
    gpt-oss eager attention)."""
    return lambda scores, h, first, pos: torch.softmax(torch.cat([scores, sinks[h:h + 1]]), dim=0)[:-1]


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
        got = run_attention_op(cache, seqs, q, k, v, window, sinks, pad=3)
        want = dense_attention(keys, values, seqs, q, k, v, with_sinks(sinks.double()), window)
        plain = dense_attention(keys_plain, values_plain, seqs, q, k, v, with_sinks(torch.full((H,), -torch.inf)),
                                window)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
        assert ((plain - want).norm() / want.norm()).item() > 1e-2  # the sinks matter: the test can fail


def test_sinks_of_another_head_count_are_refused():
    meta, q, k, v, out = two_token_prompt(flat=True)
    with forward_context(meta), pytest.raises(ValueError, match="5 values for 6 query heads"):
        torch.ops.piecegraph_models.attention(q, k, v, out, 0, 0.0, -1, 0.0, torch.zeros(5))


def test_flashinfer_backend_refuses_sinks_naming_the_torch_backend():
    backend = object.__new__(FlashInferBackend)  # refused before anything FlashInfer (or CUDA) is touched
    meta, q, k, v, out = two_token_prompt(flat=False)
    with pytest.raises(ValueError, match=r"layer 0 takes attention sinks.*attention_backend='torch'"):
        backend.forward(q, k, v, out, 0, meta, sinks=torch.zeros(H))


# Hugging Face types whose attention passes per-head sinks (``s_aux``), each with a sliding window shorter than
# the prompts where its config has one (gpt-oss alternates sliding and full layers).
SINK_TYPES = {"gpt_oss": dict(sliding_window=4), "flint": {}, "granite_swa": dict(sliding_window=4),
              "granitemoe_swa": dict(sliding_window=4)}
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1]]


def tiny_sinks_model(model_type):
    pytest.importorskip("transformers")
    skip_unless_known(model_type)
    from test_hf_support import tiny_config

    config = tiny_config(model_type)
    for key, value in SINK_TYPES[model_type].items():
        setattr(config, key, value)
    return random_causal_lm(config, init_with_sinks)


def init_with_sinks(name, param):
    """Projections ~N(0, 1/fan_in), embeddings ~N(0, 0.01), sinks ~N(0, 4); the rest as built."""
    if "proj" in name and param.dim() >= 2:
        param.normal_(0, param.shape[-1] ** -0.5)
    elif "embed" in name:
        param.normal_(0, 0.1)
    elif name.endswith("sinks"):
        param.normal_(0, 2.0)  # some types initialise sinks to zero: make them matter


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
