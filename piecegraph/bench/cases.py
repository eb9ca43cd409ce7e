"""The inputs every mode is timed on: decode steps at a context length, packed varlen prefills.

All modes share one paged decode cache and one paged prefill cache, both on the bench's attention backend, so
they read the same memory. Each case builds its :class:`AttentionMetadata` once and keeps it alive for the whole
run: ``reduce-overhead`` records the attention op inside its CUDA graphs, baking in the addresses of the
metadata tensors the op read while recording (slot mapping, page tables, masks, the backend's plan), so a
case's metadata must not be rebuilt between its calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from piecegraph.attention import DEFAULT_PAGE_SIZE, SCRATCH_PAGE, AttentionMetadata, KVCache
from piecegraph.attention.kv_cache import pages_for
from piecegraph.models import Decoder, dummy_inputs
from piecegraph.models.generate import device_dtype

# Relative lengths of the packed prompts of a prefill batch: mixed on purpose (varlen attention, uneven work).
_PREFILL_WEIGHTS = (7, 2, 5, 1, 3, 8, 2, 4)
_VARIANTS = 3  # input_ids sets rotated through the repeats


@dataclass
class Case:
    """One timed cell's inputs: ``ids[i % len(ids)]`` and ``positions`` under ``meta``.

    ``floor_bytes`` is what an ideal step must read from memory (weights + KV cache); ``reference`` is the
    eager output in float32, filled in by the sweep before any mode runs.
    """

    phase: str
    size: int
    ids: list[torch.Tensor]
    positions: torch.Tensor
    meta: AttentionMetadata
    floor_bytes: int
    seqs: int = 1
    reference: torch.Tensor | None = field(default=None, repr=False)
    float_reference: torch.Tensor | None = field(default=None, repr=False)  # the unquantized model's (--quant)

    def args(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i % len(self.ids)], self.positions


def weight_bytes_read(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of weights one forward of ``tokens`` tokens must read.

    For the reference decoders: every layer's parameters and floating-point buffers (an FP8 model's weights and
    scales are buffers) and the final norm, plus only the ``tokens`` embedding rows it gathers; a mixture of
    experts' experts only as far as top-k routing can reach, ``min(E, tokens * top_k)`` of each layer's (routing
    assumed to spread); ``lm_head`` is not part of the forward. Other models: every parameter.
    """
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if inner is None or embed is None:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    experts = getattr(model.config, "num_experts", 0)
    reached = min(experts, tokens * model.config.top_k) if experts else 0
    skip = {id(p) for p in embed.parameters()}
    body = 0
    for name, t in (*inner.named_parameters(), *inner.named_buffers()):
        if id(t) in skip or not t.is_floating_point():
            continue
        size = t.numel() * t.element_size()
        body += size * reached // experts if ".experts." in name else size
    return body + tokens * embed.weight.shape[1] * embed.weight.element_size()


def kv_bytes_per_token(model: Decoder, cache_dtype: torch.dtype) -> int:
    """Bytes of k and v that one cached token holds across all layers."""
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=cache_dtype).element_size()


def _ids(model: Decoder, n: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).to(device) for _ in range(_VARIANTS)]


def decode_cache(model: Decoder, batches: Sequence[int], context: int, backend: str = "auto") -> KVCache:
    """One paged cache for every decode batch: sequences ``0..max(batches)-1`` of ``context`` random cached tokens.

    Room for ``context + 8`` tokens per sequence (``max_seq_len``, so decode page tables stay ``pages_for(context
    + 8)`` wide, not ``config.max_seq_len``), and every sequence's pages for ``context + 1`` tokens (the cached
    ones and the decoded one) reserved up front, so building a decode step allocates nothing. The pages of the
    sequences hold random k/v; the scratch page stays zero (pad rows read it).
    """
    device, dtype = device_dtype(model)
    cache = KVCache.for_sequences(model.config, max(batches), context + 8, dtype=dtype, device=device,
                                  backend=backend)
    cache.reserve([(i, context + 1) for i in range(max(batches))])
    gen = torch.Generator(device=device).manual_seed(0)
    for k, v in zip(cache.k, cache.v):
        for pages in (k, v):
            pages.normal_(0, 1, generator=gen)
            pages[SCRATCH_PAGE].zero_()  # as the cache built it: pad rows of full graphs read zeros
    return cache


def decode_cases(model: Decoder, cache: KVCache, batches: Sequence[int], context: int) -> list[Case]:
    """One decode step per batch: sequences ``0..batch-1`` of :func:`decode_cache`, ``context`` cached tokens each.

    Each case's metadata is built once here and kept (see the module docstring).
    """
    device, _ = device_dtype(model)
    per_token = kv_bytes_per_token(model, cache.dtype)
    cases = []
    for b in batches:
        meta = AttentionMetadata.for_decode(cache, [(i, context) for i in range(b)])
        floor = weight_bytes_read(model, b) + b * (context + 1) * per_token
        cases.append(Case("decode", b, _ids(model, b, seed=b, device=device), meta.positions, meta, floor, seqs=b))
    return cases


def prefill_lengths(total: int) -> list[int]:
    """Mixed prompt lengths summing to ``total``: up to 8 prompts (one per 8 tokens), uneven by design."""
    n = max(1, min(len(_PREFILL_WEIGHTS), total // 8))
    weights = _PREFILL_WEIGHTS[:n]
    lengths = [max(1, total * w // sum(weights)) for w in weights]
    lengths[-1] += total - sum(lengths)
    while lengths[-1] < 1:  # rounding pushed the last prompt below one token: borrow from the longest
        i = lengths.index(max(lengths))
        lengths[i] -= 1
        lengths[-1] += 1
    return lengths


def prefill_cases(model: Decoder, totals: Sequence[int], backend: str = "auto") -> list[Case]:
    """One packed prefill per total: fresh prompts of :func:`prefill_lengths`, each case on its own pages of one
    prefill cache (sequences ``(total, i)``). A fresh prompt rewrites all its k/v before attending to them, so
    repeated calls of a case are identical. ``Case.seqs`` is the number of prompts."""
    if not totals:
        return []
    device, dtype = device_dtype(model)
    layouts = [prefill_lengths(t) for t in totals]
    page_size = DEFAULT_PAGE_SIZE
    pages = sum(pages_for(n, page_size) for lengths in layouts for n in lengths) + 1  # + the scratch page
    longest = max(max(lengths) for lengths in layouts)
    cache = KVCache(model.config, pages, page_size, dtype=dtype, device=device, max_seq_len=longest, backend=backend)
    per_token = kv_bytes_per_token(model, dtype)
    cases = []
    for total, lengths in zip(totals, layouts):
        meta = AttentionMetadata.for_batch(cache, [((total, i), 0, n) for i, n in enumerate(lengths)])
        floor = weight_bytes_read(model, total) + total * per_token
        cases.append(Case("prefill", total, _ids(model, total, seed=10_000 + total, device=device),
                          meta.positions, meta, floor, seqs=len(lengths)))
    return cases


def capture_inputs(model: Decoder, cache: KVCache) -> Callable[[int], tuple[tuple[Any, ...], Any]]:
    """``make_inputs(n)`` for ``GraphedModule.capture``: pad tokens on the decode cache.

    The decode cache on purpose: ``full`` graphs bake the cache object in, and decode replays use that cache.
    """
    return lambda n: dummy_inputs(model, cache, n)
