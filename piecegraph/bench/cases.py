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
from piecegraph.models import ModelFacts, dummy_inputs

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


def _ids(facts: ModelFacts, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, facts.vocab_size, (n,), generator=g).to(facts.device) for _ in range(_VARIANTS)]


def decode_cache(facts: ModelFacts, batches: Sequence[int], context: int, backend: str = "auto") -> KVCache:
    """One paged cache for every decode batch: sequences ``0..max(batches)-1`` of ``context`` random cached tokens.

    ``facts``: the model's (``model.facts()``), whose device, dtype and cache shape the cache takes. Room for
    ``context + 8`` tokens per sequence (``max_seq_len``, so decode page tables stay ``pages_for(context + 8)``
    wide, not ``config.max_seq_len``), and every sequence's pages for ``context + 1`` tokens (the cached ones and
    the decoded one) reserved up front, so building a decode step allocates nothing. The pages of the sequences
    hold random k/v; the scratch page stays zero (pad rows read it).
    """
    device = facts.device
    cache = KVCache.for_sequences(facts.config, max(batches), context + 8, dtype=facts.dtype, device=device,
                                  backend=backend)
    cache.reserve([(i, context + 1) for i in range(max(batches))])
    gen = torch.Generator(device=device).manual_seed(0)
    for pages in (*cache.k, *cache.v, *getattr(cache, "index_k", ())):  # a DSA indexer's keys too: no ties
        if not pages.numel():  # a layer that shares an earlier layer's DSA choice keeps no keys
            continue
        pages.normal_(0, 1, generator=gen)
        pages[SCRATCH_PAGE].zero_()  # as the cache built it: pad rows of full graphs read zeros
    return cache


def decode_cases(facts: ModelFacts, cache: KVCache, batches: Sequence[int], context: int) -> list[Case]:
    """One decode step per batch: sequences ``0..batch-1`` of :func:`decode_cache`, ``context`` cached tokens each.

    Each case's metadata is built once here and kept (see the module docstring); its floor is
    ``facts.weight_bytes_read(batch)`` plus the k/v of every cached token and the decoded one.
    """
    per_token = facts.kv_bytes_per_token(cache.dtype)
    cases = []
    for b in batches:
        meta = AttentionMetadata.for_decode(cache, [(i, context) for i in range(b)])
        floor = facts.weight_bytes_read(b) + b * (context + 1) * per_token
        cases.append(Case("decode", b, _ids(facts, b, seed=b), meta.positions, meta, floor, seqs=b))
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


def prefill_cases(facts: ModelFacts, totals: Sequence[int], backend: str = "auto") -> list[Case]:
    """One packed prefill per total: fresh prompts of :func:`prefill_lengths`, each case on its own pages of one
    prefill cache (sequences ``(total, i)``) on ``facts``' device, dtype and cache shape. A fresh prompt rewrites
    all its k/v before attending to them, so repeated calls of a case are identical. ``Case.seqs`` is the number
    of prompts."""
    if not totals:
        return []
    layouts = [prefill_lengths(t) for t in totals]
    page_size = DEFAULT_PAGE_SIZE
    pages = sum(pages_for(n, page_size) for lengths in layouts for n in lengths) + 1  # + the scratch page
    longest = max(max(lengths) for lengths in layouts)
    cache = KVCache(facts.config, pages, page_size, dtype=facts.dtype, device=facts.device, max_seq_len=longest,
                    backend=backend)
    per_token = facts.kv_bytes_per_token()
    cases = []
    for total, lengths in zip(totals, layouts):
        meta = AttentionMetadata.for_batch(cache, [((total, i), 0, n) for i, n in enumerate(lengths)])
        floor = facts.weight_bytes_read(total) + total * per_token
        cases.append(Case("prefill", total, _ids(facts, total, seed=10_000 + total), meta.positions, meta, floor,
                          seqs=len(lengths)))
    return cases


def capture_inputs(facts: ModelFacts, cache: KVCache) -> Callable[[int], tuple[tuple[Any, ...], Any]]:
    """``make_inputs(n)`` for ``GraphedModule.capture``: pad tokens on the decode cache.

    The decode cache on purpose: ``full`` graphs bake the cache object in, and decode replays use that cache.
    """
    return lambda n: dummy_inputs(facts.config, cache, n)
