"""What the GPU allows for a serve-bench workload: the engine's own graph step times, enqueued back to back so
the host's launch work hides behind the device, summed over the steps the workload needs.

An estimate (the target: auto serves at least 60% of it), not a measurement of a run: decode steps are timed at
the workload's mean context (prompt + half the output) with ``min(concurrency, requests)`` rows; prefill at the
per-step token budget, per token. The bench's ``baked-graph`` rows (each step one whole graph) are the stricter
floor; these are the graphs the engine actually replays. CUDA only (``None`` elsewhere).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.attention.pages import pages_for
from piecegraph.context import forward_context
from piecegraph.graphs.capture import pipelined_ms

StepTimer = Callable[[str, int, int], float]  # (kind "decode" | "prefill", rows or tokens, context) -> ms


def estimate(work: Sequence[tuple[Sequence[int], int]], concurrency: int, timer: StepTimer,
             budget: int, fits: Callable[[int], int] | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    """GPU-bound output tok/s of ``work`` (``(prompt, max_new_tokens)`` pairs, no EOS) at ``concurrency``:
    prompt tokens at the prefill rate of a ``budget``-token step, then ``sum(outputs - 1) / rows`` decode steps
    of ``rows = min(concurrency, len(work), fits(context))`` rows at the mean context. ``fits(context)``: how many
    sequences of that context the engine runs at once (its KV pages and ``max_num_seqs``; ``None``: no limit);
    without it a concurrency beyond the cache's room failed to reserve its rows (at c=1024 on the H200).
    ``cached_tokens``: prompt tokens the measured run found in its prefix cache; they are not prefilled here either,
    so the estimate times the same GPU work the run did."""
    prompts = sum(len(p) for p, _ in work)
    outputs = sum(n for _, n in work)
    context = round(prompts / len(work) + outputs / len(work) / 2)
    rows = max(1, min(concurrency, len(work), fits(context) if fits else len(work)))
    decode_ms = timer("decode", rows, context)
    prefill_ms_per_token = timer("prefill", budget, 0) / budget
    decode_steps = math.ceil(sum(n - 1 for _, n in work) / rows)
    gpu_s = ((prompts - cached_tokens) * prefill_ms_per_token + decode_steps * decode_ms) / 1e3
    return {"concurrency": concurrency, "gpu_bound_output_tok_s": outputs / gpu_s if gpu_s else None,
            "decode_step_ms": decode_ms, "decode_rows": rows, "context": context,
            "prefill_us_per_token": 1e3 * prefill_ms_per_token, "cached_tokens": cached_tokens}


def engine_fits(engine: Any) -> Callable[[int], int]:
    """How many sequences of ``context`` tokens (and the one being decoded) ``engine`` can run at once: its idle
    cache's free pages over the pages each needs, at most ``max_num_seqs``."""
    cache = engine.cache

    def fits(context: int) -> int:
        return min(engine.config.max_num_seqs, cache.num_free_pages // pages_for(context + 1, cache.page_size))

    return fits


def engine_timer(engine: Any, repeats: int = 8) -> StepTimer:
    """A :data:`StepTimer` on ``engine``'s modules and cache (idle engine: its pages are free): the module a
    step of that shape would replay (``executor.pick``) and the LM head with argmax on the rows it samples (one per
    sequence: every row of a decode step), called ``repeats`` times back to back after one warm call
    (:func:`~piecegraph.graphs.capture.pipelined_ms`: one pair of CUDA events). The sequences it makes are freed
    again. (The LM head counts: a 0.5B-shaped step at batch 1 reads its 272 MB too, ~60 us on an H200.)"""
    cache = engine.cache

    def timer(kind: str, n: int, context: int) -> float:
        if kind == "decode":
            seqs = [(("gpu-bound", i), context, 1) for i in range(n)]
            cache.reserve([(s, context + 1) for s, _, _ in seqs])
        else:
            per = min(n, cache.max_seq_len)
            seqs = [(("gpu-bound", i), 0, min(per, n - i * per)) for i in range(math.ceil(n / per))]
        try:
            meta = AttentionMetadata.for_batch(cache, seqs)
            module = engine.executor.pick(meta).module
            ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=cache.device)
            # The rows a step samples (each sequence's last token): their LM head and argmax are GPU work too
            ends = torch.tensor([q for _, _, q in seqs], device=cache.device).cumsum(0) - 1

            def step(_: int) -> None:
                with forward_context(meta):
                    hidden = module(ids, meta.positions)
                engine.model.logits(hidden[ends]).argmax(-1)

            return pipelined_ms(step, warmup=1, repeats=repeats)
        finally:
            for seq, _, _ in seqs:
                cache.discard(seq)

    return timer
