"""The artifact cache on a GPU gives the same tokens as no cache.

On the H200, `piecegraph serve` (cache on by then, four front ends) and an in-process engine of the same preset and
settings without the cache disagreed from the first token on 16 of 16 prompts, the server 1.6-2x faster per token
than the GPU's own step time allows; the same comparison on CPU (tiny, float32 and bfloat16, Inductor, one and two
front ends) agrees token for token. This test settles it on the GPU without HTTP: the server's engine settings
(0.5B shape, bfloat16, FlashInfer when it imports, Inductor, mode auto) with no cache, with a fresh cache (a cold
start, which compiles the program restored from its snapshot) and with that cache again (a warm start, which
loads it). Divergences are judged with the bf16 near-tie judge against the eager model's logits.

Cause (found on the H200 by dumping the graph snapshot): torch 2.11's FX called
Dynamo's op-packet attention node pure and the snapshot dropped every attention op; fixed in trace/snapshot.py.
This test is the engine-level check that stays to be run."""

from __future__ import annotations

import random

import pytest
import torch
from bf16_ties import first_divergences

from piecegraph.attention import KVCache
from piecegraph.attention.backends import flashinfer_available
from piecegraph.cache import wait_packaging
from piecegraph.models import QWEN2_5_0_5B, Decoder
from piecegraph.serve import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 32


def _logits_of(model, backend):
    def logits(ids: list[int]) -> torch.Tensor:
        from piecegraph.attention import AttentionMetadata
        from piecegraph.context import forward_context

        cache = KVCache.for_sequences(QWEN2_5_0_5B, 1, len(ids) + 1, dtype=torch.bfloat16, device="cuda",
                                      backend=backend)
        meta = AttentionMetadata.for_batch(cache, [(0, 0, len(ids))])
        with forward_context(meta), torch.no_grad():
            hidden = model(torch.tensor(ids, device="cuda"), meta.positions)
            return model.logits(hidden[-1:])[0].float().cpu()  # the forward gives hidden states, not logits
    return logits


@pytest.mark.parametrize("aot", [True, False])
def test_cached_engine_starts_give_the_uncached_engines_tokens(tmp_path, record_result, aot):
    backend = "torch" if flashinfer_available(torch.device("cuda")) else "flashinfer"
    model = Decoder.random(QWEN2_5_0_5B, seed=0, dtype=torch.bfloat16, device="cuda").eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(16, 300))] for _ in range(8)]
    outs, starts = {}, {}
    for name, cache_dir in (("none", None), ("cold", tmp_path), ("warm", tmp_path)):
        config = EngineConfig(mode="auto", max_num_seqs=16, max_num_batched_tokens=2048, max_seq_len=832,
                              attention_backend=backend, compiler="inductor", cache_dir=cache_dir, aot_package=aot)
        engine = Engine(model, config)
        outs[name] = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
        report = engine.capture_report()
        starts[name] = {"decode_choice": report.get("decode_choice"), **{
            kind: {k: v for k, v in (m.get("startup") or {}).items() if k in ("cache", "trace", "aot", "setup_s")}
            for kind, m in report["modules"].items()}}
        del engine
        torch.cuda.empty_cache()
        if name == "cold" and aot:  # the packages are made after the start, by a worker: the warm start loads them
            starts["packaging"] = wait_packaging(tmp_path, timeout=900)
    if aot:  # the warm engine's modules run the worker's packages
        assert all(m["trace"] == "packaged" for k, m in starts["warm"].items() if k != "decode_choice"), starts
    judge = _logits_of(model, backend)
    found = {name: first_divergences(prompts, outs[name], outs["none"], judge) for name in ("cold", "warm")}
    record_result("cache_gpu.json", f"divergences aot={aot}", {"backend": backend, "starts": starts, **found})
    for name, ties in found.items():
        assert all(t["step"] > 0 and t["bf16_steps_apart"] <= 1.0 for t in ties), (name, ties)
        assert len(ties) <= len(prompts) // 4, (name, ties)
