"""piecegraph.models.gemv on a GPU at the Llama-3.2-1B projection shapes: the small_linear op (measured choice and
the Triton kernel forced) against a float64 product at 1..16 rows, within the bound cuBLAS itself meets; inside a
captured CUDA graph equal to eager; cuBLAS during a capture with no measured choice; and the measured table at one
row (cuBLAS and Triton microseconds and the weight bytes per second of each: recorded, never asserted).

Bound: one rounding of a float32 sum to bfloat16, ``2^-8 |y|``, plus float32 summation over K in any order,
``K 2^-24 (|x| @ |w|^T)``; the test allows ``2^-7 |y| + 2^-12 (|x| @ |w|^T)``.
"""

import pytest
import torch
import torch.nn.functional as F

from piecegraph.models import gemv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RESULTS = "gemv_gpu.json"
ROWS = (1, 2, 4, 8, 16)
# name -> (N, K) of x [M, K] @ W[N, K]^T: Llama-3.2-1B (hidden 2048, 32/8 heads of 64, MLP 8192, vocab 128256)
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "q": (2048, 2048), "k_v": (512, 2048), "gate_or_up": (8192, 2048), "lm_head": (128256, 2048)}


@pytest.fixture(autouse=True)
def _auto_choice(monkeypatch):
    monkeypatch.delenv(gemv.ENV, raising=False)  # the measured choice, whatever the shell says


def _inputs(n, k, rows, bias=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if bias else None
    return x, w, b


def _within(got, x, w, b):
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    size = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    excess = ((got.double() - want).abs() - 2.0**-7 * want.abs() - 2.0**-12 * size).max().item()
    assert excess <= 0, f"beyond the bound by {excess:.3g}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_op_meets_cublas_bound_at_the_1b_shapes(name, rows):
    n, k = SHAPES[name]
    x, w, b = _inputs(n, k, rows, bias=name == "qkv", seed=rows)
    _within(F.linear(x, w, b), x, w, b)  # the bound holds for cuBLAS too
    for kernel in gemv.KERNELS:
        got = gemv.small_linear(x, w, b, kernel)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        _within(got, x, w, b)
    key = (n, k, gemv.row_bucket(rows), b is not None, "torch.bfloat16", str(x.device))
    assert any(tuple(c[f] for f in ("n", "k", "rows", "bias", "dtype", "device")) == key
               for c in gemv.choice_table()), "the first eager call measured its key"


@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_a_captured_graph_equals_eager(kernel):
    n, k = SHAPES["qkv"]
    x, w, b = _inputs(n, k, 3, bias=True)
    static = x.clone()
    eager = gemv.small_linear(x, w, b, kernel)  # measures (auto) and autotunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.small_linear(static, w, b, kernel)
    fresh, _, _ = _inputs(n, k, 3, seed=7)
    triton = gemv.pick_kernel(x, w, b, kernel) == "triton"
    for inputs, want in ((fresh, gemv.small_linear(fresh, w, b, kernel)), (x, eager)):
        static.copy_(inputs)
        graph.replay()
        if triton:  # the same launch in and out of the graph: bit for bit
            assert torch.equal(out, want)
        else:  # cuBLAS may pick another algorithm under capture: the bound
            _within(out, inputs, w, b)


def test_a_capture_without_a_measured_choice_runs_cublas_and_measures_nothing():
    n, k = 1000, 2000  # a shape no other test measures
    x, w, _ = _inputs(n, k, 1)
    F.linear(x, w)  # cuBLAS's handle before the capture, as any warm-up step makes it
    gemv.clear_choices()
    picked = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picked.append(gemv.pick_kernel(x, w))
        out = gemv.small_linear(x, w)
    graph.replay()
    assert picked == ["cublas"] and gemv.choice_table() == []
    assert torch.equal(out, F.linear(x, w))


def test_the_measured_table_at_one_row(record_result):
    gemv.clear_choices()
    record_result(RESULTS, "device", {"name": torch.cuda.get_device_name(), "torch": torch.__version__,
                                      "cuda": torch.version.cuda, "calls_per_graph": gemv.CALLS_PER_GRAPH})
    for name, (n, k) in SHAPES.items():
        x, w, _ = _inputs(n, k, 1)
        picked = gemv.pick_kernel(x, w)
        (row,) = [c for c in gemv.choice_table() if (c["n"], c["k"], c["rows"]) == (n, k, 1)]
        assert not row["error"], row["error"]
        assert row["cublas_us"] > 0 and row["triton_us"] > 0 and picked == row["kernel"]
        assert picked == ("triton" if row["triton_us"] < row["cublas_us"] * (1 - gemv.MARGIN) else "cublas")
        _within(gemv.small_linear(x, w), x, w, None)
        size = n * k * w.element_size()
        record_result(RESULTS, name, {**row, "weight_bytes": size,
                                      "cublas_gbps": round(size / row["cublas_us"] / 1e3, 1),
                                      "triton_gbps": round(size / row["triton_us"] / 1e3, 1)})


def test_strided_rows_take_the_kernel_through_a_copy():
    n, k = SHAPES["o"]
    x, w, _ = _inputs(n, k, 12)
    rows = x.view(4, 3, k)[:, -1, :]  # the last position of each of 4 sequences: row stride 3 * K
    assert not rows.is_contiguous() and gemv.pick_kernel(rows, w, None, "triton") == "triton"
    got = gemv.small_linear(rows, w, None, "triton")
    assert torch.equal(got, gemv.triton_linear(rows.contiguous(), w))
    _within(got, rows, w, None)
