"""Greedy generation over the flat-token layout: one packed prefill, then batched decode steps."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from piecegraph.context import forward_context
from piecegraph.models.config import ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.kv_cache import KVCache
from piecegraph.models.metadata import AttentionMetadata

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``model``'s first parameter (the reference models keep all on one)."""
    param = next(model.parameters())
    return param.device, param.dtype


@torch.inference_mode()
def generate(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: KVCache | None = None, prefill_fn: StepFn | None = None,
             decode_fn: StepFn | None = None) -> list[list[int]]:
    """Greedy-decode ``max_new_tokens`` tokens after each prompt; returns the new tokens per prompt.

    The prompts live in ``cache`` (default: a fresh paged cache just large enough) as sequences
    ``("generate", i)``, freed again at the end. ``prefill_fn`` and ``decode_fn`` (default ``model``) take
    ``(input_ids [T], positions [T])`` and return hidden states with at least ``T`` rows: pass a graphed or
    compiled module to exercise it. The prefill packs all prompts into one step; each decode step builds its
    metadata once on the host (pages, and the backend's plan) and is a pure decode step, so ``decode_fn`` may
    replay full CUDA graphs. Stops at ``max_new_tokens``; there is no EOS handling.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt, and every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device, dtype = device_dtype(model)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if cache is None:
        cache = KVCache.for_sequences(model.config, len(prompts), longest, dtype=dtype, device=device)
    ids = [("generate", i) for i in range(len(prompts))]
    taken = set(ids) & set(cache.sequences())
    if taken:
        raise ValueError(f"the KV cache already holds sequences {sorted(taken)}; generate() uses those ids")
    prefill_fn, decode_fn = prefill_fn or model, decode_fn or model
    try:
        meta = AttentionMetadata.for_batch(cache, [(s, 0, len(p)) for s, p in zip(ids, prompts)])
        input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
        with forward_context(meta):
            hidden = prefill_fn(input_ids, meta.positions)
        ends = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
        tokens = model.logits(hidden[ends]).argmax(-1)
        steps = [tokens]
        for step in range(max_new_tokens - 1):
            meta = AttentionMetadata.for_decode(cache, [(s, len(p) + step) for s, p in zip(ids, prompts)])
            with forward_context(meta):
                hidden = decode_fn(tokens, meta.positions)
            tokens = model.logits(hidden[: len(prompts)]).argmax(-1)
            steps.append(tokens)
    finally:
        for s in ids:
            if s in cache.sequences():
                cache.free(s)
    return torch.stack(steps, dim=1).tolist()  # one host sync at the end, not one per step


def dummy_inputs(model_or_config: Decoder | ModelConfig, cache: KVCache, n: int
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """``((input_ids, positions), meta)`` of ``n`` pad tokens (all zeros) for warm-up and capture.

    A pure decode step: running the model on them only touches the cache's scratch page. ``model_or_config``
    checks that the cache was built for this model's shape.
    """
    config = model_or_config if isinstance(model_or_config, ModelConfig) else model_or_config.config
    if (config.num_layers, config.num_kv_heads, config.head_dim) != (
            len(cache.k), cache.num_kv_heads, cache.head_dim):
        raise ValueError("the KV cache was built for a different model shape than the one given")
    zeros = torch.zeros(n, dtype=torch.int64, device=cache.device)
    return (zeros, zeros.clone()), AttentionMetadata.dummy(cache, n)
