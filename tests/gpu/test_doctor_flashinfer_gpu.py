"""The doctor on FlashInfer-backed models, on CUDA: the reference decoder with FlashInfer attention on a paged KV
cache (a mixed step: a chunked continuation, a fresh prompt, a one-token row) traces and captures with nothing
blocking, and a small block calling FlashInfer's rmsnorm, silu_and_mul and fp4_quantize (left out where this
FlashInfer refuses it on this GPU: 0.7+ needs SM100) is clear of findings after ``fix=True``."""

import pytest
import torch

import piecegraph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("restore_jit_state")]
flashinfer = pytest.importorskip("flashinfer")

from piecegraph.adapters import flashinfer as adapter  # noqa: E402

RESULTS = "doctor_flashinfer_gpu.json"  # under $PIECEGRAPH_OUT


class FlashInferBlock(torch.nn.Module):
    def __init__(self, hidden: int = 256, inter: int = 512, fp4: bool = True):
        super().__init__()
        self.fp4 = fp4
        self.norm = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.register_buffer("global_scale", torch.tensor([448.0 * 6.0 / 4.0]))

    def forward(self, x):
        h = flashinfer.norm.rmsnorm(x, self.norm)
        a = flashinfer.activation.silu_and_mul(self.up(h))
        if not self.fp4:
            return x + self.down(a)
        q, sf = flashinfer.fp4_quantize(a, self.global_scale)
        return x + self.down(a), q, sf


def test_the_flashinfer_reference_decoder_has_nothing_blocking(record_result):
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.models import QWEN2_5_0_5B, Decoder

    config = QWEN2_5_0_5B.replace(num_layers=4, attention_backend="flashinfer")
    model = Decoder.random(config, seed=0, dtype=torch.bfloat16, device="cuda")
    cache = KVCache.for_sequences(config, 4, 256, dtype=torch.bfloat16, device="cuda")
    AttentionMetadata.for_batch(cache, [(0, 0, 20)])  # a cached prefix for the chunked continuation below
    meta = AttentionMetadata.for_batch(cache, [(0, 20, 12), (1, 0, 30), (2, 0, 1)])
    ids = torch.randint(0, config.vocab_size, (meta.num_tokens,), device="cuda")
    report = piecegraph.doctor(model, ids, meta.positions, context=meta)
    record_result(RESULTS, "reference", report.json())
    assert report.ok and report.graph_breaks == 0, report.json()
    assert report.pieces > 1  # split at the attention ops


def test_fix_clears_a_block_of_flashinfer_calls(record_result):
    refusal = adapter.fp4_refusal()
    torch.manual_seed(0)
    model = FlashInferBlock(fp4=refusal is None).cuda().to(torch.bfloat16).eval()
    x = torch.randn(24, 256, device="cuda", dtype=torch.bfloat16)
    fixed = piecegraph.doctor(model, x, fix=True)
    try:
        record_result(RESULTS, "block", {"fp4_left_out": refusal, **fixed.json()})
        assert fixed.ok and fixed.graph_breaks == 0, fixed.json()
    finally:
        if fixed.applied is not None:
            fixed.applied.undo()
