"""The "scaled_grouped_mm" FP8 experts (piecegraph/models/fp8_grouped.py) on an sm90 GPU: torch._scaled_grouped_mm
and the Triton row quantizers against float32 references on the same e4m3 values, one layer against the dequantized
weights, pad rows, CUDA-graph replay and torch.compile against eager, the default choice of quantize_fp8, and the
measured table per token count (recorded, not asserted) at the Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B expert shapes.

Bounds (piecegraph/models/fp8.py): on the same e4m3 values both sides' products are exact in float32; only the
order of the sums and the bf16 output differ, held to ``2^-7 (|a| @ |b|^T)`` as tests/gpu/test_fp8_block_gpu.py
does. Against the dequantized weights with unquantized activations the layer quantizes twice in series (gate/up
input, down input), each moving an activation by at most 2^-4 of itself: relative Frobenius error <= 2^-3.
"""

import pytest
import torch

from piecegraph.models import TINY_MOE, MoEDecoder, fp8_grouped, quantize_fp8
from piecegraph.models.fp8 import quantize_rows
from piecegraph.models.fp8_moe import FP8Experts
from piecegraph.models.moe import Experts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="torch._scaled_grouped_mm's rowwise FP8 path is sm90 only")]

RESULTS = "fp8_grouped_gpu.json"
TOKENS = (1, 10, 256, 1024, 2048)
# (experts, hidden, expert width, top_k): Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B
SHAPES = {"qwen1.5-moe-a2.7b": (60, 2048, 1408, 4), "qwen3-30b-a3b": (128, 2048, 768, 8)}
SMALL = (16, 512, 256, 4)


def _experts(shape, seed=0):
    e, h, w, k = shape
    config = TINY_MOE.replace(hidden_size=h, num_experts=e, top_k=k, expert_width=w)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("meta"):
        experts = Experts(config)
    experts = experts.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return experts


def _fp8(experts, k, dense_at=(), triton=False):
    """FP8Experts with a stand-in timer (FP8 faster except at ``dense_at``; on the Triton GEMM with ``triton``, else
    on torch._scaled_grouped_mm): no measurement in the tests that check numbers."""
    def timer(path, tokens, run):
        return {"fp8": 2.0 if tokens in dense_at else 1.0, "fp8-triton": 0.5 if triton else 3.0, "dense": 1.5}[path]

    return FP8Experts(experts, "scaled_grouped_mm", top_k=k, max_tokens=1024, timer=timer)


def _routed(shape, tokens, seed):
    e, h, _, k = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, e, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, k, device="cuda", generator=gen), -1).to(torch.bfloat16)
    return x, ids, weights


def _sorted(layer, x, ids):
    """The rows the opaque op receives: pairs sorted by expert, their experts and group ends (as FP8Experts._run)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)
    ends = torch.searchsorted(expert, layer.expert_ids, right=True).to(torch.int32)
    return x.index_select(0, order // ids.shape[1]), expert, ends


def _per_expert(a, w, expert):
    """``a [M, K] @ w[expert]^T`` in float32, one matmul per expert's rows (no [M, N, K] gather)."""
    out = torch.zeros(a.shape[0], w.shape[1], device=a.device)
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().squeeze(1)
        out[rows] = a[rows] @ w[e].t()
    return out


def _within(got, want, bound):
    excess = ((got.float() - want.float()).abs() - bound).max().item()
    assert excess <= 0, f"beyond the bound by {excess:.3g}"


def test_scaled_grouped_mm_runs_and_is_the_default_for_moe_on_sm90(record_result):
    ok = fp8_grouped.scaled_grouped_mm_runs("cuda")
    why = fp8_grouped.native_failure(f"cuda:{torch.cuda.current_device()}")
    record_result(RESULTS, "available", {"available": ok, "why_not": why, "torch": torch.__version__,
                                         "cuda": torch.version.cuda})
    assert ok, f"the native FP8 grouped path did not run on this sm90 GPU or was wrong: {why}"
    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=0, dtype=torch.bfloat16, device="cuda"))
    experts = model.model.layers[0].mlp.experts
    assert experts.kernel == "scaled_grouped_mm" and experts.native
    assert [r["tokens"] for r in experts.kernel_table()][-1] == fp8_grouped.DEFAULT_MAX_TOKENS
    assert all(r["fp8_us"] > 0 and r["dense_us"] > 0 for r in experts.kernel_table())
    record_result(RESULTS, "tiny_moe_table", {"table": experts.kernel_table()})


@pytest.mark.parametrize("tokens", TOKENS)
def test_triton_quantizers_equal_torchs(tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens * 4, 1408 * 2, device="cuda", generator=gen).to(torch.bfloat16) * 3
    q, s = fp8_grouped.quantize_input(x)
    q_ref, s_ref = quantize_rows(x)
    # within one float32 ulp: torch divides a CUDA tensor by a Python scalar as a product with its reciprocal
    # (measured on an H100: a few scales one ulp apart), the Triton kernel with an IEEE division
    torch.testing.assert_close(s, s_ref, rtol=2**-23, atol=0)
    # the same e4m3 values, but for a rare tie a cast through fp16 (two roundings) would round the other way
    differ = q.float() != q_ref.float()
    assert differ.float().mean() < 2e-3, differ.float().mean()
    _within(q.float(), q_ref.float(), 2**-3 * q_ref.float().abs() + 2**-9)
    q, s = fp8_grouped.swiglu_quantize(x, 1408)
    h = torch.nn.functional.silu(x[:, :1408].float()) * x[:, 1408:].float()
    q_ref, s_ref = quantize_rows(h)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)  # Triton's sigmoid: a few ulps from torch's
    back = q.float() * s.unsqueeze(-1)
    _within(back, h, 2**-4 * h.abs() + 2**-9 * s.unsqueeze(-1))  # within one e4m3 rounding of the exact SwiGLU


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_gemms_equal_float32_products_of_the_same_e4m3_values(name, tokens):
    shape = SHAPES[name]
    layer = _fp8(_experts(shape), shape[3])
    x, ids, _ = _routed(shape, tokens, seed=tokens)
    xs, expert, ends = _sorted(layer, x, ids)
    q, s = fp8_grouped.quantize_input(xs)
    gu = _check_gemm(q, s, layer.gate_up, layer.gate_up_scale, ends, expert)
    q, s = fp8_grouped.swiglu_quantize(gu, layer.width)  # the down GEMM's input
    _check_gemm(q, s, layer.down, layer.down_scale, ends, expert)


def _check_gemm(q, s, w, ws, ends, expert):
    """torch._scaled_grouped_mm and the Triton kernel against the float32 product of the same e4m3 values; returns
    the first's output."""
    a, b = q.float() * s.unsqueeze(-1), w.float() * ws.unsqueeze(-1)
    want, bound = _per_expert(a, b, expert), 2**-7 * _per_expert(a.abs(), b.abs(), expert)
    outs = [fp8_grouped._fp8_gemm(q, s, w, ws, ends, expert, native=True, triton=triton) for triton in (False, True)]
    for got in outs:
        assert got.dtype == torch.bfloat16 and got.shape == (q.shape[0], w.shape[1])
        _within(got, want, bound)
    return outs[0]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("triton", [False, True], ids=["scaled_grouped_mm", "triton"])
def test_fp8_layer_is_within_the_e4m3_bound_of_the_dequantized_weights(tokens, triton, record_result):
    shape = SHAPES["qwen1.5-moe-a2.7b"]
    layer = _fp8(_experts(shape), shape[3], triton=triton)
    assert layer.use_triton == [triton] * len(layer.sizes)
    x, ids, weights = _routed(shape, tokens, seed=tokens + 1)
    with torch.no_grad():
        got = layer(x, ids, weights).float()
    gate_up = layer.gate_up.float() * layer.gate_up_scale.unsqueeze(-1)
    down = layer.down.float() * layer.down_scale.unsqueeze(-1)
    xs, expert, _ = _sorted(layer, x, ids)
    gu = _per_expert(xs.float(), gate_up, expert)
    ys = _per_expert(torch.nn.functional.silu(gu[:, :layer.width]) * gu[:, layer.width:], down, expert)
    order = torch.argsort(ids.reshape(-1), stable=True)
    pairs = torch.empty_like(ys).index_copy(0, order, ys).view(tokens, shape[3], -1)
    exact = (pairs * weights.float().unsqueeze(-1)).sum(1)
    rel = ((got - exact).norm() / exact.norm()).item()
    record_result(RESULTS, f"layer_vs_dequantized_{tokens}{'_triton' if triton else ''}", {"relative_frobenius": rel})
    assert rel <= 2**-3, rel


def test_pad_rows_never_change_real_rows(record_result):
    """Pads 40x the real rows: one mixed into a real row's scale or group would move it by far more than the bf16
    rounding allowed here (a GEMM tile chosen by the row count may sum in another order)."""
    shape = SMALL
    layer = _fp8(_experts(shape), shape[3], dense_at=(1024,))  # a dense size: both paths' weights kept
    x, ids, weights = _routed(shape, 10, seed=3)
    equal = {}
    with torch.no_grad():
        for path, flags in {"fp8": ([True], [False]), "fp8-triton": ([True], [True]),
                            "dense": ([False], [False])}.items():
            got = layer._run(x, ids, weights, [1], *flags)
            for total in (16, 64):
                px, pids, pw = _routed(shape, total - 10, seed=total)
                padded = layer._run(torch.cat([x, px * 40]), torch.cat([ids, pids]), torch.cat([weights, pw]),
                                    [1], *flags)[:10]
                torch.testing.assert_close(padded, got, rtol=2**-7, atol=2**-7 * got.abs().max().item())
                equal[f"{path}_{total}"] = torch.equal(padded, got)
    record_result(RESULTS, "pad_rows_bitwise_equal", equal)


def test_cuda_graph_replay_equals_eager_and_compile_takes_one_node():
    shape = SMALL
    layer = _fp8(_experts(shape), shape[3], dense_at=(1, 256))
    for tokens in (1, 10, 256):
        static_x, static_ids, static_w = _routed(shape, tokens, seed=tokens)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                layer(static_x, static_ids, static_w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = layer(static_x, static_ids, static_w)
        for seed in (100, 101):
            x, ids, w = _routed(shape, tokens, seed=seed + tokens)
            static_x.copy_(x)
            static_ids.copy_(ids)
            static_w.copy_(w)
            graph.replay()
            with torch.no_grad():
                assert torch.equal(out, layer(x, ids, w)), tokens  # the same kernels on the same inputs
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)  # fullgraph: the dispatch is one opaque node
    for tokens in (3, 10, 256):
        x, ids, w = _routed(shape, tokens, seed=7)
        with torch.no_grad():
            want = layer(x, ids, w).float()
            got = compiled(x, ids, w).float()
        # Inductor sums the k weighted pair outputs in float32 where eager rounds each product to bf16 first
        _within(got, want, 2**-7 * want.abs() + 2**-7 * want.abs().max())


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_measured_table_per_token_count(name, record_result):
    """Recorded, not asserted: the choice table the build measures (CUDA graph replays, L2 flushed), 1 to 2048
    tokens, and the speed-up of the chosen path over the model-dtype one."""
    shape = SHAPES[name]
    layer = FP8Experts(_experts(shape), "scaled_grouped_mm", top_k=shape[3])
    table = layer.kernel_table()
    assert [r["tokens"] for r in table] == fp8_grouped.token_sizes(fp8_grouped.DEFAULT_MAX_TOKENS)
    assert all(r["fp8_us"] > 0 and r["dense_us"] > 0 for r in table)
    assert all(r["triton_us"] > 0 for r in table)  # the Triton FP8 GEMM is measured where Triton runs
    for row in table:
        row["fp8_speedup"] = round(row["dense_us"] / row["fp8_us"], 3)
        row["triton_speedup"] = round(row["dense_us"] / row["triton_us"], 3)
    record_result(RESULTS, f"table_{name}", {"table": table, "dense_kept": layer.gate_up_dense is not None})
