"""Greedy generation over the flat-token layout: one packed prefill, then batched decode steps."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Sequence

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.metadata import AttentionMetadata, BatchLayout, to_device
from piecegraph.attention.pages import SCRATCH_PAGE, pages_for
from piecegraph.context import forward_context
from piecegraph.models.config import ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.facts import model_facts
from piecegraph.program import describe

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def generate(model: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             cache: KVCache | None = None, prefill_fn: StepFn | None = None,
             decode_fn: StepFn | None = None, eos_token_id: int | Iterable[int] | None = None) -> list[list[int]]:
    """Greedy-decode up to ``max_new_tokens`` tokens after each prompt; returns the new tokens per prompt.

    The prompts live in ``cache`` (default: a fresh paged cache just large enough) as sequences
    ``("generate", i)``, freed as they finish. ``prefill_fn`` and ``decode_fn`` (default ``model``) take
    ``(input_ids [T], positions [T])`` and return hidden states with at least ``T`` rows: pass a graphed or
    compiled module to exercise it. ``eos_token_id`` (an id or several) stops a sequence after it emits one (kept
    in its output, as Hugging Face keeps it). See :func:`greedy_loop`, the loop every piecegraph greedy caller
    shares.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt, and every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    if cache is None:
        facts, longest = model_facts(model), max(len(p) for p in prompts) + max_new_tokens
        cache = KVCache.for_sequences(model.config, len(prompts), longest, dtype=facts.dtype, device=facts.device)
    return greedy_loop(model, cache, prompts, max_new_tokens, prefill_fn=prefill_fn or model,
                       decode_fn=decode_fn or model, stop=stop_ids(eos_token_id))


def stop_ids(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    """``eos_token_id`` (``None``, one id or several) as a set of ints; anything else (a bool, a float, a string)
    raises ``TypeError`` naming ``eos_token_id``: a stop id that never matches would generate silently past EOS."""
    if eos_token_id is None:
        return frozenset()
    one = isinstance(eos_token_id, (int, str, bytes)) or not hasattr(eos_token_id, "__iter__") or (
        isinstance(eos_token_id, torch.Tensor) and eos_token_id.dim() == 0)
    ids = (eos_token_id,) if one else tuple(eos_token_id)
    out = set()
    for t in ids:  # ints, numpy ints, 0-d integer tensors; never a bool, float or string
        try:
            if isinstance(t, bool):
                raise TypeError
            out.add(operator.index(t))
        except TypeError:
            raise TypeError(f"eos_token_id={describe(eos_token_id)} must be an int token id or a list of them "
                            f"(got {describe(t)})") from None
    return frozenset(out)


def greedy_loop(model: Any, cache: KVCache, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                prefill_fn: StepFn, decode_fn: StepFn, stop: frozenset[int] = frozenset(),
                tag: str = "generate") -> list[list[int]]:
    """The one greedy loop: a packed prefill of every prompt, then pure decode steps over the sequences still
    running, until each has ``max_new_tokens`` tokens or emitted an id in ``stop`` (kept in its output).

    ``model.logits(hidden_rows)`` turns hidden states into logits (the reference decoder and
    ``piecegraph.hf.HFDecoder`` both have it). Prompts are non-empty and ``max_new_tokens >= 1`` (the public
    callers check). Sequences are ``(tag, i)`` in ``cache``: ids the cache already holds are refused; each
    sequence's pages are freed as soon as it finishes, and every page on the way out, errors included.
    Each decode step builds its metadata once on the host (pages, the backend's plan), so ``decode_fn`` may replay
    full CUDA graphs.

    Overlapped on a GPU: step k+1 is launched on step k's tokens while they are still on the device, and the host
    reads step k's tokens (a pinned copy and an event, see :func:`start_host_copy`) while step k+1 runs. A
    sequence that stopped at step k therefore runs once more in step k+1, whose token for it is dropped. Its
    pages are freed when the host learns it stopped: a step that reuses them is queued after step k+1 on the same
    stream. The tokens are the synchronous loop's exactly: each step's inputs are the previous step's argmax,
    whoever reads them.
    """
    ids = [(tag, i) for i in range(len(prompts))]
    taken = set(ids) & set(cache.sequences())
    if taken:
        raise ValueError(f"the KV cache already holds sequences {sorted(taken)}; generate() uses those ids")
    device = cache.device
    out: list[list[int]] = [[] for _ in prompts]
    try:
        meta = AttentionMetadata.for_batch(cache, [(s, 0, len(p)) for s, p in zip(ids, prompts)])
        input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
        with forward_context(meta):
            hidden = prefill_fn(input_ids, meta.positions)
        ends = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
        tokens = model.logits(hidden[ends]).argmax(-1)
        running, made = list(range(len(prompts))), 1  # rows of `tokens`; tokens each running sequence has
        pending, rows = start_host_copy(tokens), None  # rows: which of pending's rows still run
        while running:
            launched = None
            if made < max_new_tokens:  # step made+1, on the device's tokens, before this step's are read
                meta = AttentionMetadata.for_decode(cache, [(ids[i], len(prompts[i]) + made - 1) for i in running])
                with forward_context(meta):
                    hidden = decode_fn(tokens, meta.positions)
                tokens = model.logits(hidden[: len(running)]).argmax(-1)
                launched = start_host_copy(tokens)
            values = read_host_copy(pending)  # step `made`'s tokens: the launch above is already queued
            values = values if rows is None else [values[r] for r in rows]
            keep = _record(values, running, out, stop, made, max_new_tokens)
            kept, rows = set(keep), None
            for i in running:  # a step in flight may still use them: any later one runs after it, on this stream
                if i not in kept:
                    cache.free(ids[i])
            if launched is not None and len(keep) < len(running):  # the next step runs the survivors' rows only
                rows = [r for r, i in enumerate(running) if i in kept]
                tokens = tokens.index_select(0, to_device({"rows": rows}, device)["rows"])
            running, pending, made = keep, launched, made + 1
    finally:
        for s in ids:
            if s in cache.sequences():
                cache.free(s)
    return out


def start_host_copy(tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying ``tokens`` to the host without waiting: ``(pinned host tensor, event after the copy)``; on
    a CPU the tensor itself and no event. Read it with :func:`read_host_copy`."""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def read_host_copy(copy: tuple[torch.Tensor, Any]) -> list[int]:
    """The values of :func:`start_host_copy`, waiting for that copy only (not for work queued after it)."""
    host, ready = copy
    if ready is not None:
        ready.synchronize()
    return host.tolist()


def _record(tokens: list[int], running: list[int], out: list[list[int]], stop: frozenset[int], made: int,
            limit: int) -> list[int]:
    """Append each running sequence's token; return those that go on."""
    keep = []
    for i, token in zip(running, tokens):
        out[i].append(token)
        if token not in stop and made < limit:
            keep.append(i)
    return keep


def dummy_inputs(model_or_config: Decoder | ModelConfig, cache: KVCache, n: int
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """``((input_ids, positions), meta)`` of ``n`` pad tokens (all zeros) for warm-up and capture.

    A pure decode step: running the model on them only touches the cache's scratch page. ``model_or_config``
    checks that the cache was built for this model's shape.
    """
    _check_cache_shape(model_or_config, cache)
    zeros = torch.zeros(n, dtype=torch.int64, device=cache.device)
    return (zeros, zeros.clone()), AttentionMetadata.dummy(cache, n)


def dummy_mixed_inputs(model_or_config: Decoder | ModelConfig, cache: KVCache, n: int, seqs: int
                       ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
    """``((input_ids, positions), meta)`` of a prefill step of ``n`` >= 2 pad tokens over ``min(seqs, n - 1)``
    fresh sequences of near-equal lengths (so at least one has two tokens: not a decode step), every token on the
    scratch page: what a mixed-step CUDA graph of ``n`` tokens is captured with. Its plan's schedule depends only
    on ``n`` and the graph's sequence slots, so any such layout serves every later step that fits."""
    if n < 2:
        raise ValueError(f"a mixed step has at least 2 tokens, got n={n}")
    _check_cache_shape(model_or_config, cache)
    k = min(seqs, n - 1)
    lengths = [n // k + (i < n % k) for i in range(k)]
    layout = BatchLayout(seq_ids=tuple(("pad", i) for i in range(k)), num_new=tuple(lengths),
                         kv_lens=tuple(lengths), pages=tuple((SCRATCH_PAGE,) * pages_for(m, cache.page_size)
                                                             for m in lengths),
                         page_size=cache.page_size)
    meta = AttentionMetadata.from_layout(cache, layout)
    return (torch.zeros(n, dtype=torch.int64, device=cache.device), meta.positions.clone()), meta


def _check_cache_shape(model_or_config: Decoder | ModelConfig, cache: KVCache) -> None:
    """Raises unless ``cache`` was built for this model's layers, KV heads and head size."""
    config = model_or_config if isinstance(model_or_config, ModelConfig) else model_or_config.config
    if (config.num_layers, config.num_kv_heads, config.head_dim) != (
            len(cache.k), cache.num_kv_heads, cache.head_dim):
        raise ValueError("the KV cache was built for a different model shape than the one given")
