"""The overlapped greedy loop (models.generate.greedy_loop, behind piecegraph.models.generate and piecegraph.hf) on a
GPU with full-graph decode: tokens equal eager greedy decoding with EOS stops that finish sequences at different
steps, and its decode steps make no device sync but the intended event wait for the previous step's tokens
(``torch.cuda.set_sync_debug_mode("error")`` from the first decode step to the end)."""

import random

import pytest
import torch

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.attention.backends import flashinfer_available
from piecegraph.models import TINY, Decoder, ModelConfig, dummy_inputs, generate

pytestmark = pytest.mark.gpu
FI_SHAPE = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=14,
                       num_kv_heads=2, head_dim=64, max_seq_len=128, qkv_bias=True)
NEW = 16


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_overlapped_greedy_loop_equals_eager_and_syncs_only_on_its_event(backend, record_result):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if backend == "flashinfer" and flashinfer_available(torch.device("cuda")) is not None:
        pytest.skip(str(flashinfer_available(torch.device("cuda"))))
    shape, dtype = (FI_SHAPE, torch.bfloat16) if backend == "flashinfer" else (TINY, torch.float32)
    model = Decoder.random(shape, seed=3, device="cuda", dtype=dtype).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(shape.vocab_size) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    alone = [generate(model, [p], NEW)[0] for p in prompts]  # eager, one prompt at a time, no EOS
    eos = {alone[0][3], alone[2][7]}  # stops sequences early, at different steps (float32: exactly these)
    expected = [next((t[: i + 1] for i, x in enumerate(t) if x in eos), t) for t in alone]
    cache = KVCache.for_sequences(shape, len(prompts), 64, backend=backend, dtype=dtype, device="cuda")
    decode = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4, 8))
    decode.capture(lambda n: dummy_inputs(model, cache, n))
    generate(model, prompts, NEW, cache=cache, decode_fn=decode, eos_token_id=eos)  # warm: lazy first uses
    steps = []

    def decode_checked(ids, positions):
        if not steps:  # from the first decode step on: every synchronizing call raises
            torch.cuda.set_sync_debug_mode("error")
        steps.append(ids.shape[0])
        return decode(ids, positions)

    try:
        out = generate(model, prompts, NEW, cache=cache, decode_fn=decode_checked, eos_token_id=eos)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record_result("generate_gpu.json", backend, {"decode_rows_per_step": steps, "equal": out == expected})
    if backend == "torch":  # float32: the graphs' tokens are eager's exactly, and the batch shrank as they stopped
        assert out == expected and steps[-1] < len(prompts)
    # bf16 FlashInfer (its graph decode wrapper splits the kv, the eager one need not): each output stops at its
    # first EOS or after NEW tokens, whatever near-tie the two orders of summation may break differently
    assert all(len(t) == NEW or (t[-1] in eos and not set(t[:-1]) & eos) for t in out)
    assert steps[0] == len(prompts)
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1
