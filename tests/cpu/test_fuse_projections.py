"""``fuse_projections``: one q/k/v GEMM and one gate/up GEMM give the unfused decoders' outputs, eagerly, through
piecewise graphs and in FP8, with no weight held twice."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import QWEN2_5_0_5B, TINY, TINY_MOE, Decoder, MoEDecoder, fuse_projections, quantize_fp8
from piecegraph.models.decoder import MLP, Attention
from piecegraph.models.fp8 import fp8_kernels_run

BATCH = [(0, 0, 5), (1, 0, 3)]  # two prompts in one flat batch


def _run(model, config, batch=BATCH, seed=0, **cache_options):
    """Hidden states of one mixed batch on a fresh paged cache (pages of 4 tokens; ``dtype``, ``device``)."""
    cache = KVCache.for_sequences(config, 2, 32, page_size=4, **cache_options)
    meta = AttentionMetadata.for_batch(cache, batch)
    ids = torch.randint(0, config.vocab_size, (meta.num_tokens,), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(cache.device)
    with forward_context(meta), torch.no_grad():
        return model(ids, meta.positions)


def _pairs():
    """(unfused, fused) dense and MoE decoders with the same random weights."""
    return [(m, fuse_projections(copy.deepcopy(m))) for m in (Decoder.random(TINY, seed=1),
                                                               MoEDecoder.random(TINY_MOE, seed=2))]


@pytest.fixture(scope="module")
def pairs():
    return _pairs()


def test_fused_decoders_equal_unfused_ones_and_keep_every_weight_once(pairs):
    for plain, fused in pairs:
        attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[-1].mlp
        mlp = getattr(mlp, "shared_expert", mlp)  # the MoE decoder's shared expert is an MLP
        c = fused.config
        assert attn.qkv_sizes == (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        assert attn.qkv_proj.bias is not None and mlp.gate_up_proj.bias is None
        names = set(fused.state_dict())
        assert not {n for n in names if n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                   "up_proj")}
        assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in fused.parameters())
        torch.testing.assert_close(_run(fused, c), _run(plain, c))


def test_fusing_frees_the_parts_and_twice_is_a_no_op():
    model = Decoder.random(TINY, seed=4)
    attn = model.model.layers[0].self_attn
    q_weight, q_bias = attn.q_proj.weight.detach().clone(), attn.q_proj.bias.detach().clone()
    gone = weakref.ref(attn.k_proj.weight)
    fuse_projections(model)
    gc.collect()
    assert gone() is None  # no copy of the parts is kept anywhere
    torch.testing.assert_close(attn.qkv_proj.weight[: q_weight.shape[0]], q_weight, rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.bias[: q_bias.shape[0]], q_bias, rtol=0, atol=0)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    fuse_projections(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def _shard_like_rank0(model: Decoder, world: int = 2) -> Decoder:
    """Rank 0's slice of a tensor-parallel shard, by hand (its heads, MLP columns; no all-reduce): projections
    with fewer rows than ``model.config`` had, and the config of one rank, as ``apply_tp`` leaves them."""
    c = model.config
    heads, kv, inter = c.num_heads // world, c.num_kv_heads // world, c.intermediate_size // world

    def keep(linear, rows=None, cols=None):
        w = linear.weight[:rows] if rows else linear.weight[:, :cols]
        linear.weight = nn.Parameter(w.detach().clone(), requires_grad=False)
        if rows and linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[:rows].detach().clone(), requires_grad=False)
        linear.out_features, linear.in_features = linear.weight.shape

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        keep(a.q_proj, heads * c.head_dim), keep(a.k_proj, kv * c.head_dim), keep(a.v_proj, kv * c.head_dim)
        keep(a.o_proj, cols=heads * c.head_dim)
        a.num_heads, a.num_kv_heads = heads, kv
        keep(m.gate_proj, inter), keep(m.up_proj, inter), keep(m.down_proj, cols=inter)
    model.config = c.replace(num_heads=heads, num_kv_heads=kv, intermediate_size=inter)
    return model


def test_a_sharded_model_splits_by_its_own_rows():
    plain = _shard_like_rank0(Decoder.random(TINY, seed=5))
    fused = fuse_projections(copy.deepcopy(plain))
    attn, mlp, dim = fused.model.layers[0].self_attn, fused.model.layers[0].mlp, TINY.head_dim
    assert attn.qkv_sizes == (TINY.num_heads // 2 * dim, TINY.num_kv_heads // 2 * dim, TINY.num_kv_heads // 2 * dim)
    assert mlp.gate_up_sizes == (TINY.intermediate_size // 2,) * 2
    assert not attn.qkv_proj.weight.requires_grad  # the shards' flag is kept
    torch.testing.assert_close(_run(fused, plain.config), _run(plain, plain.config))


def _odd_attention(change: str) -> Attention:
    attn = Attention(TINY, 0)
    if change == "one bias missing":
        attn.k_proj.bias = None
    elif change == "another dtype":
        attn.v_proj.to(torch.float64)
    else:  # a subclass (a quantized or sharded wrapper, say): not exactly nn.Linear
        attn.k_proj = type("Wrapped", (nn.Linear,), {})(TINY.hidden_size, TINY.num_kv_heads * TINY.head_dim)
    return attn


@pytest.mark.parametrize("change", ["one bias missing", "another dtype", "a Linear subclass"])
def test_projections_that_cannot_share_a_gemm_are_left_alone(change):
    attn = _odd_attention(change)
    fuse_projections(attn)
    assert not hasattr(attn, "qkv_proj") and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    mlp = MLP(TINY)
    mlp.up_proj = nn.Linear(TINY.hidden_size, TINY.intermediate_size, bias=True)  # a biased MLP stays unfused
    fuse_projections(mlp)
    assert not hasattr(mlp, "gate_up_proj")


def test_piecewise_graphs_of_a_fused_decoder_equal_the_unfused_eager_one(pairs):
    """Traced once with a symbolic token count (Dynamo, fullgraph), replayed at two batch shapes."""
    plain, fused = pairs[0]
    graphed = piecegraph.compile(fused, mode="piecewise", compiler="eager", capture_sizes=(8, 16),
                                 emulate_graphs=True)
    for batch in (BATCH, [(0, 0, 2), (1, 0, 9)]):
        torch.testing.assert_close(_run(graphed, TINY, batch), _run(plain, TINY, batch))
    stats = graphed.stats()
    assert stats["fallbacks"] == 0 and stats["recompiles"] == 0 and stats["token_mixing"] == []
    assert stats["pieces"] == TINY.num_layers + 1


def _fp8(module: nn.Module) -> torch.Tensor:
    """An FP8Linear's weight dequantized row by row (its e4m3 values times its scale, 0-d or per row)."""
    scale = module.weight_scale
    return module.weight.float() * (scale.unsqueeze(-1) if scale.dim() else scale)


def test_fp8_of_a_fused_decoder_equals_fp8_of_the_unfused_one():
    """Each fused part gets its own scale, so the e4m3 weights and scales are exactly the unfused ones; the
    outputs differ only by the GEMMs' float32 summation order (float32 tolerances)."""
    for plain, fused in _pairs():
        quantize_fp8(plain, "torch"), quantize_fp8(fused, "torch")
        for lp, lf in zip(plain.model.layers, fused.model.layers):
            a, b = lp.self_attn, lf.self_attn
            parts = torch.cat([_fp8(a.q_proj), _fp8(a.k_proj), _fp8(a.v_proj)])
            torch.testing.assert_close(_fp8(b.qkv_proj), parts, rtol=0, atol=0)
            torch.testing.assert_close(b.qkv_proj.bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                                       rtol=0, atol=0)
            mp, mf = (getattr(m, "shared_expert", m) for m in (lp.mlp, lf.mlp))
            torch.testing.assert_close(_fp8(mf.gate_up_proj), torch.cat([_fp8(mp.gate_proj), _fp8(mp.up_proj)]),
                                       rtol=0, atol=0)
        torch.testing.assert_close(_run(fused, fused.config), _run(plain, plain.config))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_kernels_run("cuda"), reason="needs CUDA sm90, FlashInfer")
def test_fused_bf16_and_flashinfer_fp8_decoders_match_unfused_ones_on_the_gpu():
    """The 0.5B layer shape in bf16 (cuBLAS GEMMs of other widths round differently) and FP8 with FlashInfer's
    ``bmm_fp8`` on the fused widths, each against its unfused model."""
    config = QWEN2_5_0_5B.replace(num_layers=2)
    plain = Decoder.random(config, seed=0, dtype=torch.bfloat16, device="cuda")
    fused = fuse_projections(copy.deepcopy(plain))
    options = dict(dtype=torch.bfloat16, device="cuda")
    assert _rel(_run(fused, config, **options), _run(plain, config, **options)) < 2**-7
    quantize_fp8(plain, "flashinfer"), quantize_fp8(fused, "flashinfer")
    assert fused.model.layers[0].self_attn.qkv_proj.kernel == "flashinfer"
    assert _rel(_run(fused, config, **options), _run(plain, config, **options)) < 2**-7


def test_shard_for_tp_refuses_a_model_already_optimized():
    """Tensor parallel shards the unfused projections: a fused model, or one on small-batch linears, handed to
    ``shard_for_tp`` is refused naming the fix, never sharded along the wrong rows."""
    from types import SimpleNamespace

    from piecegraph.cli_common import shard_for_tp
    from piecegraph.models.gemv import use_small_batch_kernels

    ranks = SimpleNamespace(solo=False)
    fused = fuse_projections(Decoder.random(TINY, seed=0))
    small = use_small_batch_kernels(Decoder.random(TINY, seed=0), require_cuda_half=False)
    for net in (fused, small):
        with pytest.raises(ValueError, match=r"optimize=run\.solo"):
            shard_for_tp(net, ranks)
    plain = Decoder.random(TINY, seed=0)
    assert shard_for_tp(plain, SimpleNamespace(solo=True)) is plain  # solo: nothing to shard
