"""One rank of the two-GPU tensor-parallel check (started by tests/gpu/test_tp_gpu.py under torchrun, NCCL).

The 0.5B shape in bf16: every rank computes the TP=1 reference (eager, same seeded weights) on its GPU, then a
TP=2 copy with piecewise prefill and full-graph decode, the all-reduce inside the graphs or as a split op;
writes ``{variant: {"rel", "tokens", "ref_tokens", "ties", ...}}`` to ``argv[1]/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from bf16_ties import first_divergences

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import QWEN2_5_0_5B, Decoder, generate
from piecegraph.parallel import ALL_REDUCE_INPLACE, apply_tp
from piecegraph.parallel.launch import GROUP, init_tp

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [42, 43], [900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912]]
NEW = 32
CONFIG = QWEN2_5_0_5B.replace(max_seq_len=256)


def _model() -> Decoder:
    return Decoder.random(CONFIG, seed=0, dtype=torch.bfloat16, device="cuda").eval()


def _prefill_logits(model, fn) -> torch.Tensor:
    cache = KVCache.for_sequences(model.config, len(PROMPTS), 64, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata.for_batch(cache, [(i, 0, len(p)) for i, p in enumerate(PROMPTS)])
    ids = torch.tensor([t for p in PROMPTS for t in p], device="cuda")
    with piecegraph.forward_context(meta), torch.inference_mode():
        return model.logits(fn(ids, meta.positions)[: len(ids)]).float()


def _last_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = KVCache.for_sequences(model.config, 1, 64, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata.for_batch(cache, [(0, 0, len(tokens))])
    with piecegraph.forward_context(meta), torch.inference_mode():
        return model.logits(model(torch.tensor(tokens, device="cuda"), meta.positions)[-1:])[0].float()


def main() -> None:
    run = init_tp(int(os.environ["WORLD_SIZE"]), "cuda")
    ref = _model()
    ref_logits, ref_tokens = _prefill_logits(ref, ref), generate(ref, PROMPTS, NEW)
    results = {}
    for name, inplace in (("inside", False), ("split", True)):
        extra = {"split_ops": [ALL_REDUCE_INPLACE]} if inplace else {}
        model = apply_tp(_model(), GROUP, inplace=inplace)
        prefill = piecegraph.compile(model, mode="piecewise", capture_sizes=(8, 16, 32), **extra)
        decode = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4), **extra)
        logits = _prefill_logits(model, prefill)
        tokens = generate(model, PROMPTS, NEW, prefill_fn=prefill, decode_fn=decode)
        results[name] = {
            "rel": ((logits - ref_logits).norm() / ref_logits.norm()).item(), "tokens": tokens,
            "ref_tokens": ref_tokens, "ties": first_divergences(PROMPTS, tokens, ref_tokens,
                                                                lambda t: _last_logits(ref, t)),
            "prefill": {k: prefill.stats()[k] for k in ("pieces", "split_ops", "replays", "fallbacks")},
            "decode": {k: decode.stats()[k] for k in ("sizes", "replays", "fallbacks")},
            "kv_heads_per_rank": model.config.num_kv_heads}
        del prefill, decode, model
    with open(os.path.join(sys.argv[1], f"rank{run.rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    run.finish()


if __name__ == "__main__":
    main()
