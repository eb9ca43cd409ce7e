"""Automatic opaque on a method of a FlashInfer object, nothing written by hand: an FP8 mixture-of-experts block
(fp8_moe_block.py, beside this test) whose experts run FlashInfer's sm90 grouped GEMM (``SegmentGEMMWrapper.run``,
e4m3 in, bf16 out) comes out piecewise in mode="auto" (Inductor pieces with the routing and quantization, CUDA
graphs), equal to eager within FP8 rounding at every capture size, padded sizes included.

Tolerances. (1) Compiled against eager FP8: Inductor computes the bf16 RMSNorm product in float32 and rounds once
where eager rounds twice, so the quantizer's input differs by one bf16 ulp (2^-8 relative) in some elements; e4m3
values are 2^-4 to 2^-3 of their magnitude apart, so one such element in 16 to 32 rounds to the neighbouring e4m3
value, a change of one step. Eager and compiled are each within the e4m3 bound (2) of the exact block, so the
compiled block is held to that bound against eager: relative Frobenius error <= 2^-3. An element that moved one
step at both quantizations moves by about two steps of its own magnitude, so each element is held within 2^-2 of
the output's max (measured on the H200: 0.02-0.04 relative, 0.08-0.13 worst element). A wrong fake, a missing
write or a stale graph input gives errors of order 1.
(2) FP8 against the same weights dequantized, in float32 with unquantized activations (one layer at a time, on the
same input, so routing is identical): e4m3 keeps 3 mantissa bits, so rounding to nearest moves each activation by
at most 2^-4 of itself; the layer quantizes twice in series (the gate/up input, the down input), so to first order
the MoE part of the output moves by at most about 2 * 2^-4 = 2^-3 relative (Frobenius); random rounding gives
about 2^-4 / sqrt(3) per quantization, which the test records.
"""

import warnings

import pytest
import torch

import piecegraph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("restore_jit_state")]
flashinfer = pytest.importorskip("flashinfer")

from fp8_moe_block import MoEBlock  # noqa: E402  (the block, shared with scripts/fp8_bench.py)

from piecegraph.ops.opaque import is_opaque  # noqa: E402

SIZES = (1, 16, 256)
ENTRY = "flashinfer.SegmentGEMMWrapper.run"
RESULTS = "fp8_moe_gpu.json"


def _close(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref.float()
    rel = (diff.norm() / ref.float().norm()).item()
    worst = (diff.abs().max() / ref.float().abs().max()).item()
    assert rel <= 2**-3 and worst <= 2**-2, (rel, worst)
    return {"relative_frobenius": rel, "max_abs_over_max": worst}


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="sm90 kernel")
def test_auto_wraps_the_grouped_gemm_method_and_comes_out_piecewise_equal_to_eager(record_result):
    torch.manual_seed(0)
    model = MoEBlock().eval()
    inputs = {n: torch.randn(n, model.hidden, device="cuda", dtype=torch.bfloat16) for n in (*SIZES, 200)}
    with torch.no_grad():
        ref = {n: model(x) for n, x in inputs.items()}
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=SIZES, token_mixing="pad")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = graphed(inputs[16])
    messages = [str(w.message) for w in caught]
    assert not any("does not trace with Dynamo" in m for m in messages), messages
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and list(stats["auto_opaque"]) == [ENTRY], stats
    assert is_opaque(model.layers[0].gemm.run)
    errors = {"first": _close(first, ref[16])}
    for n, x in inputs.items():  # 200: padded into the 256 graph; a size's first call captures, the second replays
        errors[n] = [_close(graphed(x), ref[n]) for _ in range(2)]
    assert graphed.stats()["replays"] >= len(inputs)
    record_result(RESULTS, "auto", {"line": stats["auto_opaque"][ENTRY], "errors": errors})


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="sm90 kernel")
def test_fp8_layers_are_within_the_e4m3_bound_of_the_dequantized_weights(record_result):
    torch.manual_seed(0)
    model = MoEBlock().eval()
    x = torch.randn(256, model.hidden, device="cuda", dtype=torch.bfloat16)
    measured = []
    with torch.no_grad():
        for layer in model.layers:
            fp8, exact = layer(x).float() - x.float(), layer.dequantized(x) - x.float()
            measured.append(((fp8 - exact).norm() / exact.norm()).item())
            x = layer(x)
    assert max(measured) <= 2**-3, measured
    record_result(RESULTS, "fp8_vs_dequantized_relative_frobenius", measured)
