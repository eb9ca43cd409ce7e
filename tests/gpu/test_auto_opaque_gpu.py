"""Automatic opaque on FlashInfer, nothing written by hand: a 4-layer block of rmsnorm -> per-tensor FP8
quantization in torch -> bmm_fp8 -> silu_and_mul -> quantization -> bmm_fp8 -> residual, in mode="auto", comes out
piecewise (Inductor pieces, CUDA graphs), with the adapter for rmsnorm/silu_and_mul and bmm_fp8 wrapped by
automatic opaque; it equals eager within FP8 rounding. The doctor names flashinfer.bmm_fp8 (never FlashInfer's
decorator `wrapper`), gives the adapter for the functions it covers and the opaque line for bmm_fp8, and --fix
leaves 0 breaks.

Tolerance: the only code that differs between eager and the compiled block is the torch quantization (amax,
divide, clamp, cast to e4m3), which Inductor fuses into one Triton kernel; its float32 divide may differ from
eager's by an ulp, which moves a value across an FP8 rounding boundary now and then: that element changes by one
e4m3 step (2^-3 relative), and each GEMM sums K of them, so the output moves by far less than one step overall.
The check: relative Frobenius error <= 1e-2 and every element within 2^-3 (one e4m3 step) of the output's max
magnitude. A wrong fake, a missing write or a stale graph input gives errors of order 1.
"""

import warnings

import pytest
import torch

import piecegraph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("restore_jit_state")]
flashinfer = pytest.importorskip("flashinfer")

from fp8_block import Block  # noqa: E402  (the block, shared with scripts/fp8_bench.py)

from piecegraph.ops.opaque import is_opaque  # noqa: E402

HIDDEN, TOKENS = 1024, 16
RESULTS = "auto_opaque_gpu.json"  # under $PIECEGRAPH_OUT, for the closing note


def _block():
    torch.manual_seed(0)
    return Block().eval(), torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)


def _close(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.float() - ref.float())
    rel = (diff.norm() / ref.float().norm()).item()
    worst = (diff.abs().max() / ref.float().abs().max()).item()
    assert rel <= 1e-2 and worst <= 2**-3, (rel, worst)
    return {"relative_frobenius": rel, "max_abs_over_max": worst}


def test_auto_mode_wraps_bmm_fp8_and_comes_out_piecewise_equal_to_eager(record_result):
    model, x = _block()
    with torch.no_grad():
        ref = model(x)
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(8, TOKENS, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graphed(x)
        again = graphed(x)  # the captured graph replays
    messages = [str(w.message) for w in caught]
    assert not any("does not trace with Dynamo" in m for m in messages), messages
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and TOKENS in stats["sizes"] and stats["replays"] >= 1, stats
    assert list(stats["auto_opaque"]) == ["flashinfer.bmm_fp8"], stats.get("auto_opaque")
    line = stats["auto_opaque"]["flashinfer.bmm_fp8"]
    assert '"dtype": lambda dtype, **_: dtype' in line and "(A.shape[0], A.shape[1], B.shape[2])" in line, line
    assert any("utils.wrapper" not in m and "flashinfer.bmm_fp8 = piecegraph.opaque(" in m for m in messages)
    record_result(RESULTS, "auto", {"line": line, "first": _close(out, ref), "replay": _close(again, ref)})
    assert is_opaque(flashinfer.bmm_fp8) and hasattr(flashinfer.rmsnorm, "__piecegraph_adapter__")


def test_doctor_names_bmm_fp8_with_the_adapter_only_where_it_covers_and_fix_clears_every_break(record_result):
    model, x = _block()
    report = piecegraph.doctor(model, x)
    entries = {f.entry for f in report.findings}
    lines = [line for f in report.findings for line in f.fix.splitlines()]
    assert not any("wrapper" in (e or "") for e in entries) and not any("wrapper" in ln for ln in lines), lines
    assert any(ln.startswith("flashinfer.bmm_fp8 = piecegraph.opaque(flashinfer.bmm_fp8, fake=") for ln in lines)
    for f in report.findings:  # the adapter is offered where it adapts the function, and only there
        covered = f.entry in ("flashinfer.rmsnorm", "flashinfer.silu_and_mul")
        assert covered == ("adapters.flashinfer.install()" in f.fix) or "\n" in f.fix, (f.entry, f.fix)
    record_result(RESULTS, "doctor_findings", [(f.entry, f.primitive, f.fix) for f in report.findings])
    fixed = piecegraph.doctor(model, x, fix=True)
    try:
        assert fixed.graph_breaks == 0 and fixed.ok, fixed.json()
        record_result(RESULTS, "doctor", {"before": fixed.before, "applied": fixed.applied.codes})
    finally:
        fixed.applied.undo()
