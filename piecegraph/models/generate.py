"""Greedy generation over the flat-token layout: one packed prefill, then batched decode steps."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from piecegraph.context import forward_context
from piecegraph.models.attention import AttentionMetadata, KVCache
from piecegraph.models.config import ModelConfig
from piecegraph.models.decoder import Decoder

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``model``'s first parameter (the reference models keep all on one)."""
    param = next(model.parameters())
    return param.device, param.dtype


def _check_cache(cache: KVCache, num_seqs: int, longest: int) -> None:
    if cache.num_slots < num_seqs:
        raise ValueError(f"the KV cache has {cache.num_slots} slots but generate() got {num_seqs} prompts")
    if cache.max_len < longest:
        raise ValueError(f"the KV cache's max_len {cache.max_len} is shorter than the longest sequence "
                         f"generate() would produce ({longest} tokens)")


@torch.inference_mode()
def generate(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: KVCache | None = None, prefill_fn: StepFn | None = None,
             decode_fn: StepFn | None = None) -> list[list[int]]:
    """Greedy-decode ``max_new_tokens`` tokens after each prompt; returns the new tokens per prompt.

    Prompt ``i`` uses cache slot ``i + 1`` (slot 0 is the padding scratch row); ``cache`` defaults to a fresh one
    just large enough. ``prefill_fn`` and ``decode_fn`` (default ``model``) take ``(input_ids [T], positions
    [T])`` and return hidden states with at least ``T`` rows: pass a graphed or compiled module to exercise
    it. The prefill packs all prompts into one varlen batch; decode metadata is tensors only
    (:meth:`AttentionMetadata.for_decode`), so ``decode_fn`` may replay CUDA graphs that capture attention.
    Stops at ``max_new_tokens``; there is no EOS handling.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt, and every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device, dtype = device_dtype(model)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if cache is None:
        cache = KVCache(model.config, num_slots=len(prompts), max_len=longest, dtype=dtype, device=device)
    _check_cache(cache, len(prompts), longest)
    prefill_fn, decode_fn = prefill_fn or model, decode_fn or model

    meta = AttentionMetadata.for_batch(cache, [(i + 1, 0, len(p)) for i, p in enumerate(prompts)], device)
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    with forward_context(meta):
        hidden = prefill_fn(input_ids, meta.positions)
    last_rows = torch.tensor([end - 1 for end in meta.seq_bounds[1:]], device=device)
    tokens = model.logits(hidden[last_rows]).argmax(-1)

    steps = [tokens]
    slots = torch.arange(1, len(prompts) + 1, dtype=torch.int64, device=device)
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    for _ in range(max_new_tokens - 1):
        meta = AttentionMetadata.for_decode(cache, slots, positions)
        with forward_context(meta):
            hidden = decode_fn(tokens, positions)
        tokens = model.logits(hidden[: len(prompts)]).argmax(-1)
        steps.append(tokens)
        positions = positions + 1
    return torch.stack(steps, dim=1).tolist()  # one host sync at the end, not one per step


def dummy_inputs(model_or_config: Decoder | ModelConfig, cache: KVCache, n: int,
                 device: torch.device | str | None = None
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """``((input_ids, positions), meta)`` of ``n`` pad tokens (all zeros, slot 0) for warm-up and capture.

    Running the model on them only touches the cache's scratch row. ``model_or_config`` checks that the cache
    was built for this model's shape.
    """
    config = model_or_config if isinstance(model_or_config, ModelConfig) else model_or_config.config
    if (config.num_layers, config.num_kv_heads, config.head_dim) != (
            len(cache.k), cache.num_kv_heads, cache.head_dim):
        raise ValueError("the KV cache was built for a different model shape than the one given")
    device = cache.device if device is None else device
    zeros = torch.zeros(n, dtype=torch.int64, device=device)
    return (zeros, zeros.clone()), AttentionMetadata.dummy(cache, n, device)
