"""The reference MoE decoder: its sparse MLP against a plain float64 reference, pad rows, graphs, config."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import QWEN1_5_MOE_A2_7B, TINY_MOE, MoEConfig, MoEDecoder, dummy_inputs, generate
from piecegraph.models.moe import Experts, grouped_mm_runs

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [200, 13, 54, 2, 8, 31, 77]]
VARIANTS = {
    "softmax-shared": {},
    "softmax-norm-noshared": {"norm_topk_prob": True, "shared_expert_width": 0},
    "sigmoid-norm": {"routing": "sigmoid", "norm_topk_prob": True},
    "sigmoid-top1": {"routing": "sigmoid", "top_k": 1},
}


# ---------------------------------------------------------------- independent float64 reference
def _swiglu(gate_up, down, x):
    width = down.shape[-1]
    gu = gate_up @ x
    g, u = gu[:width], gu[width:]
    return down @ (g / (1 + torch.exp(-g)) * u)


def ref_moe(sd: dict, cfg: MoEConfig, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Outputs ``[T, H]`` and each row's chosen experts (best first), one token at a time, float64."""
    out, chosen = [], []
    for row in x.double():
        logits = sd["gate.weight"] @ row
        scores = torch.softmax(logits, -1) if cfg.routing == "softmax" else 1 / (1 + torch.exp(-logits))
        top = sorted(range(cfg.num_experts), key=lambda e: -float(scores[e]))[: cfg.top_k]
        weights = scores[top] / (scores[top].sum() if cfg.norm_topk_prob else 1)
        y = sum(w * _swiglu(sd["experts.gate_up_proj"][e], sd["experts.down_proj"][e], row)
                for w, e in zip(weights, top))
        if cfg.shared_expert_width:
            shared_gu = torch.cat([sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]])
            gate = 1 / (1 + torch.exp(-(sd["shared_expert_gate.weight"][0] @ row)))
            y = y + gate * _swiglu(shared_gu, sd["shared_expert.down_proj.weight"], row)
        out.append(y)
        chosen.append(top)
    return torch.stack(out), chosen


def _block(cfg, dtype, seed=0):
    model = MoEDecoder.random(cfg, seed=seed, dtype=dtype)
    return model, model.model.layers[0].mlp


def _rel(actual, expected):
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def _x(n, seed=1, scale=1.0):
    return scale * torch.randn(n, TINY_MOE.hidden_size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the sparse MLP
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)], ids=["f64", "f32"])
@torch.inference_mode()
def test_moe_block_matches_float64_reference(variant, dtype, tol):
    cfg = TINY_MOE.replace(**VARIANTS[variant])
    _, block = _block(cfg, dtype)
    assert not block.experts.use_grouped_mm  # the row-wise gather path: grouped_mm traces only in bf16
    x = _x(13).to(dtype)
    want, chosen = ref_moe({k: v.double() for k, v in block.state_dict().items()}, cfg, x)
    assert _rel(block(x), want) < tol
    assert block.route(x)[1].tolist() == chosen


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.bfloat16), reason="torch._grouped_mm does not run here")
@torch.inference_mode()
def test_bf16_grouped_mm_matches_reference_and_gather():
    _, block = _block(TINY_MOE, torch.bfloat16)
    assert block.experts.use_grouped_mm
    x = _x(21).bfloat16()
    want, chosen = ref_moe({k: v.double() for k, v in block.state_dict().items()}, TINY_MOE, x)
    grouped = block(x)
    # A bf16 router may swap two near-tied experts (seen: 1 row in 21): compare the rows routed alike.
    same = torch.tensor([a == b for a, b in zip(block.route(x)[1].tolist(), chosen)])
    assert same.sum() >= 18 and _rel(grouped[same], want[same]) < 2e-2
    block.experts.use_grouped_mm = False
    assert _rel(block(x), grouped.double()) < 1e-2  # the same experts per row through either path


def test_grouped_mm_forced_where_it_cannot_run_says_so():
    _, block = _block(TINY_MOE.replace(expert_impl="grouped_mm"), torch.float32)
    with pytest.raises(ValueError, match="expert_impl='grouped_mm'.*bf16 only"):
        block(_x(3))


# ---------------------------------------------------------------- pad rows
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["gather-f64", "grouped-bf16"])
@torch.inference_mode()
def test_pad_rows_change_no_real_row(dtype):
    _, block = _block(TINY_MOE, dtype, seed=4)
    real = _x(5).to(dtype)
    want, want_ids = block(real), block.route(real)[1]
    for pad in (torch.zeros(11, real.shape[1]), _x(11, seed=9, scale=50.0), _x(3, seed=8)):
        padded = torch.cat([real, pad.to(dtype)])
        assert torch.equal(block.route(padded)[1][:5], want_ids)
        assert _rel(block(padded)[:5], want.double()) < (1e-12 if dtype == torch.float64 else 1e-2)


# ---------------------------------------------------------------- graphs
def _cache(cfg, page_size=4):
    return KVCache.for_sequences(cfg, len(PROMPTS), max(map(len, PROMPTS)) + 6, page_size=page_size)


def test_graphs_generate_like_eager_and_see_no_token_mixing():
    """Piecewise prefill, full-graph decode (emulated on CPU), token for token; the gather path is row-wise."""
    model = MoEDecoder.random(TINY_MOE, seed=3)
    expected = generate(model, PROMPTS, max_new_tokens=6, cache=_cache(TINY_MOE))
    prefill = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(16,), emulate_graphs=True)
    decode = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(4,), emulate_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token-mixing op would warn here
        got = generate(model, PROMPTS, max_new_tokens=6, prefill_fn=prefill, decode_fn=decode,
                       cache=_cache(TINY_MOE))
    assert got == expected
    for graphed in (prefill, decode):
        stats = graphed.stats()
        assert stats["token_mixing"] == [] and stats["fallbacks"] == 0, stats
    assert prefill.stats()["pieces"] == TINY_MOE.num_layers + 1
    assert prefill.stats()["sizes"] == [16] and decode.stats()["replays"] >= 4  # the first call traces


def _bf16_model():
    return MoEDecoder.random(TINY_MOE, seed=5, dtype=torch.bfloat16)


def _mixing_found(model):
    graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    (ids, pos), meta = dummy_inputs(model, KVCache.for_sequences(TINY_MOE, 1, 16, dtype=torch.bfloat16), 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with piecegraph.forward_context(meta), torch.no_grad():
            graphed(ids, pos)
    mixing = [w for w in caught if "mixes rows over the token dimension" in str(w.message)]
    return graphed.stats()["token_mixing"], mixing


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.bfloat16), reason="torch._grouped_mm does not run here")
def test_grouped_mm_path_is_declared_padding_safe_and_without_it_flagged_at_its_sort_group_ends_and_return(monkeypatch):
    found, warned = _mixing_found(_bf16_model())
    assert found == [] and not warned  # Experts declares piecegraph_padding_safe: its sort moves rows only
    torch._dynamo.reset()
    monkeypatch.setattr(Experts, "piecegraph_padding_safe", False)
    found, warned = _mixing_found(_bf16_model())
    assert warned and len(found) == 3 * TINY_MOE.num_layers, found
    assert sum("argsort at moe.py" in f and "works along the token dimension" in f for f in found) == 2
    assert sum("searchsorted at moe.py" in f and "reduces over the token dimension" in f for f in found) == 2
    assert sum("index_copy at moe.py" in f and "per-token indices" in f for f in found) == 2  # the rows' return


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.bfloat16), reason="torch._grouped_mm does not run here")
@torch.inference_mode()
def test_grouped_mm_padded_under_pad_equals_unpadded():
    """The declaration is true: padded to the capture size (default token_mixing), real rows equal eager."""
    model = _bf16_model()
    graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(16,),
                                 emulate_graphs=True)
    for lens in ((5,), (3, 6), (7, 2, 4)):
        outs = []
        for fn in (model, graphed):
            cache = KVCache.for_sequences(TINY_MOE, 3, 32, page_size=4, dtype=torch.bfloat16)
            meta = AttentionMetadata.for_batch(cache, [(i, 0, n) for i, n in enumerate(lens)])
            ids = torch.randint(0, TINY_MOE.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(7))
            with piecegraph.forward_context(meta):
                outs.append(fn(ids, meta.positions))
        assert _rel(outs[1], outs[0].double()) < 1e-2, lens
    assert graphed.stats()["sizes"] == [16] and graphed.stats()["fallbacks"] == 0


# ---------------------------------------------------------------- config and presets
@pytest.mark.parametrize("field,value", [("num_experts", 0), ("top_k", 9), ("expert_width", 2.0),
                                         ("shared_expert_width", -1), ("norm_topk_prob", 1),
                                         ("routing", "relu"), ("expert_impl", "dense")])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field}"):
        TINY_MOE.replace(**{field: value})


def test_config_keeps_dense_checks_and_refuses_hf_round_trips():
    with pytest.raises(ValueError, match="ModelConfig.num_heads"):
        TINY_MOE.replace(num_heads=3)
    with pytest.raises(TypeError, match="MoEDecoder needs a MoEConfig"):
        MoEDecoder(piecegraph.models.TINY)
    with pytest.raises(NotImplementedError, match="to_hf"):
        TINY_MOE.to_hf()


def test_presets_and_parameter_counts():
    total, active = QWEN1_5_MOE_A2_7B.parameter_counts()
    assert round(total / 1e9, 1) == 14.3 and round(active / 1e9, 1) == 2.7  # the model card's 14.3B, A2.7B
    assert (QWEN1_5_MOE_A2_7B.num_experts, QWEN1_5_MOE_A2_7B.top_k, QWEN1_5_MOE_A2_7B.expert_width,
            QWEN1_5_MOE_A2_7B.shared_expert_width) == (60, 4, 1408, 5632)
    for cfg in (TINY_MOE, TINY_MOE.replace(tie_embeddings=True, shared_expert_width=0, qkv_bias=False)):
        model = MoEDecoder.random(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.parameter_counts()[0]
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_embeddings
    names = dict(MoEDecoder.random(TINY_MOE).named_parameters())
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert names["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names and "model.layers.0.mlp.gate.weight" in names
