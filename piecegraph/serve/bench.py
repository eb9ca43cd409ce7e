"""The serving benchmark: seeded random requests, closed-loop clients per concurrency, latency and throughput.

Closed loop: ``concurrency`` clients each keep one request in flight; when one finishes, its client submits the
next, until ``num_requests`` are done. Times are wall seconds on the host (``time.perf_counter``) taken when a
step's tokens reach the host (the engine waits for them: in its own step, or overlapped, one step later while the
next step runs), so TTFT and ITL are what a client would see. TTFT = first token - arrival; ITL = the gaps
between a request's consecutive tokens, pooled over requests.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.context import forward_context
from piecegraph.serve.engine import Engine
from piecegraph.serve.gc_pauses import GcPauses
from piecegraph.serve.request import Request, SamplingParams


@dataclass(frozen=True)
class Workload:
    """Random prompts and output lengths like the peers' ``random`` dataset: lengths uniform in
    ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (at least 1), token ids uniform, all from ``seed``.

    ``prefix_len`` > 0: the shared-prefix workload (chat system prompts, few-shot examples): each prompt is one of
    ``num_prefixes`` fixed random prefixes of ``prefix_len`` tokens (the same for every draw of ``seed``), in turn,
    then a random suffix of the lengths above: what a prefix cache reuses."""

    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.25
    seed: int = 0
    prefix_len: int = 0
    num_prefixes: int = 1

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"Workload lengths must be >= 1, got input {self.input_len}, output {self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"Workload.range_ratio={self.range_ratio!r} must be in [0, 1)")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ValueError(f"Workload.prefix_len={self.prefix_len!r} must be >= 0 and num_prefixes="
                             f"{self.num_prefixes!r} >= 1")

    @property
    def kind(self) -> str:
        return "shared-prefix" if self.prefix_len else "random"

    def bounds(self, length: int) -> tuple[int, int]:
        return max(1, math.floor(length * (1 - self.range_ratio))), math.ceil(length * (1 + self.range_ratio))

    @property
    def max_len(self) -> int:
        """The longest request (prompt + output) it can draw."""
        return self.prefix_len + self.bounds(self.input_len)[1] + self.bounds(self.output_len)[1]

    def requests(self, n: int, vocab_size: int, salt: int = 0) -> list[tuple[list[int], int]]:
        """``n`` ``(prompt, max_new_tokens)`` pairs; ``salt`` gives other draws of the same distribution (the
        shared prefixes stay)."""
        shared = random.Random(self.seed * 7919 - 1)
        prefixes = [[shared.randrange(vocab_size) for _ in range(self.prefix_len)] for _ in range(self.num_prefixes)]
        rng = random.Random(self.seed * 7919 + salt)
        out = []
        for i in range(n):
            prompt_len = rng.randint(*self.bounds(self.input_len))
            prompt = prefixes[i % self.num_prefixes] + [rng.randrange(vocab_size) for _ in range(prompt_len)]
            out.append((prompt, rng.randint(*self.bounds(self.output_len))))
        return out


def requests_for(concurrency: int, rounds: float, min_requests: int, max_requests: int) -> int:
    """Requests to run at ``concurrency``: ``rounds`` per client, within ``[min_requests, max_requests]``, and
    never fewer than the clients (every client gets one)."""
    return max(concurrency, min(max(min_requests, math.ceil(rounds * concurrency)), max_requests))


def closed_loop(engine: Engine, work: Sequence[tuple[list[int], int]], concurrency: int) -> list[Request]:
    """Run ``work`` through ``engine`` with ``concurrency`` clients; returns the finished requests in order. The
    loop is :meth:`Engine.run`'s (its heap frozen as ``EngineConfig.freeze_gc`` says), each finish submitting the
    next request."""
    todo = deque(work)

    def submit(_: Request | None = None) -> None:
        if todo:
            prompt, max_new = todo.popleft()
            engine.add_request(prompt, SamplingParams(max_new_tokens=max_new))

    for _ in range(min(concurrency, len(todo))):
        submit()
    return engine.run(on_finish=submit)


def _dist(values: Sequence[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_mean_ms": None, f"{prefix}_p50_ms": None, f"{prefix}_p99_ms": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {f"{prefix}_mean_ms": 1e3 * sum(ordered) / len(ordered), f"{prefix}_p50_ms": 1e3 * pct(0.5),
            f"{prefix}_p99_ms": 1e3 * pct(0.99)}


def metrics(requests: Sequence[Request], seconds: float) -> dict[str, Any]:
    """Request and token throughput, TTFT and ITL distributions of finished ``requests`` over ``seconds``."""
    outputs = sum(len(r.output) for r in requests)
    prompts = sum(len(r.prompt) for r in requests)
    ttft = [r.first_token - r.arrival for r in requests if r.first_token is not None]
    itl = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    cached = sum(r.cached_tokens for r in requests)
    return {
        "requests": len(requests), "duration_s": seconds, "prompt_tokens": prompts, "output_tokens": outputs,
        "request_throughput": len(requests) / seconds, "output_tok_s": outputs / seconds,
        "total_tok_s": (prompts + outputs) / seconds, **_dist(ttft, "ttft"), **_dist(itl, "itl"),
        "preempted_requests": sum(r.preemptions > 0 for r in requests),
        "cached_tokens": cached, "prefix_hit_rate": cached / prompts if prompts else 0.0,
    }


def median_run(run: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """``run()`` ``repeats`` times; the row of the run with the median output tok/s (the upper one of an even
    count), with every run's output tok/s in ``repeats_output_tok_s`` when there was more than one, and (where the
    rows have them) every run's ms per step by kind and GC pause ms, to tell a slow run's cause. One machine's
    runs of the same loop vary by 10-20% on a GPU host (18.5k-22.4k output tok/s at c=256 on an H200), more than
    many differences worth measuring."""
    return median_row([run() for _ in range(max(1, repeats))])


def median_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of one loop's runs (in run order), the row :func:`median_run` reports."""
    if len(rows) == 1:
        return rows[0]
    ranked = sorted(rows, key=lambda row: row["output_tok_s"])
    every = {f"repeats_{key}": [row[key] for row in rows] for key in ("ms_per_step", "gc_pause_ms")
             if all(key in row for row in rows)}
    return {**ranked[len(ranked) // 2], "repeats_output_tok_s": [round(row["output_tok_s"], 1) for row in rows],
            **every}


def measure(engine: Engine, work: Sequence[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    """One concurrency: the closed loop, its metrics, the engine's step summary (graph share, padding) and the
    garbage collector's pauses during the loop (:class:`~piecegraph.serve.gc_pauses.GcPauses`). The prefix cache
    starts cold (what earlier runs cached is forgotten), so repeats and modes compare alike; ``cached_tokens`` and
    ``prefix_hit_rate`` say what the run's own requests shared."""
    engine.reset_stats()
    engine.reset_prefix_cache()
    _sync(engine)
    with GcPauses() as pauses:
        start = time.perf_counter()
        done = closed_loop(engine, work, concurrency)
        seconds = time.perf_counter() - start
    if len(done) != len(work) or engine.cache.num_free_pages != engine.cache.num_pages - 1:
        raise RuntimeError(f"the engine finished {len(done)} of {len(work)} requests and holds "
                           f"{engine.cache.num_pages - 1 - engine.cache.num_free_pages} pages after the run")
    steps = engine.stats()
    return {"concurrency": concurrency, **metrics(done, seconds), "steps": steps["steps"],
            "graph_share": steps["graph_share"], "padding_share": steps["padding_share"],
            "steps_by_kind": steps["by_kind"], "ms_per_step": steps["ms_per_step"], "phase_ms": steps["phase_ms"],
            "plan_us": steps["plan_us"], "plans_per_step": steps["plans_per_step"],
            "max_plans_per_step": steps["max_plans_per_step"], "preemptions": steps["preemptions"],
            "overlap": engine.config.overlap, "prefix_cache": engine.config.prefix_cache, **pauses.summary()}


@torch.no_grad()  # not inference_mode: graphs and buffers made here are used outside it later
def decode_reference(engine: Engine, prompt_len: int, steps: int, seed: int = 0) -> dict[str, Any] | None:
    """A synchronous decode loop at concurrency 1: one sequence, prefilled once, then ``steps`` pure decode steps
    through the engine's full-graph module with nothing else (no scheduler, no sampling beyond argmax), each step
    timed to its token on the host. Each step builds its metadata and plans only after the previous token reached
    the host, so host work and device time add up: it is the ITL of a loop without overlap, not a floor for the
    overlapped engine, which prepares step k+1 while step k runs (on an H100: 2.28 ms here against 1.65 ms in
    ``auto``'s own decode on the 0.5B shape). ``None`` when the engine has no full graphs (only ``mode="auto"``)."""
    decode = engine.executor.decode
    if decode is None:
        return None
    cache, vocab = engine.cache, engine.model.config.vocab_size
    rng = random.Random(seed)
    seq = ("decode-reference", seed)
    ids = torch.tensor([rng.randrange(vocab) for _ in range(prompt_len)], device=cache.device)
    try:
        meta = AttentionMetadata.for_batch(cache, [(seq, 0, prompt_len)])
        with forward_context(meta):
            hidden = engine.executor.mixed.module(ids, meta.positions)
        token = engine.model.logits(hidden[-1:]).argmax(-1)
        gaps = []
        _sync(engine)
        last = time.perf_counter()
        for i in range(steps):
            meta = AttentionMetadata.for_decode(cache, [(seq, prompt_len + i)])
            with forward_context(meta):
                hidden = decode.module(token, meta.positions)
            token = engine.model.logits(hidden[:1]).argmax(-1)
            token.tolist()  # the host needs the token, as a server does
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    finally:
        cache.discard(seq)
    return {"concurrency": 1, "prompt_len": prompt_len, "steps": steps, **_dist(gaps, "itl")}


def _sync(engine: Engine) -> None:
    if engine.cache.device.type == "cuda":
        torch.cuda.synchronize()
