"""Block-scaled FP8 linears (piecegraph/models/fp8_block.py) on a GPU: cuBLAS's 1x128 x 128x128 GEMM
(``scaled_mm``, sm90) and piecegraph's Triton kernel against the torch kernel on the same e4m3 values and against
the bf16 product of the dequantized weights, at 1, 10, 256 and 1024 tokens, eager and inside a captured CUDA graph;
then a block-FP8 checkpoint served by the engine in auto mode with the tokens of eager mode.

Bounds (piecegraph/models/fp8_block.py): the weights are the checkpoint's own, so against ``x @ dequant(w)^T`` only
the activations' e4m3 rounding errs: each output within ``(2^-3 + 2^-8) (|x| @ |w|^T)``, plus the bf16 rounding of
the result (2^-8 relative). Against the torch kernel on the same e4m3 values the products are exact in float32 both
ways: only the order of the sums and the bf16 result differ, held to ``2^-7 (|a| @ |b|^T)``.
"""

import pytest
import torch

from piecegraph.models.fp8_block import (
    FP8BlockLinear,
    _scaled_mm_runs,
    expand_blocks,
    quantize_groups,
    quantize_weight_blocks,
    torch_block_gemm,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")]

TOKENS = (1, 10, 256, 1024)
RESULTS = "fp8_block_gpu.json"


def _kernels():
    dev = torch.device("cuda", torch.cuda.current_device())
    return ["triton"] + (["scaled_mm"] if _scaled_mm_runs(dev) else [])


def _weight(n, k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    w[:, :7] *= 20  # an outlier column, as real checkpoints have: blocks with very different scales
    return quantize_weight_blocks(w)


def _within(got, want, bound):
    excess = ((got.float() - want.float()).abs() - bound).max().item()
    assert excess <= 0, f"beyond the bound by {excess:.3g}"


def test_cublas_blockwise_scaled_mm_is_available_on_sm90(record_result):
    """On an H100/H200 the cuBLAS path must be the one chosen; elsewhere this records why not."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ok = _scaled_mm_runs(dev)
    record_result(RESULTS, "scaled_mm_block", {"available": ok, "torch": torch.__version__,
                                               "cuda": torch.version.cuda,
                                               "capability": list(torch.cuda.get_device_capability())})
    if torch.cuda.get_device_capability()[0] == 9:
        assert ok, "torch.nn.functional.scaled_mm with BlockWise1x128 x BlockWise128x128 did not run or was wrong"


@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 1000)])  # a Qwen3-8B projection; ragged edge blocks
@pytest.mark.parametrize("tokens", TOKENS)
def test_block_gemm_equals_the_torch_kernel_and_the_dequantized_bf16_product(shape, tokens):
    n, k = shape
    wq, ws = _weight(n, k)
    w = wq.float() * expand_blocks(ws, n, k, (128, 128))
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    q, qs = quantize_groups(x, 128)
    exact = torch_block_gemm(q, qs, wq, ws, (128, 128), torch.float32)
    a = (q.float() * qs.repeat_interleave(128, 1)[:, :k]).abs()
    dense = x.float() @ w.t()
    bound = (2**-3 + 2**-8) * (x.float().abs() @ w.abs().t()) + 2**-8 * dense.abs()
    kernels = [kn for kn in _kernels() if kn == "triton" or (n % 128 == 0 and k % 128 == 0)]
    for kernel in kernels:
        layer = FP8BlockLinear(wq, ws, (128, 128), None, torch.bfloat16, kernel=kernel)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (tokens, n)
        _within(y, exact, 2**-7 * (a @ w.abs().t()))
        _within(y, dense, bound)


@pytest.mark.parametrize("tokens", TOKENS)
def test_block_gemm_replays_in_a_cuda_graph(tokens):
    wq, ws = _weight(2048, 1024, seed=1)
    bias = torch.randn(2048, device="cuda").to(torch.bfloat16)
    for kernel in _kernels():
        layer = FP8BlockLinear(wq, ws, (128, 128), bias, torch.bfloat16, kernel=kernel)
        static = torch.randn(tokens, 1024, device="cuda").to(torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernel and warms cuBLAS before capture
                layer(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static)
        for seed in (2, 3):
            fresh = torch.randn(tokens, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(
                seed)).to(torch.bfloat16)
            static.copy_(fresh)
            graph.replay()
            torch.testing.assert_close(out, layer(fresh))  # the replay read the new input (bf16 tolerance)


@pytest.mark.parametrize("tokens", (1, 10, 256))
def test_block_linear_compiled_by_inductor_equals_eager(tokens):
    """Inductor fuses the activation quantization and keeps the layouts each kernel reads (the M-major activation
    scales of cuBLAS's recipe): compiled equals eager within one e4m3 step of a fused input (2^-3 relative)."""
    wq, ws = _weight(1024, 2048, seed=5)
    w = (wq.float() * expand_blocks(ws, 1024, 2048, (128, 128))).abs()
    x = torch.randn(tokens, 2048, device="cuda").to(torch.bfloat16)
    for kernel in _kernels():
        layer = FP8BlockLinear(wq, ws, (128, 128), None, torch.bfloat16, kernel=kernel)
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        _within(compiled(x), layer(x), 2**-3 * (x.float().abs() @ w.t()))


def test_block_gemm_speed_against_bf16(record_result):
    """Recorded, not asserted: a CUDA-graph replay of each kernel against bf16 ``x @ w^T`` per token count, at a
    Qwen3-8B MLP shape (the basis for choosing FP8 per token count)."""
    n, k = 12288, 4096
    wq, ws = _weight(n, k, seed=4)
    w = (wq.float() * expand_blocks(ws, n, k, (128, 128))).to(torch.bfloat16)
    rows = {}
    layers = {kernel: FP8BlockLinear(wq, ws, (128, 128), None, torch.bfloat16, kernel=kernel)
              for kernel in _kernels()}
    for tokens in TOKENS:
        x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
        rows[tokens] = {"bf16": _graph_time_us(lambda x=x: x @ w.t())}
        rows[tokens].update({kernel: _graph_time_us(lambda x=x, f=layer: f(x)) for kernel, layer in layers.items()})
    record_result(RESULTS, "speed_us_12288x4096", {str(t): r for t, r in rows.items()})


def _graph_time_us(fn, reps=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / reps, 2)


def test_a_block_fp8_checkpoint_serves_in_auto_mode_with_eager_tokens(tmp_path):
    """load_hf keeps the checkpoint's FP8 on the GPU (FP8BlockLinear everywhere it was quantized) and the engine's
    auto mode (pieces compiled eagerly, so the numerics are eager's) gives eager mode's greedy tokens."""
    import json

    from safetensors.torch import load_file, save_file

    from piecegraph.models import TINY, Decoder, load_hf, save_hf
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    config = TINY.replace(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    save_hf(Decoder.random(config, seed=3, dtype=torch.bfloat16), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in state if n.endswith("proj.weight")]:
        state[name], state[name[:-6] + "weight_scale_inv"] = quantize_weight_blocks(state[name])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    model = load_hf(tmp_path, device="cuda")
    assert sum(isinstance(m, FP8BlockLinear) for m in model.modules()) == 7 * config.num_layers
    prompts = [[5, 17, 3, 99, 42, 7], [8, 9, 10, 11, 1, 2, 3, 4, 120], [3] * 40]
    params = SamplingParams(max_new_tokens=12)
    tokens = {}
    for mode in ("eager", "auto"):
        engine = Engine(model, EngineConfig(mode=mode, max_num_seqs=8, max_num_batched_tokens=128, page_size=16,
                                            max_seq_len=128, compiler="eager"))
        tokens[mode] = engine.generate(prompts, params)
    assert tokens["auto"] == tokens["eager"]
