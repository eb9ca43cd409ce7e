"""FP8 (e4m3) decoders (piecegraph.models.fp8, fp8_moe) with the "torch" kernel: quantization and GEMM error against
bounds derived from e4m3's rounding (float64 references), the experts against a token-at-a-time float64 reference
of the same quantization, pad rows, and graphs (piecewise / full / auto) token for token against eager FP8."""

from __future__ import annotations

import gc
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, TINY_MOE, Decoder, MoEDecoder, generate
from piecegraph.models.fp8 import FP8Linear, quantize_rows
from piecegraph.models.fp8_moe import FP8Experts, quantize_fp8

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [200, 13, 54, 2, 8, 31, 77]]
STEP = 2.0**-4  # round to nearest with 3 mantissa bits: at most half a step, 2^-4 of the magnitude
SUB = 2.0**-10  # half the subnormal step (2^-9), in units of the scale


def _dequant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_rows(x)
    return q.double() * scale.double().unsqueeze(-1), scale.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), seed=st.integers(0, 2**16), spread=st.floats(0.0, 12.0))
def test_row_quantization_is_within_half_an_e4m3_step(rows, cols, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.rand(rows, cols, generator=gen) * spread - 6)
    back, scale = _dequant_rows(x)
    bound = STEP * x.double().abs() + SUB * scale.unsqueeze(-1)
    assert ((back - x.double()).abs() <= bound * (1 + 1e-6)).all()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), k=st.integers(1, 48), n=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_fp8_linear_is_within_the_derived_bound_of_the_exact_product(rows, k, n, seed):
    """|x^ w^ - x w| <= (|x| + dx)(|w| + dw)^T - |x||w|^T with dx = 2^-4|x| + 2^-10 s_x (and so for w)."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    fp8 = FP8Linear.from_linear(linear, "torch")
    exact = x.double() @ linear.weight.double().t()
    a, b = x.double().abs(), linear.weight.double().abs()
    da = STEP * a + SUB * quantize_rows(x)[1].double().unsqueeze(-1)
    db = STEP * b + SUB * fp8.weight_scale.double()
    bound = (a + da) @ (b + db).t() - a @ b.t()
    assert ((fp8(x).double() - exact).abs() <= bound + 1e-5 * (a @ b.t())).all()


def _ref_experts(experts: FP8Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One (token, expert) pair at a time in float64, with the module's dequantized weights and its per-row
    activation quantization (a second implementation: no sort, no groups, no scatter)."""
    gate_up = experts.gate_up.double() * experts.gate_up_scale.double()[:, None, None]
    down = experts.down.double() * experts.down_scale.double()[:, None, None]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            u = gate_up[e] @ _dequant_rows(x[t:t + 1])[0][0]
            g, v = u[: experts.width], u[experts.width:]
            h = (g * torch.sigmoid(g) * v).float()
            out[t] += float(weights[t, j]) * (down[e] @ _dequant_rows(h.unsqueeze(0))[0][0])
    return out


@torch.no_grad()
def test_fp8_experts_equal_a_pair_at_a_time_float64_reference_and_ignore_pad_rows():
    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=2))
    block = model.model.layers[0].mlp
    x = torch.randn(9, TINY_MOE.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = block.route(x)
    got = block.experts(x, ids, weights)
    ref = _ref_experts(block.experts, x, ids, weights)
    assert ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    for pad in (torch.zeros(7, x.shape[1]), torch.randn(3, x.shape[1]) * 40):
        padded = torch.cat([x, pad])
        w2, i2 = block.route(padded)
        assert torch.equal(i2[:9], ids) and torch.equal(block.experts(padded, i2, w2)[:9], got)


@pytest.mark.parametrize("config,cls", [(TINY, Decoder), (TINY_MOE, MoEDecoder)], ids=["dense", "moe"])
@torch.no_grad()
def test_fp8_decoder_stays_near_its_float_weights_and_quantizes_once(config, cls):
    """The whole model, FP8 against the same weights in float32: each GEMM is within ~2^-3 of its exact product
    (first order, above); measured over the layers the hidden state stays within that too."""
    base = cls.random(config, seed=1)
    fp8 = quantize_fp8(cls.random(config, seed=1))
    cache = KVCache.for_sequences(config, 2, 32, page_size=4)
    meta = AttentionMetadata.for_batch(cache, [(0, 0, 6), (1, 0, 4)])
    ids = torch.randint(0, config.vocab_size, (10,), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (base, fp8):
        with piecegraph.forward_context(meta):
            outs.append(model(ids, meta.positions))
    rel = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert 0 < rel <= 2.0**-3, rel
    with pytest.raises(ValueError, match="FP8 already"):
        quantize_fp8(fp8)
    with pytest.raises(ValueError, match="sm90"):
        quantize_fp8(cls.random(config), kernel="flashinfer")


def _cache(cfg):
    return KVCache.for_sequences(cfg, len(PROMPTS), max(map(len, PROMPTS)) + 6, page_size=4)


@pytest.mark.parametrize("prefill_mode,decode_mode", [("piecewise", "full"), ("auto", "auto")])
def test_fp8_moe_graphs_generate_like_eager_fp8(prefill_mode, decode_mode):
    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=3))
    expected = generate(model, PROMPTS, max_new_tokens=6, cache=_cache(TINY_MOE))
    options = {"compiler": "eager", "emulate_graphs": True}  # FP8Experts declares itself padding-safe
    prefill = piecegraph.compile(model, mode=prefill_mode, capture_sizes=(8, 16), **options)
    decode = piecegraph.compile(model, mode=decode_mode, capture_sizes=(2, 4), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = generate(model, PROMPTS, max_new_tokens=6, prefill_fn=prefill, decode_fn=decode,
                       cache=_cache(TINY_MOE))
    assert got == expected
    assert prefill.stats()["fallbacks"] == 0 and decode.stats()["replays"] >= 4
    assert prefill.stats()["token_mixing"] == [] and prefill.stats()["sizes"] == [16]  # 15 tokens, padded


@pytest.fixture(scope="module")
def stand_in():
    """One stand-in ``flashinfer`` module for the tests of this file: a process keeps one module object, and Dynamo
    remembers the one it imported (a module swapped for another between traces is not what a user does)."""
    import types

    import jitlib_auto

    module = types.ModuleType("flashinfer")
    module.bmm_fp8, module.SegmentGEMMWrapper = jitlib_auto.bmm_fp8, jitlib_auto.SegmentGemm
    return module


@pytest.fixture
def fake_flashinfer(monkeypatch, stand_in):
    """The stand-in ``flashinfer`` (tests/cpu/jitlib_auto: loaders that stop Dynamo, listed in no adapter) with
    ``bmm_fp8`` and ``SegmentGEMMWrapper``, so the FP8 decoders' ``"flashinfer"`` path runs on CPU."""
    from jitlib_auto.segment import DEVICE_FAULTS

    from piecegraph.models import fp8_moe

    module = stand_in
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fp8_moe, "fp8_kernels_run", lambda device: True)
    monkeypatch.setattr(fp8_moe, "WORKSPACE_BYTES", 16)
    DEVICE_FAULTS.clear()
    yield module
    piecegraph.unfreeze()
    torch._dynamo.reset()
    # automatic opaque's probe runs the grouped GEMM on other data: never on offsets a GPU would fault on
    assert DEVICE_FAULTS == [], f"the grouped GEMM ran on invalid seg_indptr: {DEVICE_FAULTS[:3]}"


@pytest.mark.parametrize("mode", ["piecewise", "auto"])
def test_fp8_moe_decoder_on_jit_kernels_nobody_adapted_traces_with_automatic_opaque(fake_flashinfer, mode):
    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=3), kernel="flashinfer")
    expected = generate(model, PROMPTS, max_new_tokens=5, cache=_cache(TINY_MOE))  # eager, the same kernels
    options = {"compiler": "eager", "emulate_graphs": True, "auto_opaque": True}
    prefill = piecegraph.compile(model, mode="piecewise" if mode == "piecewise" else "auto", capture_sizes=(16,),
                                 **options)
    decode = piecegraph.compile(model, mode="full" if mode == "piecewise" else "auto", capture_sizes=(4,), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = generate(model, PROMPTS, max_new_tokens=5, prefill_fn=prefill, decode_fn=decode,
                       cache=_cache(TINY_MOE))
    assert got == expected
    for graphed in (prefill, decode):
        stats = graphed.stats()
        assert stats["mode"] in ("piecewise", "full") and stats["fallbacks"] == 0, stats
    # the first module wraps both entries; the second traces through the routes the first left
    assert set(prefill.stats()["auto_opaque"]) == {"jitlib_auto.bmm_fp8", "jitlib_auto.SegmentGemm.run"}


@torch.no_grad()
def test_a_first_call_of_one_token_in_a_forward_context_is_recorded_with_pad_rows(fake_flashinfer):
    """One decode row under its metadata: automatic opaque records the call at a few tokens (pad rows, as a capture
    has) and a twin two tokens on, so the experts' k rows per token are told from static sizes."""
    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=4), kernel="flashinfer")
    cache = KVCache.for_sequences(TINY_MOE, 8, 32, page_size=4)
    graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(1, 4),
                                 emulate_graphs=True, auto_opaque=True)
    for n in (1, 3, 4):
        cache.reserve((i, 9) for i in range(n))
        meta = AttentionMetadata.for_decode(cache, [(i, 8) for i in range(n)])
        ids = torch.randint(0, TINY_MOE.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        with warnings.catch_warnings(), piecegraph.forward_context(meta):
            warnings.simplefilter("ignore")
            torch.testing.assert_close(graphed(ids, meta.positions), model(ids, meta.positions), rtol=0, atol=1e-6)
    assert set(graphed.stats()["auto_opaque"]) == {"jitlib_auto.bmm_fp8", "jitlib_auto.SegmentGemm.run"}


def test_the_fp8_moe_decoder_on_jit_kernels_nobody_adapted_is_served_by_the_engine(fake_flashinfer):
    """The engine's auto (and piecewise with auto_opaque=True, as serve-bench runs it) wraps the kernels as
    piecegraph's auto does and serves the same greedy tokens as its eager mode; piecewise without it refuses the
    model at setup, naming the fix."""
    from piecegraph.graphs.fallback import TraceBreakError
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=5), kernel="flashinfer")

    def served(mode, **options):
        config = EngineConfig(mode=mode, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_seq_len=32,
                              decode_sizes=(1, 2, 4), prefill_sizes=(4, 8, 16), compiler="eager",
                              emulate_graphs=True, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Engine(model, config).generate(PROMPTS, SamplingParams(max_new_tokens=5))

    expected = served("eager")
    assert served("auto") == expected
    assert served("piecewise", auto_opaque=True) == expected
    gc.collect()  # the engines above are gone: their modules' routes through the wrapped kernels with them
    with pytest.raises(TraceBreakError, match="auto_opaque=True"):
        served("piecewise")
